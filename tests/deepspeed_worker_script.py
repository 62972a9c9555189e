"""One rank of tests/test_deepspeed.py, launched by `torchrun --nproc_per_node N`.

For each ZeRO stage and case, on the tiny model: one step of `DeepSpeedLearner` against a plain
`Learner(mode="full")` in this process (same datums on every rank), then its checkpoint loaded
without DeepSpeed (`Learner.load_state`, `from_pretrained`) and by a fresh `DeepSpeedLearner`,
each taking a second step against the plain learner's second step. Rank 0 writes the measured
differences as JSON to argv[1]; the test holds them to its tolerances.
"""

from __future__ import annotations

import copy
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tinker_pipelines.algorithms import LossConfig, get_algorithm
from tinker_pipelines.loops.datums import critic_datums, rl_datums, with_reference_logprobs
from tinker_pipelines.training.deepspeed_learner import DeepSpeedLearner
from tinker_pipelines.envs import EnvSpec
from tinker_pipelines.training.learner import Learner, LearnerConfig
from tinker_pipelines.training.master_weights import MASTER_FILE
from tinker_pipelines.models import load_model, stop_token_ids
from tinker_pipelines.rollout.episodes import RolloutConfig, run_groups
from tinker_pipelines.rollout.sampler import Sampler
from tinker_pipelines.types import Trajectory, TrajectoryGroup

CASES = {
    # GRPO with a KL penalty (a frozen reference), sequence-mean loss
    "grpo_kl": dict(algorithm="grpo", loss=LossConfig(kl_coef=0.1, normalization="sequence"),
                    learner=dict(needs_reference=True)),
    # PPO: a value head in the same ZeRO optimizer with its own learning rate, token-mean loss
    "ppo_token": dict(algorithm="ppo", loss=LossConfig(normalization="token"),
                      learner=dict(value_head=True, value_learning_rate=3e-2)),
    # the same with activation checkpointing: ZeRO-3 gathers the parameters again for the replay
    "ppo_checkpointed": dict(algorithm="ppo", loss=LossConfig(normalization="token"),
                             learner=dict(value_head=True, value_learning_rate=3e-2, gradient_checkpointing=True)),
}
NUM_DATUMS = 13
"""Odd, with micro-batches of 3: 2 ranks get 8 and 5 datums, so rank 1 runs a padding micro-batch."""
G_MIN = 1e-5
"""Elements whose RMS gradient is below this (1000 x Adam's eps) are left out of the elementwise
parameter check (they are in the gradient check): Adam's update lr * m / (sqrt(v) + eps) turns
the ~1e-9 rounding noise of summing a gradient in another order into a visible change of the
update there (up to 2 lr when g ~ 0)."""


def _groups(model, tok) -> list[TrajectoryGroup]:
    sampler = Sampler(model, tok.pad_token_id, stop_token_ids(tok))
    groups = run_groups(sampler, tok, EnvSpec("arithmetic"), [1, 2, 3, 4], 4, RolloutConfig(max_new_tokens=6),
                        torch.Generator().manual_seed(0))
    # a random model rarely answers right: seeded random rewards, so that every group teaches
    rng = random.Random(0)
    return [TrajectoryGroup(tuple(Trajectory(t.turns, rng.random(), t.task_id) for t in g.trajectories))
            for g in groups]


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().flatten().float().cpu() for t in tensors])


def _adam(state: dict, key: str) -> torch.Tensor:
    """One Adam state of every parameter, flat, from a `torch.optim.AdamW.state_dict()`."""
    return _flat(state["state"][i][key] for i in sorted(state["state"]))


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _compare(params: list, ref_params: list, ref_state: dict, steps: int) -> dict[str, float]:
    """Parameter differences where the reference gradient is well conditioned for Adam (see
    G_MIN), and everywhere."""
    d = (_flat(params) - _flat(ref_params)).abs()
    g = (_adam(ref_state, "exp_avg_sq") / (1 - 0.999 ** steps)).sqrt()  # RMS gradient per element
    well = g >= G_MIN
    return {"param_max_abs_well": float(d[well].max()), "well_fraction": float(well.float().mean()),
            "param_max_abs_all": float(d.max())}


def _step(learner, datums, algo, loss_cfg) -> dict[str, float]:
    return {**learner.forward_backward(datums, algo.loss, loss_cfg), **learner.optim_step()}


def run_case(stage: int, name: str, model0, tok, out_dir: Path) -> dict[str, float]:
    case = CASES[name]
    algo, loss_cfg = get_algorithm(case["algorithm"]), case["loss"]
    lcfg = LearnerConfig(mode="full", learning_rate=1e-2, micro_batch_size=3, **case["learner"])
    plain = Learner(copy.deepcopy(model0), lcfg, tok.pad_token_id, base_name="tiny")
    groups = _groups(model0, tok)
    if algo.value_head:
        datums = critic_datums(groups, plain.compute_values, loss_cfg.gamma, loss_cfg.gae_lambda)
    else:
        datums = rl_datums(groups, "group_normalized")
    datums = datums[:NUM_DATUMS]
    assert len(datums) == NUM_DATUMS, len(datums)

    start = time.perf_counter()
    zero = {"stage3_param_persistence_threshold": 0} if stage == 3 else {}  # partition even tiny tensors
    ds = DeepSpeedLearner(copy.deepcopy(model0), lcfg, tok.pad_token_id, base_name="tiny", stage=stage,
                          zero_overrides=zero)
    res: dict[str, float] = {"init_s": time.perf_counter() - start}
    rank = torch.distributed.get_rank()  # the learner has joined (or made) the process group
    m_plain, m_ds = _step(plain, datums, algo, loss_cfg), _step(ds, datums, algo, loss_cfg)
    assert set(m_plain) == set(m_ds), (sorted(m_plain), sorted(m_ds))
    res["grad_norm_rel"] = _rel(m_ds["grad_norm"], m_plain["grad_norm"])
    res["metrics_max_err"] = max(abs(m_ds[k] - m_plain[k]) / (1 + abs(m_plain[k])) for k in m_plain)
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, m_ds)
    res["ranks_agree"] = float(all(g == m_ds for g in gathered))  # every rank reports the same numbers
    plain_state = plain.optimizer.state_dict()
    res.update(_compare(ds.params, plain.params, plain_state, 1))

    ck = out_dir / f"zero{stage}_{name}"
    record = ds.save_state(ck, {"iteration": 1})
    res["record_ok"] = float(record["learner_steps"] == 1 and bool(record["content_hash"])
                             and record["deepspeed"]["stage"] == stage)
    if rank == 0:  # without DeepSpeed: the consolidated Adam states, a plain learner and from_pretrained
        saved = torch.load(ck / "optimizer.pt", weights_only=True)["optimizer"]
        m, m_ref = _adam(saved, "exp_avg"), _adam(plain_state, "exp_avg")  # 0.1 x the clipped gradient
        res["grad_max_err"] = float((m - m_ref).abs().max() / m_ref.abs().max())
        resumed = Learner(copy.deepcopy(model0), lcfg, tok.pad_token_id, base_name="tiny")
        assert resumed.load_state(ck)["iteration"] == 1 and resumed.steps == 1
        x = torch.tensor([datums[0].input_tokens])
        hf = AutoModelForCausalLM.from_pretrained(ck).eval()
        with torch.no_grad():
            logits = ds.model(x).logits
            res["logits_learner_max_abs"] = float((resumed.model(x).logits - logits).abs().max())
            res["logits_hf_max_abs"] = float((hf(x).logits - logits).abs().max())
    ds_m2 = _step(ds, datums, algo, loss_cfg)
    if rank == 0:  # a plain learner resumes a DeepSpeed checkpoint: its second step against DeepSpeed's
        m2 = _step(resumed, datums, algo, loss_cfg)
        res["plain_resume_grad_norm_rel"] = _rel(m2["grad_norm"], ds_m2["grad_norm"])
        res.update({f"plain_resume_{k}": v for k, v in
                    _compare(ds.params, resumed.params, resumed.optimizer.state_dict(), 2).items()})
    # DeepSpeed resumes its checkpoint (collective): the same second step, bit for bit
    ds2 = DeepSpeedLearner(copy.deepcopy(model0), lcfg, tok.pad_token_id, base_name="tiny", stage=stage,
                           zero_overrides=zero)
    assert ds2.load_state(ck)["iteration"] == 1 and ds2.steps == 1
    m2 = _step(ds2, datums, algo, loss_cfg)
    res["ds_resume_param_max_abs"] = float((_flat(ds2.params) - _flat(ds.params)).abs().max())
    res["ds_resume_metrics_equal"] = float(m2 == ds_m2)
    return res


def run_carried(stage: int, model0, tok) -> dict[str, float]:
    """GRPO with a KL reference, the datums carrying their reference logprobs (scored once, as
    `Experiment.score` does for several passes): DeepSpeed's step on them against the plain
    learner's step that runs its reference forward, and how often DeepSpeed ran its own."""
    case = CASES["grpo_kl"]
    algo, loss_cfg = get_algorithm(case["algorithm"]), case["loss"]
    lcfg = LearnerConfig(mode="full", learning_rate=1e-2, micro_batch_size=3, **case["learner"])
    plain = Learner(copy.deepcopy(model0), lcfg, tok.pad_token_id, base_name="tiny")
    datums = rl_datums(_groups(model0, tok), "group_normalized")[:NUM_DATUMS]
    zero = {"stage3_param_persistence_threshold": 0} if stage == 3 else {}
    ds = DeepSpeedLearner(copy.deepcopy(model0), lcfg, tok.pad_token_id, base_name="tiny", stage=stage,
                          zero_overrides=zero)
    carried = with_reference_logprobs(datums, ds.compute_reference_logprobs)
    calls = []
    scored = ds.reference_logprobs
    ds.reference_logprobs = lambda padded: calls.append(1) or scored(padded)
    m_plain, m_ds = _step(plain, datums, algo, loss_cfg), _step(ds, carried, algo, loss_cfg)
    res = {"reference_forwards": float(len(calls)), "grad_norm_rel": _rel(m_ds["grad_norm"], m_plain["grad_norm"]),
           "metrics_max_err": max(abs(m_ds[k] - m_plain[k]) / (1 + abs(m_plain[k])) for k in m_plain),
           "all_carried": float(all(len(d.reference_logprobs) == len(d.input_tokens) for d in carried))}
    res.update(_compare(ds.params, plain.params, plain.optimizer.state_dict(), 1))
    return res


def run_bf16(stage: int, tok, out_dir: Path) -> dict[str, Any]:
    """A bf16 model under DeepSpeed's `bf16` section against the plain learner's fp32 masters:
    PPO (a value head, kept fp32), 3 steps at lr 1e-5; then its checkpoint resumed by a plain
    learner and by DeepSpeed."""
    from deepspeed.utils import safe_get_full_fp32_param

    case = CASES["ppo_token"]
    algo, loss_cfg = get_algorithm(case["algorithm"]), case["loss"]
    lcfg = LearnerConfig(mode="full", learning_rate=1e-5, micro_batch_size=3, **case["learner"])
    model0, _ = load_model("tiny", seed=0, dtype="bfloat16")
    plain = Learner(copy.deepcopy(model0), lcfg, tok.pad_token_id, base_name="tiny")
    datums = critic_datums(_groups(model0, tok), plain.compute_values, loss_cfg.gamma, loss_cfg.gae_lambda)[:NUM_DATUMS]
    ds = DeepSpeedLearner(copy.deepcopy(model0), lcfg, tok.pad_token_id, base_name="tiny", stage=stage)

    def ds_masters(learner):
        return [safe_get_full_fp32_param(p).reshape(q.shape) for p, q in
                zip(learner._trained.policy.parameters(), learner._full.policy.parameters())]

    res: dict[str, Any] = {"device": str(ds.device), "bf16_enabled": float(ds.engine.bfloat16_enabled()),
                             "policy_bf16": float(all(p.dtype == torch.bfloat16 for p in ds.model.parameters()))}
    for _ in range(3):
        m_plain, m_ds = _step(plain, datums, algo, loss_cfg), _step(ds, datums, algo, loss_cfg)
    res["grad_norm_rel"] = _rel(m_ds["grad_norm"], m_plain["grad_norm"])
    w0, d_plain = _flat(model0.parameters()), _flat(plain.masters.masters) - _flat(model0.parameters())
    d_ds = _flat(ds_masters(ds)) - w0
    res["masters_rel"] = float((d_ds - d_plain).norm() / d_plain.norm())
    res["moved_fraction"] = float((_flat(ds.model.parameters()) != w0).float().mean())
    res["weights_are_rounded_masters"] = float(torch.equal(_flat(ds.model.parameters()),
                                                           _flat(m.to(torch.bfloat16) for m in ds_masters(ds))))
    ck = out_dir / f"zero{stage}_bf16"
    ds.save_state(ck, {"iteration": 3})
    res["master_file"] = float((ck / MASTER_FILE).exists())
    ds_m2 = _step(ds, datums, algo, loss_cfg)
    if torch.distributed.get_rank() == 0:  # a plain learner resumes DeepSpeed's masters exactly
        resumed = Learner(copy.deepcopy(model0), lcfg, tok.pad_token_id, base_name="tiny")
        resumed.load_state(ck)
        saved = torch.load(ck / "optimizer.pt", weights_only=True)["optimizer"]
        saved_masters = load_file(str(ck / MASTER_FILE))
        res["plain_resume_masters_equal"] = float(resumed.masters.rederived == 0 and torch.equal(
            _flat(resumed.masters.masters), _flat(saved_masters[n] for n in resumed.masters.names)))
        res["value_head_file_fp32"] = float(all(v.dtype == torch.float32 for v in
                                                load_file(str(ck / "value_head.safetensors")).values()))
        res["plain_resume_adam_equal"] = float(torch.equal(_adam(resumed.optimizer.state_dict(), "exp_avg"),
                                                           _adam(saved, "exp_avg")))
    ds2 = DeepSpeedLearner(copy.deepcopy(model0), lcfg, tok.pad_token_id, base_name="tiny", stage=stage)
    ds2.load_state(ck)
    m2 = _step(ds2, datums, algo, loss_cfg)
    res["ds_resume_param_max_abs"] = float((_flat(ds2.params) - _flat(ds.params)).abs().max())
    res["ds_resume_masters_max_abs"] = float((_flat(ds_masters(ds2)) - _flat(ds_masters(ds))).abs().max())
    res["ds_resume_metrics_equal"] = float(m2 == ds_m2)
    return res


def main() -> None:
    out = Path(sys.argv[1])
    stages = [int(s) for s in sys.argv[2].split(",")] if len(sys.argv) > 2 else [2, 3]
    cases = sys.argv[3].split(",") if len(sys.argv) > 3 else list(CASES)
    torch.manual_seed(0)
    model0, tok = load_model("tiny", seed=0)
    results = {f"zero{s}/{c}": run_case(s, c, model0, tok, out.parent / "checkpoints")
               for s in stages for c in cases if c != "bf16"}
    if "bf16" in cases:
        results.update({f"zero{s}/bf16": run_bf16(s, tok, out.parent / "checkpoints") for s in stages})
    if "grpo_kl" in cases:
        results.update({f"zero{s}/grpo_kl_carried": run_carried(s, model0, tok) for s in stages})
    if torch.distributed.get_rank() == 0:
        results["world_size"] = torch.distributed.get_world_size()
        out.write_text(json.dumps(results, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
