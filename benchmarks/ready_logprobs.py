"""`python -m benchmarks.ready_logprobs`: peak memory of one training micro-batch at a 150k-token
vocabulary, the chunked target logprobs (`rollout.truncation.target_logprobs`) against the
unchunked fp32 computation they replace (`target_logprobs_unchunked`), and how far their numbers
are apart.

The micro-batch is one `Learner.forward_backward` (LoRA, importance-sampling loss) of a small
Llama (hidden 64, 2 layers, tied embeddings) with a 150,000-token vocabulary: `ROWS` sequences of
`SEQ` tokens, the last `SEQ - PROMPT` of each weighted, so the output layer runs over
ROWS x (SEQ - PROMPT + 1) positions. The old path is measured by running the same call with the
learner's `target_logprobs` swapped for the unchunked one.

Peak memory: on CUDA, `torch.cuda.max_memory_allocated` above what was allocated before the
call. On CPU, the process's peak resident memory (VmHWM, reset through /proc/self/clear_refs)
above its resident memory before the call, measured in a child process started with glibc's
`MALLOC_MMAP_THRESHOLD_` fixed at 64 KiB: every tensor larger than that is its own mapping, given
back to the system when freed, so resident memory follows live tensors instead of the
allocator's cached free lists. Imports neither dagster, mlflow nor deepspeed (runs on the bare
GPU image).

Figures (last line, JSON): `peak_logprob_mb_150k_vocab`, `peak_logprob_mb_150k_vocab_old` (MB of
peak memory above the start of the micro-batch), `logits_mb` (one [rows, positions, V] tensor of
the model's dtype), `dtype` (the model's: fp32 on a CPU, bf16 on a GPU), on a CPU the same three
again with a bf16 model (`*_bf16`), `chunked_logprobs_max_abs_diff` and `chunked_grad_max_abs_diff` (fp32 logits,
new against old, logprobs and their gradient with respect to the logits), `seconds`.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time

import torch

VOCAB = 150_000
ROWS, SEQ, PROMPT = 8, 80, 16
"""One micro-batch: 8 sequences of 80 tokens, 64 weighted: 8 x 65 logit rows, 312 MB in fp32."""
MMAP_THRESHOLD = 65536


def build_model(vocab_size: int = VOCAB, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """A seeded small Llama with a large vocabulary (its output layer dominates memory)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=1, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    return model.to(device=device, dtype=dtype).eval()


def micro_batch(vocab_size: int = VOCAB, rows: int = ROWS, seq: int = SEQ, prompt: int = PROMPT, seed: int = 0):
    """`rows` distinct datums (no shared prefix) with an importance-sampling loss's fields."""
    from tinker_pipelines.types import Datum

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        tokens = torch.randint(2, vocab_size, (seq + 1,), generator=g).tolist()
        w = [0.0] * (prompt - 1) + [1.0] * (seq - prompt + 1)
        adv = torch.randn(seq, generator=g).tolist()
        out.append(Datum(tuple(tokens[:-1]), tuple(tokens[1:]), tuple(w),
                         behaviour_logprobs=tuple(-12.0 * x for x in w), advantages=tuple(a * x for a, x in zip(adv, w))))
    return out


@contextlib.contextmanager
def unchunked_logprobs():
    """Run the block with the learner's logprobs computed the old way (unchunked, fp32)."""
    from tinker_pipelines.training import learner
    from tinker_pipelines.training import prefix_sharing
    from tinker_pipelines.rollout import truncation

    saved = learner.target_logprobs, prefix_sharing.target_logprobs
    learner.target_logprobs = prefix_sharing.target_logprobs = truncation.target_logprobs_unchunked
    try:
        yield
    finally:
        learner.target_logprobs, prefix_sharing.target_logprobs = saved


def _learner(model):
    from tinker_pipelines.training.learner import Learner, LearnerConfig

    return Learner(model, LearnerConfig(mode="lora", micro_batch_size=ROWS, temperature=0.9, share_prefix=False),
                   pad_token_id=0, init_seed=0)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_mb(fn, device: str) -> float:
    """Peak memory (MB) that `fn()` adds above what was in use when it started (see the module doc)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 1e6
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != str(MMAP_THRESHOLD):
        raise RuntimeError("CPU peaks are measured in a process started with MALLOC_MMAP_THRESHOLD_="
                           f"{MMAP_THRESHOLD} (run it through cpu_peaks_in_child)")
    before = _status_kb("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # resets VmHWM to the current resident size
        f.write("5")
    fn()
    return (_status_kb("VmHWM") - before) * 1024 / 1e6


def micro_batch_peaks(device: str = "cpu", old: bool = True, dtype: torch.dtype | None = None) -> dict:
    """Peak MB of one micro-batch's forward+backward, new path (and old), in this process; the
    model in `dtype` (default: fp32 on a CPU, where bf16 matmuls are slow; bf16 elsewhere)."""
    from tinker_pipelines.algorithms.losses import importance_sampling_loss

    dtype = dtype or (torch.float32 if device == "cpu" else torch.bfloat16)
    learner = _learner(build_model(dtype=dtype, device=device))
    datums = micro_batch()
    learner.forward_backward(datums, importance_sampling_loss)  # warm-up: lazy allocations, oneDNN / cuBLAS
    learner.optimizer.zero_grad(set_to_none=False)  # gradients stay allocated: both passes start alike
    out = {"peak_logprob_mb_150k_vocab": peak_mb(lambda: learner.forward_backward(datums, importance_sampling_loss),
                                                 device)}
    if old:
        learner.optimizer.zero_grad(set_to_none=False)
        with unchunked_logprobs():
            out["peak_logprob_mb_150k_vocab_old"] = peak_mb(
                lambda: learner.forward_backward(datums, importance_sampling_loss), device)
    out["logits_mb"] = ROWS * (SEQ - PROMPT + 1) * VOCAB * dtype.itemsize / 1e6
    out["dtype"] = str(dtype).removeprefix("torch.")
    return out


def cpu_peaks_in_child(old: bool = True, dtype: str = "float32", timeout: float = 300) -> dict:
    """`micro_batch_peaks` on CPU in a fresh process with the fixed mmap threshold."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)}
    code = f"import json, torch; from benchmarks.ready_logprobs import micro_batch_peaks; " \
           f"print(json.dumps(micro_batch_peaks('cpu', old={old!r}, dtype=torch.{dtype})))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if done.returncode != 0:
        raise RuntimeError(f"the CPU peak measurement failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def logprob_differences(device: str = "cpu") -> dict:
    """Max |new - old| of the logprobs and of their gradient, on one micro-batch's fp32 logits
    (with top-p on, so the truncated path is compared too)."""
    from tinker_pipelines.rollout.truncation import target_logprobs, target_logprobs_unchunked

    g = torch.Generator().manual_seed(1)
    logits_BKV = (torch.randn(2, 64, VOCAB, generator=g) * 3).to(device)
    targets_BK = torch.randint(0, VOCAB, (2, 64), generator=g).to(device)
    w_BK = torch.randn(2, 64, generator=g).to(device)
    diffs = {"chunked_logprobs_max_abs_diff": 0.0, "chunked_grad_max_abs_diff": 0.0}
    for kw in ({}, {"top_p": 0.9}):
        results = []
        for fn in (target_logprobs, target_logprobs_unchunked):
            x = logits_BKV.clone().requires_grad_(True)
            lp_BK = fn(x, targets_BK, 0.9, **kw)
            (lp_BK * w_BK).sum().backward()
            results.append((lp_BK.detach(), x.grad))
        (a, ga), (b, gb) = results
        diffs["chunked_logprobs_max_abs_diff"] = max(diffs["chunked_logprobs_max_abs_diff"], float((a - b).abs().max()))
        diffs["chunked_grad_max_abs_diff"] = max(diffs["chunked_grad_max_abs_diff"], float((ga - gb).abs().max()))
    return diffs


def measure(device: str = "cpu") -> dict:
    """The figures in the module doc."""
    t0 = time.perf_counter()
    peaks = cpu_peaks_in_child() if device == "cpu" else micro_batch_peaks(device)
    if device == "cpu":  # the dtype a GPU trains in, for comparison (its logits are half the size)
        bf16 = cpu_peaks_in_child(dtype="bfloat16")
        peaks.update({f"{k}_bf16": bf16[k] for k in ("peak_logprob_mb_150k_vocab", "peak_logprob_mb_150k_vocab_old",
                                                     "logits_mb")})
    return {**peaks, **logprob_differences(device), "device": device, "seconds": round(time.perf_counter() - t0, 1)}


if __name__ == "__main__":
    from benchmarks import ready_main

    ready_main(measure)
