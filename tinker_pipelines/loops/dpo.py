"""The DPO training path: SFT warm start (if configured), preference pairs from scored rollouts
of the starting policy, DPO steps (LoRA or full), held-out evaluation.

It reuses `Experiment` (model, sampler, learner, evaluation, checkpoints), so the plain loop,
the CLI and the Dagster `dpo` job run the same code. The reference policy is the starting
policy: the adapter-disabled base under LoRA, a frozen copy under full-parameter training.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Callable

import torch

from tinker_pipelines.algorithms.dpo import dpo_loss
from tinker_pipelines.algorithms.losses import LossBatch, LossConfig
from tinker_pipelines.config import Config
from tinker_pipelines.loops.datums import with_reference_logprobs
from tinker_pipelines.training.learner import Learner, pad_datums
from tinker_pipelines.schedule_rules import eval_due
from tinker_pipelines.types import Datum
from tinker_pipelines.loops.preferences import PreferencePair, generate_pairs, pair_datums, summarize_pairs
from tinker_pipelines.tracking.store import dumps
from tinker_pipelines.loops import run_dir
from tinker_pipelines.loops.experiment import Experiment, derived_seed
from tinker_pipelines.loops.run_dir import append_metrics

OnMetrics = Callable[[dict[str, float]], None]


def loss_config(cfg: Config) -> LossConfig:
    """DPO's loss settings. 'sequence' normalization makes the learner weigh micro-batches by
    their share of pairs, so a micro-batched step equals one big batch (the loss is a mean over pairs)."""
    return LossConfig(beta=cfg.dpo.beta, normalization="sequence")


def preference_pairs(exp: Experiment) -> tuple[list[PreferencePair], int]:
    """`dpo.pairs` pairs sampled from the experiment's current policy, and the tasks it took."""
    d = exp.cfg.dpo
    return generate_pairs(exp.sampler(), exp.tokenizer, exp.env_spec, d.pairs, d.group_size, exp.rollout_cfg,
                          derived_seed(exp.cfg.seed, "dpo-pairs"), d.max_rounds)


@torch.no_grad()
def pair_metrics(learner: Learner, pairs: list[PreferencePair], beta: float,
                 datums: list[Datum] | None = None) -> dict[str, float]:
    """DPO loss, implicit-reward accuracy and margin of the current policy on `pairs` (no gradient).
    `datums`: the pairs' datums (`pair_datums(pairs)`) if already built; those that carry their
    reference logprobs (`run_dpo` computes them once) are not scored by the reference again."""
    datums = pair_datums(pairs) if datums is None else datums
    totals: dict[str, float] = {}
    mb = learner.cfg.micro_batch_size  # even: `Experiment.start_rl` keeps pairs whole
    for start in range(0, len(datums), mb):
        chunk = datums[start:start + mb]
        padded = pad_datums(chunk, learner.pad_token_id, learner.device)
        own = padded.own_reference()
        ref_BT = own if own is not None else learner.reference_logprobs(padded)
        learner.activate()
        # The same forward as a training step's, so an untrained policy's margins are exactly 0.
        lp_BT = learner._logprobs(learner.model, padded)
        loss, metrics = dpo_loss(lp_BT, LossBatch(padded.fields["weights"], ref_logprobs_BT=ref_BT), LossConfig(beta=beta))
        share = len(chunk) / len(datums)
        for k, v in {"dpo/loss": loss.item(), **metrics}.items():
            totals[k] = totals.get(k, 0.0) + v * share
    return {k.replace("dpo/", "pairs/dpo_"): v for k, v in totals.items()}


def run_dpo(exp: Experiment, pairs: list[PreferencePair], on_step: OnMetrics | None = None,
            evaluate: bool = True, precompute_reference: bool | None = None) -> list[dict[str, float]]:
    """`dpo.steps` optimizer steps on random batches of `pairs`; returns per-step metrics.

    With `evaluate`, held-out evaluation runs every `eval.every` steps and after the last, as in
    RL; the last entry also carries `pairs/dpo_*`, the policy's DPO metrics on all its training pairs.
    The reference logprobs of every pair are computed once before the first step when the steps
    draw a pair more than once on average (`precompute_reference` None), always (True) or never
    (False): the reference never changes, so each step then runs the policy's forward alone.
    """
    if not pairs:
        raise ValueError("no preference pairs: every sampled task scored its replies alike; raise dpo.group_size, "
                         "dpo.max_rounds or training.temperature, or warm-start with sft.steps")
    if not exp.algorithm.pairwise:
        raise ValueError(f"algorithm.name {exp.cfg.algorithm.name!r} is not a preference loss; use 'dpo'")
    learner = exp.learner or exp.start_rl()
    d, loss_cfg = exp.cfg.dpo, loss_config(exp.cfg)
    datums = pair_datums(pairs)
    if precompute_reference is None:
        precompute_reference = d.steps * min(d.batch_size, len(pairs)) > len(pairs)
    if precompute_reference:
        datums = with_reference_logprobs(datums, learner.compute_reference_logprobs)
    rng = random.Random(derived_seed(exp.cfg.seed, "dpo-batches"))
    history = []
    for step in range(d.steps):
        start = time.perf_counter()
        chosen = rng.sample(range(len(pairs)), min(d.batch_size, len(pairs)))
        batch = [datums[j] for i in chosen for j in (2 * i, 2 * i + 1)]
        metrics = {"iteration": float(step), **learner.forward_backward(batch, exp.algorithm.loss, loss_cfg)}
        metrics.update(learner.optim_step())
        metrics["time/train_s"] = time.perf_counter() - start
        exp.iteration = step + 1
        last = step + 1 == d.steps
        if last:
            metrics.update(pair_metrics(exp.local_learner(), pairs, d.beta, datums))
        if evaluate and eval_due(step, exp.cfg.eval.every, d.steps):
            metrics.update(exp.evaluate())
        history.append(metrics)
        if on_step:
            on_step(metrics)
    return history


def train_dpo(cfg: Config, on_iteration: OnMetrics | None = None,
              on_sft_step: Callable[[int, dict[str, float]], None] | None = None,
              resume: bool = False, overwrite: bool = False) -> list[dict[str, float]]:
    """SFT warm start (if configured), pairs from the starting policy, `dpo.steps` DPO steps.

    Writes under `output_dir`: `sft/` (the warm-started model), `preference_pairs.json`,
    `metrics.jsonl` (iteration -1 is the starting policy; iteration k is DPO step k) and
    `checkpoints/dpo` (the trained adapter or model).
    """
    if resume:
        raise ValueError("resume is not supported for dpo runs (one short stage); start a fresh output_dir")
    out = Path(cfg.output_dir)
    if not overwrite:
        run_dir.check_fresh(out)
    out.mkdir(parents=True, exist_ok=True)
    exp = Experiment(cfg)
    if overwrite:  # only now: a config that fails to build its model deletes nothing
        run_dir.clear_run(out)
    if cfg.sft.steps:
        exp.sft(on_sft_step)
        exp.save_base(out / "sft")
    pairs, tasks = preference_pairs(exp)
    (out / "preference_pairs.json").write_bytes(dumps(pairs))
    exp.start_rl()
    log = out / "metrics.jsonl"
    log.write_text("")

    def record(metrics: dict[str, float]) -> None:
        append_metrics(log, metrics)
        if on_iteration:
            on_iteration(metrics)

    before = {"iteration": -1.0, "tasks_sampled": float(tasks),
              **{f"data/{k}": v for k, v in summarize_pairs(pairs).items()},
              **pair_metrics(exp.local_learner(), pairs, cfg.dpo.beta)}
    record({**before, **exp.evaluate()})
    history = run_dpo(exp, pairs, record)
    exp.save(out / "checkpoints" / "dpo", history[-1])
    return history
