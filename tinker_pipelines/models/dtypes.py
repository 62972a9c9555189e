"""The one dtype rule of training and sampling, and the two small functions that apply it.

- Base weights are in the model's dtype (`model.dtype`: `auto` is bf16 where the hardware
  computes it natively, a GPU of compute capability 8.0+ or a CPU with AMX or AVX512-BF16
  (`cpu_bf16_flag`), and fp32 elsewhere).
- LoRA adapters are in fp32 whatever the base (PEFT's `autocast_adapter_dtype`), and so are
  their gradients and the optimizer's state: a bf16 update of a bf16 weight would lose anything
  below ~2^-8 of the weight.
- A LoRA layer computes what PEFT 0.21's `lora.Linear.forward` computes, in every place that
  runs one (the learner through PEFT or `lora_linear`, the worker's shared passes through
  `worker.batching.row_adapters`, the samplers' decode through `rollout.mixed_lora`):

      y = (base(x) + lora_B(lora_A(x.to(adapter dtype))) * scaling).to(base(x).dtype)

  the base matmul in the base dtype, the low-rank path in the adapter dtype, their sum in the
  wider of the two and rounded once to the base output's dtype (`add_lora`). Where the two
  dtypes are equal (fp32 everywhere) this is the plain sum, as fast and bitwise as before.
- The decoder applies adapters unmerged where their dtype differs from the base's: merging an
  fp32 delta into a bf16 weight copy rounds it to the weight's bf16 grid (a delta of 1e-4 on
  weights of 0.02 comes out with an error of about a third of itself), and the learner never
  merges, so the unmerged form is the function the learner's logprobs and the PPO/GRPO ratios
  are computed with (merging in fp32 instead would need fp32 copies of every weight and still
  compute another function than the learner's bf16 base matmuls). Where the dtypes are equal
  the delta is merged as before (the same function up to float rounding).
- RMSNorm is computed as transformers' `LlamaRMSNorm`: in fp32, cast back, then scaled
  (`rms_norm`). Logits are upcast to fp32 before any softmax (sampler and learner alike).
"""

from __future__ import annotations

import torch

CPUINFO = "/proc/cpuinfo"
"""Where the CPU's feature flags are read (Linux); elsewhere no flag is found and `auto` is fp32."""
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
"""CPU flags under which bf16 matmuls run natively (Intel AMX tiles, AVX512-BF16 dot products on
Intel and AMD): there the sampler runs about 2x faster in bf16 than in fp32. Without them torch
emulates bf16 and runs it far slower than fp32 (~30x on AVX2)."""
_flags_read: dict[str, frozenset[str]] = {}


def cpu_flags(path: str | None = None) -> frozenset[str]:
    """The feature flags of this machine's CPU, read once per file (empty where there is none)."""
    path = path or CPUINFO
    if path not in _flags_read:
        flags: set[str] = set()
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    key, _, value = line.partition(":")
                    if key.strip() in ("flags", "Features"):
                        flags.update(value.split())
                        break  # every core lists the same flags
        except OSError:
            pass
        _flags_read[path] = frozenset(flags)
    return _flags_read[path]


def cpu_bf16_flag() -> str | None:
    """The first of `BF16_CPU_FLAGS` this CPU has (`amx_bf16` before `avx512_bf16`), or None."""
    flags = cpu_flags()
    return next((f for f in BF16_CPU_FLAGS if f in flags), None)


def adapter_input(x: torch.Tensor, adapter_weight: torch.Tensor) -> torch.Tensor:
    """`x` in the adapter's dtype, as PEFT's `_cast_input_dtype` gives it to `lora_A` (no copy
    where the dtypes agree)."""
    return x if x.dtype == adapter_weight.dtype else x.to(adapter_weight.dtype)


def add_lora(base_out: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """`base_out + delta`, summed in the wider dtype and rounded once to `base_out`'s (PEFT's
    `result + lora(x) * scaling` then `result.to(torch_result_dtype)`)."""
    if delta.dtype == base_out.dtype:
        return base_out + delta
    return (base_out + delta).to(base_out.dtype)


def rms_norm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' `LlamaRMSNorm` on `h`, op for op: normalised in fp32, cast back to `h`'s
    dtype, then scaled by `weight` (in fp32 the casts are no-ops: bitwise the former fp32 form)."""
    h32 = h.to(torch.float32)
    h32 = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h32.to(h.dtype)
