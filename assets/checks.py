"""Asset-check logic: pure functions over library objects, reported inline by the assets
(`check_specs` + `AssetCheckResult` in the `MaterializeResult`, no extra steps per iteration)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import dagster as dg
import torch

from tinker_pipelines.checkpoint import read_record
from tinker_pipelines.train import Experiment

REWARDS_FINITE = "rewards_finite"
KL_WITHIN_BOUND = "kl_within_bound"
ADAPTER_LOADS = "adapter_loads"
NOT_WORSE_THAN_CHAMPION = "not_worse_than_champion"


def rewards_finite(groups) -> dg.AssetCheckResult:
    rewards = [t.total_reward for g in groups for t in g.trajectories]
    bad = sum(1 for r in rewards if not math.isfinite(r))
    return dg.AssetCheckResult(check_name=REWARDS_FINITE, passed=bad == 0,
                               metadata={"episodes": len(rewards), "non_finite": bad})


def kl_within_bound(metrics: dict[str, float], bound: float) -> dg.AssetCheckResult:
    kl = metrics.get("kl")
    if kl is None:
        return dg.AssetCheckResult(check_name=KL_WITHIN_BOUND, passed=True,
                                   metadata={"kl": "not computed (algorithm.kl_coef = 0)", "bound": bound})
    return dg.AssetCheckResult(check_name=KL_WITHIN_BOUND, passed=bool(math.isfinite(kl) and abs(kl) <= bound),
                               metadata={"kl": float(kl), "bound": bound})


@torch.no_grad()
def adapter_loads(exp: Experiment, path: Path) -> dg.AssetCheckResult:
    """The written checkpoint loads and gives finite logits, checked without a second model:
    its weight files match the recorded content hash, load with safetensors, and every tensor
    equals the resident policy's bit for bit (so a policy loaded from them is the resident one,
    whose logits on a probe prompt must be finite)."""
    try:
        record = read_record(path, verify=True)
        loaded, resident = _written_and_resident(exp, Path(path), record["mode"])
        missing = sorted(set(resident) - set(loaded) - {"lm_head.weight"})  # a tied output layer is not saved
        unexpected = sorted(set(loaded) - set(resident))
        differ = sorted(k for k in set(loaded) & set(resident) if not torch.equal(loaded[k], resident[k].cpu()))
        ids = torch.tensor([exp.tokenizer.encode("What is 2 + 3?")[:32] or [0]])
        finite = bool(torch.isfinite(exp.policy(input_ids=ids).logits).all())
        passed = finite and not (missing or unexpected or differ)
        return dg.AssetCheckResult(check_name=ADAPTER_LOADS, passed=passed, metadata={
            "finite_logits": finite, "tensors_loaded": len(loaded), "tensors_differing_from_resident": len(differ),
            "missing": ", ".join(missing[:5]) or "none", "unexpected": ", ".join(unexpected[:5]) or "none"})
    except Exception as e:  # the check reports, the asset stays materialized
        return dg.AssetCheckResult(check_name=ADAPTER_LOADS, passed=False, metadata={"error": repr(e)[:500]})


def _written_and_resident(exp: Experiment, path: Path, mode: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The checkpoint's tensors as loaded from disk, and the resident tensors they must equal."""
    from safetensors.torch import load_file

    from tinker_pipelines.learner import VALUE_HEAD_FILE

    learner = exp.learner
    loaded: dict[str, Any] = {}
    if mode == "lora":
        from peft import get_peft_model_state_dict

        loaded.update(load_file(str(path / "adapter_model.safetensors")))
        resident = dict(get_peft_model_state_dict(learner.model, adapter_name=learner.adapter_name))
    else:
        for f in sorted(path.glob("model*.safetensors")):
            loaded.update(load_file(str(f)))
        resident = dict(learner.model.state_dict())
    if learner.value_head is not None or (path / VALUE_HEAD_FILE).exists():
        loaded.update({f"value_head.{k}": v for k, v in load_file(str(path / VALUE_HEAD_FILE)).items()})
        if learner.value_head is not None:
            resident.update({f"value_head.{k}": v for k, v in learner.value_head.state_dict().items()})
    return loaded, resident


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
