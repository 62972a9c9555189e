"""Asset-check logic: pure functions over library objects, reported inline by the assets
(`check_specs` + `AssetCheckResult` in the `MaterializeResult`, no extra steps per iteration).

The blocking checks of an adapter (`kl_within_bound`, `adapter_loads`) run before it is
registered; their verdict becomes the version's `tinker.checks` tags, which gate promotion to
`champion` and the next iteration (docs/runtime.md "Checks gate promotion")."""

from __future__ import annotations

import math
from pathlib import Path

import dagster as dg

from tinker_pipelines.loops.train import Experiment

REWARDS_FINITE = "rewards_finite"
KL_WITHIN_BOUND = "kl_within_bound"
ADAPTER_LOADS = "adapter_loads"
NOT_WORSE_THAN_CHAMPION = "not_worse_than_champion"


def rewards_finite(groups, metrics: dict[str, float]) -> dg.AssetCheckResult:
    """What the env wrapper cannot see: it rejects a non-finite reward of one step (`EnvError`,
    the step fails), but episode totals and the batch's mean and std are sums of finite rewards
    and can still overflow to inf, which would reach the advantages."""
    rewards = [t.total_reward for g in groups for t in g.trajectories]
    bad = sum(1 for r in rewards if not math.isfinite(r))
    stats = {k: float(metrics.get(k, 0.0)) for k in ("reward_mean", "reward_std")}
    bad_stats = [k for k, v in stats.items() if not math.isfinite(v)]
    return dg.AssetCheckResult(check_name=REWARDS_FINITE, passed=not bad and not bad_stats,
                               metadata={"episodes": len(rewards), "non_finite": bad,
                                         "non_finite_stats": ", ".join(bad_stats) or "none"})


def kl_within_bound(metrics: dict[str, float], bound: float) -> dg.AssetCheckResult:
    kl = metrics.get("kl")
    if kl is None:
        return dg.AssetCheckResult(check_name=KL_WITHIN_BOUND, passed=True,
                                   metadata={"kl": "not computed (algorithm.kl_coef = 0)", "bound": bound})
    return dg.AssetCheckResult(check_name=KL_WITHIN_BOUND, passed=bool(math.isfinite(kl) and abs(kl) <= bound),
                               metadata={"kl": float(kl), "bound": bound})


def adapter_loads(exp: Experiment, path: Path) -> dg.AssetCheckResult:
    """The written checkpoint loads and gives finite logits, checked without a second model
    (`Learner.verify_checkpoint`, on the worker when the experiment trains on one)."""
    try:
        v = exp.learner.verify_checkpoint(Path(path), exp.tokenizer.encode("What is 2 + 3?"))
        passed = v["finite_logits"] and not (v["missing"] or v["unexpected"] or v["differing"])
        return dg.AssetCheckResult(check_name=ADAPTER_LOADS, passed=passed, metadata={
            "finite_logits": v["finite_logits"], "tensors_loaded": v["tensors_loaded"],
            "tensors_differing_from_resident": len(v["differing"]),
            "missing": ", ".join(v["missing"][:5]) or "none", "unexpected": ", ".join(v["unexpected"][:5]) or "none"})
    except Exception as e:  # the check reports, the asset stays materialized
        return dg.AssetCheckResult(check_name=ADAPTER_LOADS, passed=False, metadata={"error": repr(e)[:500]})


def failed(results: list[dg.AssetCheckResult]) -> list[str]:
    """Names of the failed checks among `results` that block (severity ERROR)."""
    return [r.check_name for r in results if not r.passed and r.severity == dg.AssetCheckSeverity.ERROR]


def verdict(results: list[dg.AssetCheckResult]) -> str:
    """`passed`, or `failed: <names>`: the `checks` metadata of an adapter materialization."""
    names = failed(results)
    return f"failed: {', '.join(names)}" if names else "passed"


def not_worse_than_champion(score: float, champion_score: float | None, champion_version: str | None,
                            margin: float) -> dg.AssetCheckResult:
    passed = champion_score is None or score >= champion_score - margin
    return dg.AssetCheckResult(
        check_name=NOT_WORSE_THAN_CHAMPION, passed=passed, severity=dg.AssetCheckSeverity.WARN,
        metadata={"score": score, "champion_score": champion_score if champion_score is not None else "none",
                  "champion_version": champion_version or "none", "margin": margin})


def eval_score(metrics: dict[str, float]) -> float:
    """The number champions are compared on: exact rate when the env reports it, else reward."""
    return float(metrics.get("eval/exact_rate", metrics.get("eval/reward_mean", 0.0)))
