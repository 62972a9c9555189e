"""Losses: pure functions `loss(logprobs_BT, batch, cfg) -> (loss, metrics)`.

`logprobs_BT` are the current policy's logprobs of the targets; `batch` carries the loss mask,
behaviour logprobs, advantages and (when a KL penalty is on) reference logprobs, all [B, T].
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


def ppo_loss(logprobs_BT: torch.Tensor, batch: LossBatch, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate: -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A)."""
    ratio_BT = (logprobs_BT - batch.behaviour_logprobs_BT).exp()
    adv_BT = batch.advantages_BT
    surrogate_BT = torch.minimum(ratio_BT * adv_BT, ratio_BT.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps) * adv_BT)
    loss = -masked_mean(surrogate_BT, batch.weights_BT, cfg.normalization)
    clipped_BT = ((ratio_BT - 1).abs() > cfg.clip_eps).float()
    metrics = {"clip_fraction": masked_mean(clipped_BT, batch.weights_BT).item(),
               "ratio_mean": masked_mean(ratio_BT.detach(), batch.weights_BT).item()}
    return _with_kl(loss, logprobs_BT, batch, cfg, metrics), metrics


def grpo_loss(logprobs_BT: torch.Tensor, batch: LossBatch, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO: the clipped surrogate on group-normalised advantages plus `kl_coef` * KL.

    It is `ppo_loss` with GRPO's advantages; kept as its own name so configs read as papers do.
    """
    return ppo_loss(logprobs_BT, batch, cfg)
