"""Asset-check logic: pure functions over library objects, reported inline by the assets
(`check_specs` + `AssetCheckResult` in the `MaterializeResult`, no extra steps per iteration)."""

from __future__ import annotations

import copy
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
    """Load the written checkpoint (hash verified) into a copy of the policy; logits must be finite
    and match the resident policy's."""
    from safetensors.torch import load_file

    try:
        record = read_record(path, verify=True)
        model = copy.deepcopy(exp.policy)
        if record["mode"] == "lora":
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(model, load_file(str(Path(path) / "adapter_model.safetensors")))
        else:
            state: dict[str, Any] = {}
            for f in sorted(Path(path).glob("model*.safetensors")):
                state.update(load_file(str(f)))
            model.load_state_dict(state, strict=False)
        ids = torch.tensor([exp.tokenizer.encode("What is 2 + 3?")[:32] or [0]])
        logits = model(input_ids=ids).logits
        resident = exp.policy(input_ids=ids).logits
        finite = bool(torch.isfinite(logits).all())
        diff = float((logits - resident).abs().max())
        return dg.AssetCheckResult(check_name=ADAPTER_LOADS, passed=finite and diff < 1e-4,
                                   metadata={"finite_logits": finite, "max_abs_diff_vs_resident": diff})
    except Exception as e:  # the check reports, the asset stays materialized
        return dg.AssetCheckResult(check_name=ADAPTER_LOADS, passed=False, metadata={"error": repr(e)[:500]})


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
