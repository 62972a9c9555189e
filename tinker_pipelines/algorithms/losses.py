"""Losses: pure functions `loss(logprobs_BT, batch, cfg) -> (loss, metrics)`.

`logprobs_BT` are the current policy's logprobs of the targets; `batch` carries the loss mask,
behaviour logprobs, advantages, (when a KL penalty is on) reference logprobs and (for PPO) the
value head's values, the values at sampling time and the GAE returns, all [B, T].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class LossBatch:
    """Tensors a loss reads, each [B, T]; padding and prompt positions have weight 0."""

    weights_BT: torch.Tensor
    """Loss mask (1 on trained tokens)."""
    behaviour_logprobs_BT: torch.Tensor | None = None
    """Logprobs under the policy that sampled the tokens."""
    advantages_BT: torch.Tensor | None = None
    """Advantage of each token."""
    ref_logprobs_BT: torch.Tensor | None = None
    """Logprobs under the reference policy, for the KL penalty."""
    values_BT: torch.Tensor | None = None
    """The value head's current estimates (with grad), for the value loss."""
    old_values_BT: torch.Tensor | None = None
    """Value estimates when the batch was scored (GAE's baseline; centre of the value clip)."""
    returns_BT: torch.Tensor | None = None
    """GAE returns (advantages + old values): the value head's regression targets."""


@dataclass(frozen=True)
class LossConfig:
    """Hyper-parameters of the RL losses."""

    clip_eps: float = 0.2
    """PPO/GRPO ratio clip: ratios outside [1 - eps, 1 + eps] carry no gradient."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference policy (0 turns it off)."""
    kl_estimator: str = "k3"
    """'k1' (log ratio) or 'k3' (exp(-d) + d - 1, unbiased and non-negative)."""
    normalization: str = "sequence"
    """'sequence': mean over each sequence's tokens, then over sequences (GRPO); 'token': mean
    over all tokens of the batch (Dr. GRPO / DAPO)."""
    beta: float = 0.1
    """DPO temperature: scales the log-ratio margin between chosen and rejected replies."""
    gamma: float = 1.0
    """PPO discount per policy token in GAE."""
    gae_lambda: float = 0.95
    """PPO GAE lambda: 0 is one-step TD (low variance), 1 is Monte Carlo returns (no bias)."""
    vf_coef: float = 0.1
    """PPO weight of the value loss next to the policy loss."""
    value_clip: float = 0.2
    """PPO value clip: new values further than this from the scored ones get no gradient (0 disables)."""
    whiten_advantages: bool = True
    """PPO: scale GAE advantages to mean 0, std 1 over the batch's weighted tokens when scoring."""


LossFn = Callable[[torch.Tensor, LossBatch, LossConfig], tuple[torch.Tensor, dict[str, float]]]


def masked_mean(x_BT: torch.Tensor, w_BT: torch.Tensor, normalization: str = "token") -> torch.Tensor:
    """Weighted mean, over all tokens or per sequence then over sequences.

    >>> x = torch.tensor([[1.0, 3.0], [2.0, 0.0]]); w = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    >>> masked_mean(x, w).item(), masked_mean(x, w, "sequence").item()
    (2.0, 2.0)
    """
    if normalization == "token":
        return (x_BT * w_BT).sum() / w_BT.sum().clamp(min=1e-8)
    per_seq_B = (x_BT * w_BT).sum(-1) / w_BT.sum(-1).clamp(min=1e-8)
    return per_seq_B[w_BT.sum(-1) > 0].mean()


def kl_penalty(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from samples of the policy.

    >>> kl_penalty(torch.tensor([[-1.0]]), torch.tensor([[-2.0]]), "k1").item()
    1.0
    """
    log_ratio_BT = ref_logprobs_BT - logprobs_BT
    if estimator == "k1":
        return -log_ratio_BT
    if estimator == "k3":
        return log_ratio_BT.exp() - log_ratio_BT - 1
    raise ValueError(f"algorithm.kl_estimator must be 'k1' or 'k3', got {estimator!r}")


def _with_kl(loss: torch.Tensor, logprobs_BT: torch.Tensor, batch: LossBatch, cfg: LossConfig,
             metrics: dict[str, float]) -> torch.Tensor:
    if batch.ref_logprobs_BT is None:
        return loss
    kl_BT = kl_penalty(logprobs_BT, batch.ref_logprobs_BT, cfg.kl_estimator)
    kl = masked_mean(kl_BT, batch.weights_BT, cfg.normalization)
    metrics["kl"] = kl.item()
    return loss + cfg.kl_coef * kl if cfg.kl_coef else loss


def sft_loss(logprobs_BT: torch.Tensor, batch: LossBatch, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """Cross-entropy on the weighted tokens (mean over tokens)."""
    nll = -masked_mean(logprobs_BT, batch.weights_BT, "token")
    return nll, {"nll": nll.item()}


def importance_sampling_loss(logprobs_BT: torch.Tensor, batch: LossBatch,
                             cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """REINFORCE with an importance weight for off-policy samples: -ratio * A."""
    ratio_BT = (logprobs_BT - batch.behaviour_logprobs_BT).exp()
    loss = -masked_mean(ratio_BT * batch.advantages_BT, batch.weights_BT, cfg.normalization)
    metrics = {"ratio_mean": masked_mean(ratio_BT.detach(), batch.weights_BT).item()}
    return _with_kl(loss, logprobs_BT, batch, cfg, metrics), metrics


def _clipped_surrogate(logprobs_BT: torch.Tensor, batch: LossBatch,
                       cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """-min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A), averaged by `cfg.normalization`."""
    ratio_BT = (logprobs_BT - batch.behaviour_logprobs_BT).exp()
    adv_BT = batch.advantages_BT
    surrogate_BT = torch.minimum(ratio_BT * adv_BT, ratio_BT.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps) * adv_BT)
    loss = -masked_mean(surrogate_BT, batch.weights_BT, cfg.normalization)
    clipped_BT = ((ratio_BT - 1).abs() > cfg.clip_eps).float()
    metrics = {"clip_fraction": masked_mean(clipped_BT, batch.weights_BT).item(),
               "ratio_mean": masked_mean(ratio_BT.detach(), batch.weights_BT).item()}
    return loss, metrics


def value_loss(batch: LossBatch, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """0.5 * max((V - R)^2, (V_clipped - R)^2), V_clipped = V_old + clip(V - V_old, +-value_clip).

    Metrics: `value_loss`, `explained_variance` (1 - Var[R - V] / Var[R] over weighted tokens;
    1 is a perfect critic, 0 no better than a constant).
    """
    if batch.values_BT is None or batch.returns_BT is None or batch.old_values_BT is None:
        raise ValueError("the value loss needs values_BT, old_values_BT and returns_BT: the algorithm must be "
                         "registered with value_head=True and its datums scored with GAE")
    v_BT, ret_BT, w_BT = batch.values_BT, batch.returns_BT, batch.weights_BT
    err_BT = (v_BT - ret_BT).square()
    if cfg.value_clip > 0:
        v_clipped_BT = batch.old_values_BT + (v_BT - batch.old_values_BT).clamp(-cfg.value_clip, cfg.value_clip)
        err_BT = torch.maximum(err_BT, (v_clipped_BT - ret_BT).square())
    loss = 0.5 * masked_mean(err_BT, w_BT, cfg.normalization)
    with torch.no_grad():
        var_ret = masked_mean((ret_BT - masked_mean(ret_BT, w_BT)).square(), w_BT)
        resid_BT = ret_BT - v_BT
        var_resid = masked_mean((resid_BT - masked_mean(resid_BT, w_BT)).square(), w_BT)
        explained = (1 - var_resid / var_ret).item() if var_ret > 1e-12 else 0.0
    return loss, {"value_loss": loss.item(), "explained_variance": explained,
                  "value_mean": masked_mean(v_BT.detach(), w_BT).item(),
                  "return_mean": masked_mean(ret_BT, w_BT).item()}


def ppo_loss(logprobs_BT: torch.Tensor, batch: LossBatch, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO with a learned critic: the clipped surrogate on GAE advantages + `vf_coef` x the
    clipped value loss (+ `kl_coef` x KL). The batch carries the value head's values (with grad),
    the values when scored and the GAE returns; advantages are already whitened if configured."""
    policy_loss, metrics = _clipped_surrogate(logprobs_BT, batch, cfg)
    vf_loss, vf_metrics = value_loss(batch, cfg)
    metrics.update(policy_loss=policy_loss.item(), **vf_metrics)
    return _with_kl(policy_loss + cfg.vf_coef * vf_loss, logprobs_BT, batch, cfg, metrics), metrics


def dr_grpo_loss(logprobs_BT: torch.Tensor, batch: LossBatch, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """Dr. GRPO (Liu et al., 2025): the critic-free clipped surrogate on group-centred advantages
    (no division by the group's std). Meant with `normalization: token`, so long and short
    replies weigh per token rather than per reply (the length bias Dr. GRPO removes). The paper
    divides the token sum by a constant (the maximum reply length) where `token` divides by the
    batch's token count: the same direction, scaled by a per-batch factor."""
    loss, metrics = _clipped_surrogate(logprobs_BT, batch, cfg)
    return _with_kl(loss, logprobs_BT, batch, cfg, metrics), metrics


def grpo_loss(logprobs_BT: torch.Tensor, batch: LossBatch, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO: the clipped surrogate on group-normalised advantages plus `kl_coef` * KL.

    The same surrogate as `dr_grpo_loss`; kept as its own name so configs read as papers do.
    """
    return dr_grpo_loss(logprobs_BT, batch, cfg)
