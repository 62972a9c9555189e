"""Export a trained LoRA policy for other stacks: a PEFT adapter, its base, and merged weights.

`export_checkpoint(checkpoint, out)` writes, atomically, under `out/`:

- `base/`    the base the adapter was trained on (the catalogue model, or the SFT warm start
             the checkpoint's record names by content hash) as a Hugging Face directory;
- `adapter/` the adapter as PEFT writes it (`adapter_config.json` + `adapter_model.safetensors`,
             the base path pointing at `base/`), with the tokenizer and chat template: what
             `PeftModel.from_pretrained` and vLLM's `--lora-modules` load;
- `merged/`  base + adapter merged into plain weights (safetensors), with the tokenizer and
             chat template: a model any `from_pretrained` loads, no PEFT needed;
- `record.json` the source, the base, the measured logit differences and every file's hash.

Each artifact is loaded back from disk with plain transformers / PEFT and its logits are
compared with the policy as this library evaluates it (`Experiment.resume` on its base);
the export fails (`ExportError`) and leaves nothing behind when they differ by more than
`tolerance` times the logits' scale (their largest magnitude, at least 1). The value head of a PPO checkpoint is training state, not policy: not exported.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from tinker_pipelines.bases import recorded_base
from tinker_pipelines.checkpoint import atomic_directory, read_record, write_record
from tinker_pipelines.config import config_from_dict

LLAMA_LINEAR = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"})
"""Llama's linear layers: the LoRA targets vLLM's Llama implementation can apply."""
_KEY = re.compile(r"^base_model\.model\..+\.lora_[AB]\.weight$")


class ExportError(RuntimeError):
    """An export that cannot be made, or whose artifacts do not reproduce the policy."""


def vllm_format_problems(adapter_dir: str | Path) -> list[str]:
    """What in a PEFT adapter directory vLLM's LoRA loader would refuse (empty: none): a
    non-LoRA or DoRA adapter, bias terms, `modules_to_save`, targets outside Llama's linear
    layers, tensors not named `base_model.model.<module>.lora_A/B.weight`."""
    from safetensors import safe_open

    d = Path(adapter_dir)
    conf = json.loads((d / "adapter_config.json").read_text())
    problems = []
    if conf.get("peft_type") != "LORA":
        problems.append(f"peft_type is {conf.get('peft_type')!r}, not 'LORA'")
    if conf.get("use_dora"):
        problems.append("use_dora is set")
    if conf.get("bias", "none") != "none":
        problems.append(f"bias is {conf.get('bias')!r}")
    if conf.get("modules_to_save"):
        problems.append(f"modules_to_save is {conf['modules_to_save']}")
    targets = conf.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else targets
    if not targets or set(targets) - LLAMA_LINEAR:
        problems.append(f"target_modules {sorted(targets)} are not all among {sorted(LLAMA_LINEAR)}")
    with safe_open(str(d / "adapter_model.safetensors"), "pt") as f:
        bad = [k for k in f.keys() if not _KEY.match(k)]
    if bad:
        problems.append(f"tensor names vLLM does not map: {bad[:3]}")
    return problems


def _probe(tokenizer) -> torch.Tensor:
    """Two prompts [2, T]: a chat turn and a seeded spread over the vocabulary."""
    from tinker_pipelines.models import encode_chat

    chat = encode_chat(tokenizer, [{"role": "user", "content": "What is 17 + 25? Answer with a number."}])
    g = torch.Generator().manual_seed(0)
    spread = torch.randint(0, len(tokenizer), (len(chat),), generator=g).tolist()
    return torch.tensor([chat, spread])


@torch.no_grad()
def _logits(model: torch.nn.Module, ids_BT: torch.Tensor) -> torch.Tensor:
    dev = next(model.parameters()).device
    return model(input_ids=ids_BT.to(dev)).logits.float().cpu()


def export_checkpoint(checkpoint: str | Path, out: str | Path, base: str | Path | None = None,
                      merged: bool = True, tolerance: float = 1e-4, device: str = "cpu",
                      source: str = "") -> dict[str, Any]:
    """Export the LoRA checkpoint at `checkpoint` (a directory `Experiment.save` wrote, or a
    downloaded registry version) to `out` (which must not exist); returns the export's record.

    `base` is the warm-started base directory the checkpoint was trained on (required when its
    record names one; checked against the recorded content hash). Loads in fp32 on `device`."""
    from tinker_pipelines.models import base_identity

    out = Path(out)
    record, cfg, wanted = _check_source(checkpoint, out, base)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, device=device, dtype="float32"))
    tokenizer, ids_BT, want_BTV = _policy_logits(cfg, checkpoint, base)
    final = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_directory(out) as tmp:
        _write_base(tmp / "base", base, cfg, tokenizer)
        _write_adapter(tmp / "adapter", checkpoint, final / "base", tokenizer)
        diffs = _artifact_logit_diffs(tmp, merged, ids_BT, want_BTV, tokenizer, device)
        # merging rounds W + s*B@A once in fp32: the error grows with the logits' scale, not absolutely
        scale = max(1.0, float(want_BTV.abs().max()))
        far = {k: v for k, v in diffs.items() if not v <= tolerance * scale}
        if far:
            raise ExportError(f"exported {', '.join(far)} give logits up to {max(far.values()):.3g} away from the "
                              f"trained policy (tolerance {tolerance:g} x logit scale {scale:.3g}): not exported")
        problems = vllm_format_problems(tmp / "adapter")
        return write_record(tmp, {
            "kind": "export", "source": source or str(Path(checkpoint).resolve()),
            "base": {**wanted, "identity_here": base_identity(str(base)) if base else wanted["identity"]},
            "checkpoint_content_hash": record["content_hash"], "iteration": record.get("iteration"),
            "max_logit_diff": diffs, "logit_scale": scale, "tolerance": tolerance, "vllm_format_problems": problems,
            "parts": sorted(p.name for p in tmp.iterdir() if p.is_dir())})


def _check_source(checkpoint: str | Path, out: Path, base: str | Path | None) -> tuple[dict, Any, dict]:
    """(the checkpoint's verified record, its config, the base it was trained on); `ExportError`
    when `out` exists, the checkpoint is not LoRA, or `base` is missing, extra or not the one."""
    if out.exists():
        raise ExportError(f"export directory {out} already exists (choose a new one)")
    record = read_record(checkpoint, verify=True)
    cfg = config_from_dict(record["config"])
    if record.get("mode") != "lora":
        raise ExportError(f"checkpoint {checkpoint} trains every parameter (training.mode: {record.get('mode')}): "
                          "its model*.safetensors already are plain weights; export takes LoRA checkpoints")
    wanted = recorded_base(record, cfg)
    if "sft_content_hash" in wanted:
        if base is None:
            raise ExportError(f"checkpoint {checkpoint} was trained on an SFT warm start: pass its base "
                              "directory (export a registered version to have it found)")
        got = read_record(base, verify=False).get("content_hash")  # its files: verified by use_base below
        if wanted["sft_content_hash"] not in (None, got):
            raise ExportError(f"base {base} hashes to {str(got)[:16]}, but checkpoint {checkpoint} was trained on "
                              f"the warm start {wanted['sft_content_hash'][:16]}")
    elif base is not None:
        raise ExportError(f"checkpoint {checkpoint} was trained on the catalogue base {wanted['name']!r}, "
                          "not on a warm start: leave out the base")
    return record, cfg, wanted


def _policy_logits(cfg: Any, checkpoint: str | Path, base: str | Path | None) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """(tokenizer, the probe ids_BT, the policy's logits_BTV on them): the policy as evaluate and
    inference rebuild it; the experiment is dropped before anything is written."""
    from tinker_pipelines.loops.experiment import Experiment

    exp = Experiment(cfg, name="export")
    if base is not None:
        exp.use_base(base)
    exp.start_rl()
    exp.resume(checkpoint)
    ids_BT = _probe(exp.tokenizer)
    return exp.tokenizer, ids_BT, _logits(exp.policy, ids_BT)


def _write_base(base_dir: Path, base: str | Path | None, cfg: Any, tokenizer) -> None:
    """`base/`: the warm start as written (its record kept: it stays verifiable), or the catalogue base."""
    from tinker_pipelines.models import load_model

    if base is not None:
        shutil.copytree(base, base_dir)
        return
    m = cfg.model
    model, _ = load_model(m.name, seed=cfg.seed if m.seed is None else m.seed, dtype=torch.float32,
                          device="cpu", **m.kwargs)
    model.save_pretrained(str(base_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(base_dir))


def write_peft_adapter(adapter_dir: Path, checkpoint: str | Path, base_name: str) -> None:
    """The PEFT adapter of LoRA checkpoint `checkpoint` (`adapter_config.json` +
    `adapter_model.safetensors`, what `PeftModel.from_pretrained` loads) into `adapter_dir`
    (created), its `base_model_name_or_path` set to `base_name`."""
    adapter_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(Path(checkpoint) / "adapter_model.safetensors", adapter_dir / "adapter_model.safetensors")
    conf = json.loads((Path(checkpoint) / "adapter_config.json").read_text())
    conf["base_model_name_or_path"] = str(base_name)
    (adapter_dir / "adapter_config.json").write_text(json.dumps(conf, indent=2, sort_keys=True))


def _write_adapter(adapter_dir: Path, checkpoint: str | Path, final_base: Path, tokenizer) -> None:
    """`adapter/`: the checkpoint's adapter as PEFT wrote it, its base path pointing at where
    `base/` will be once the export is in place, and the tokenizer."""
    adapter_dir.mkdir()
    write_peft_adapter(adapter_dir, checkpoint, str(final_base))
    tokenizer.save_pretrained(str(adapter_dir))


def _artifact_logit_diffs(tmp: Path, merged: bool, ids_BT: torch.Tensor, want_BTV: torch.Tensor, tokenizer,
                          device: str) -> dict[str, float]:
    """Load `adapter/` (and write and load `merged/`) with plain transformers / PEFT; the largest
    logit difference of each from the policy's `want_BTV`. Checks each saved tokenizer."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base_dir, adapter_dir, merged_dir = tmp / "base", tmp / "adapter", tmp / "merged"
    loaded = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).to(device).eval()
    peft = PeftModel.from_pretrained(loaded, str(adapter_dir)).eval()
    diffs = {"adapter": float((_logits(peft, ids_BT) - want_BTV).abs().max())}
    if merged:
        peft.merge_and_unload().save_pretrained(str(merged_dir), safe_serialization=True)
        tokenizer.save_pretrained(str(merged_dir))
        back = AutoModelForCausalLM.from_pretrained(str(merged_dir), dtype=torch.float32).to(device).eval()
        diffs["merged"] = float((_logits(back, ids_BT) - want_BTV).abs().max())
        _check_tokenizer(AutoTokenizer.from_pretrained(str(merged_dir)), tokenizer, merged_dir)
    _check_tokenizer(AutoTokenizer.from_pretrained(str(adapter_dir)), tokenizer, adapter_dir)
    return diffs


def _check_tokenizer(got, want, where: Path) -> None:
    msgs = [{"role": "user", "content": "hi"}]
    a = got.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    b = want.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    if a != b or got.encode("17 + 25") != want.encode("17 + 25"):
        raise ExportError(f"the tokenizer or chat template saved in {where} does not render as the trained one")


def export_version(ref: str, out: str | Path, registry: Any = None, merged: bool = True, tolerance: float = 1e-4,
                   device: str = "cpu") -> dict[str, Any]:
    """Export the registered version `ref` names (`MODEL@ALIAS`, `MODEL/VERSION`, `MODEL`): its
    files verified against the hash it was registered with, on the base its record names
    (a warm start fetched from the registry by content hash). `registry`: a
    `serving.registry.Registry` (default: this deployment's, as `registry_from_env` finds it)."""
    from tinker_pipelines.serving.registry import Registry, registry_from_env

    registry = registry or Registry(*registry_from_env())
    name, version = registry.resolve(ref)
    v = registry.fetch(name, version)
    if v.config is None:  # `export_checkpoint` rebuilds the trained policy from the record's run config
        raise ExportError(f"{name}/{version} ({ref}) was saved through the Tinker API and has no run config; "
                          "export needs one")
    base = v.base_path if v.base_path != v.config.model.name else None
    return export_checkpoint(v.path, out, base, merged, tolerance, device, source=f"{name}/{version} ({ref})")
