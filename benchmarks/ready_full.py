"""Does full-parameter bf16 training learn at RL learning rates? A few AdamW steps at lr 1e-6 on
the tiny model, in bf16 (fp32 master weights) and in fp32 from the same initial weights, on the
same SFT batch; how far the bf16 run's weights and masters get along the fp32 run's path.

- `full_bf16_weights_move`: the bf16 weights change, and follow the fp32 run wherever its change
  is visible in bf16: of the elements whose fp32-run weight, rounded to bf16, left its start
  value, the share whose bf16 weight is that same value (`full_bf16_recall`) is >= 0.9
  (measured 0.99 on CPU; without masters 0.10: updates of ~1e-6 round away in bf16, only
  weights below ~3e-4 move at all).
- `full_bf16_vs_fp32_max_rel`: over the parameter tensors, the largest ||d_master - d_fp32|| /
  ||d_fp32|| (the bf16 run's fp32 masters against the fp32 run's weights; measured 0.094 on CPU,
  from the bf16 forward's gradient; inf without masters).

Imports neither dagster, mlflow nor deepspeed (it runs on bare GPU machines). Run:
`python -m benchmarks.ready_full` (CPU) or `measure("cuda")`.
"""

from __future__ import annotations

import time

import torch

STEPS = 5
LR = 1e-6


def _datums(vocab: int, n: int = 8, length: int = 24, seed: int = 0):
    from tinker_pipelines.types import Datum

    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        toks = torch.randint(3, vocab, (length + 1,), generator=gen).tolist()
        weights = (0.0,) * 4 + (1.0,) * (length - 4)
        out.append(Datum(tuple(toks[:-1]), tuple(toks[1:]), weights))
    return out


def train(dtype: torch.dtype, device: str, steps: int = STEPS, lr: float = LR):
    """(learner, initial fp32 weights by name, datums) after `steps` SFT steps from tiny seed 0 in `dtype`.
    Both dtypes start from the same values: the fp32 run starts from the bf16-rounded weights."""
    from tinker_pipelines.algorithms import get_algorithm
    from tinker_pipelines.training.learner import Learner, LearnerConfig
    from tinker_pipelines.models import load_model

    model, tok = load_model("tiny", seed=0, dtype=torch.bfloat16, device=device)
    model = model.to(dtype)
    init = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    learner = Learner(model, LearnerConfig(mode="full", learning_rate=lr), tok.pad_token_id)
    datums = _datums(model.config.vocab_size)
    loss = get_algorithm("sft").loss
    for _ in range(steps):
        learner.forward_backward(datums, loss)
        learner.optim_step()
    return learner, init


def compare(bf16, fp32, init) -> dict:
    """The figures of the module docstring, from two trained learners and their common start."""
    w16 = {n: p.detach().float() for n, p in bf16.model.named_parameters()}
    w32 = {n: p.detach().float() for n, p in fp32.model.named_parameters()}
    masters = getattr(bf16, "masters", None)
    m16 = dict(zip(masters.names, masters.masters)) if masters is not None else {}
    should = hit = moved = total = 0
    worst = 0.0 if m16 else float("inf")
    for n, w0 in init.items():
        visible = w32[n].to(torch.bfloat16).float()
        should_move = visible != w0
        should += int(should_move.sum())
        hit += int((should_move & (w16[n] == visible)).sum())
        moved += int((w16[n] != w0).sum())
        total += w0.numel()
        if n in m16:
            dm, d32 = m16[n].detach() - w0, w32[n] - w0
            worst = max(worst, float((dm - d32).norm() / d32.norm().clamp_min(1e-30)))
    recall = hit / max(should, 1)
    return {"full_bf16_weights_move": bool(moved > 0 and recall >= 0.9),
            "full_bf16_vs_fp32_max_rel": worst, "full_bf16_recall": recall,
            "full_bf16_moved_fraction": moved / total, "full_bf16_has_masters": bool(m16)}


def measure(device: str = "cpu") -> dict:
    """Train the pair on `device` and compare (seconds on a CPU)."""
    start = time.perf_counter()
    bf16, init = train(torch.bfloat16, device)
    fp32, _ = train(torch.float32, device)
    out = compare(bf16, fp32, init)
    out.update(device=device, steps=STEPS, learning_rate=LR, seconds=round(time.perf_counter() - start, 2))
    return out


if __name__ == "__main__":
    from benchmarks import ready_main

    ready_main(measure)
