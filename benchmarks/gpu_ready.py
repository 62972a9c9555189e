"""Is the GPU path right? The checks that a CPU can make of it, in one run.

    python -m benchmarks.gpu_ready [--device cpu]

Every GPU default this project has (bf16 weights, the leased device, fp32 master weights, logprobs
at a 150k vocabulary) is exercised here on the CPU with the tiny model, in bf16 where the GPU
would use bf16. Each part runs in a process of its own (`python -m benchmarks.ready_*`), so one
part's peak memory or initialized CUDA does not leak into the next:

- `ready_device`: a step forked by the executor's forkserver applies its lease variables while
  CUDA is still uninitialized; an inherited `CUDA_VISIBLE_DEVICES` is composed with the lease; a
  worker's lease keeps exclusive steps off its device.
- `ready_bf16`: a bf16 worker hosting two LoRA adapters (non-zero B) samples a mixed batch and
  trains a shared pass, matching each adapter alone; sampler-vs-learner logprob gap in bf16 with
  a trained adapter, in-process and on the worker.
- `ready_full`: full-parameter bf16 training at lr 1e-6 moves the weights as fp32 does.
- `ready_logprobs`: peak memory of one training micro-batch at a 150k vocabulary, chunked
  logprobs against the full fp32 `log_softmax` they replace.

The last line is one JSON object with the issue's keys; every boolean in it must be true
(`all_ok`). `scripts/gpu_check` runs the same parts on a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

PARTS = ("ready_device", "ready_bf16", "ready_full", "ready_logprobs")

KEYS = ("bf16_worker_ok", "bf16_agreement_max", "bf16_agreement_mean", "bf16_agreement_worker_max",
        "bf16_agreement_worker_mean", "full_bf16_weights_move", "peak_logprob_mb_150k_vocab",
        "peak_logprob_mb_150k_vocab_old", "step_saw_cuda_uninitialized")
"""The figures the GPU-correctness issue asks for, in the order they are printed."""


def run_part(name: str, device: str, timeout_s: float) -> dict:
    """One part in its own interpreter; its last stdout line is its JSON. A part that fails says
    why in `error` (its exit code and the tail of its stderr) instead of stopping the others."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", "--device", device],
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"{name} ran past {timeout_s:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        return {"error": f"{name} exited {proc.returncode}: {tail}"}
    out = json.loads(lines[-1])
    out["seconds"] = round(time.perf_counter() - t0, 1)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="where the parts run (cpu here; cuda on a GPU)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed to each part")
    args = parser.parse_args(argv)
    parts = {}
    for name in PARTS:
        parts[name] = run_part(name, args.device, args.timeout)
        shown = {k: v for k, v in parts[name].items() if not isinstance(v, (dict, list))}
        print(f"{name:>15}: " + ", ".join(f"{k}={v}" for k, v in shown.items()), flush=True)
    merged = {k: v for part in parts.values() for k, v in part.items() if k not in ("seconds", "error")}
    errors = {name: part["error"] for name, part in parts.items() if "error" in part}
    figures = {k: merged.get(k) for k in KEYS}
    old, new = figures["peak_logprob_mb_150k_vocab_old"], figures["peak_logprob_mb_150k_vocab"]
    if old and new:
        print(f"peak memory of one micro-batch at a 150k vocabulary: {new:.0f} MB, "
              f"{old / new:.1f}x less than the full fp32 log_softmax ({old:.0f} MB)")
    booleans = {k: v for k, v in merged.items() if isinstance(v, bool)}
    all_ok = not errors and bool(booleans) and all(booleans.values()) and None not in figures.values()
    print(json.dumps({**figures, **{k: v for k, v in booleans.items() if k not in figures},
                      "errors": errors, "all_ok": all_ok, "device": args.device}))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
