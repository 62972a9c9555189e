"""Losses: pure functions `loss(logprobs_BT, batch, cfg) -> (loss, metrics)`.

`logprobs_BT` are the current policy's logprobs of the targets; `batch` carries the loss mask,
behaviour logprobs, advantages, (when a KL penalty is on) reference logprobs and (for PPO) the
value head's values, the values at sampling time and the GAE returns, all [B, T].
"""

from __future__ import annotations

from dataclasses import dataclass, replace
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
    over all tokens of the batch (DAPO); 'constant': sum over all tokens / (sequences x
    `max_tokens`) (Dr. GRPO)."""
    max_tokens: int = 16
    """The constant of 'constant' normalization: the most policy tokens an episode can have
    (training.max_new_tokens x training.max_turns)."""
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


def fixed_normalization(normalization: str) -> Callable[[LossFn], LossFn]:
    """Declare that a loss averages by `normalization` whatever `LossConfig.normalization` says
    (SFT: 'token'; Dr. GRPO: 'constant'), so that the learner weighs its micro-batches by the
    same measure (`loss_normalization`)."""
    def mark(fn: LossFn) -> LossFn:
        setattr(fn, "normalization", normalization)
        return fn
    return mark


def loss_normalization(loss_fn: LossFn, cfg: LossConfig) -> str:
    """How `loss_fn` averages over a batch: its fixed normalization, else `cfg.normalization`."""
    return getattr(loss_fn, "normalization", None) or cfg.normalization


def micro_batch_share(normalization: str, chunk_weight: float, total_weight: float, chunk_rows: int,
                      total_rows: int) -> float:
    """What a micro-batch's loss is scaled by so that the micro-batches' gradients add up to the
    whole batch's: its share of the weighted tokens under a token mean, of the rows otherwise (a
    mean over sequences or pairs, or a sum over a constant per row); 1 under a plain 'sum' (Tinker's
    losses: the batch's loss is the sum of its micro-batches' sums).

    >>> micro_batch_share("token", 3.0, 12.0, 1, 2), micro_batch_share("sequence", 3.0, 12.0, 1, 2)
    (0.25, 0.5)
    >>> micro_batch_share("sum", 3.0, 12.0, 1, 2)
    1.0
    """
    if normalization == "sum":
        return 1.0
    if normalization == "token":
        return chunk_weight / total_weight if total_weight else 0.0
    return chunk_rows / total_rows


def masked_mean(x_BT: torch.Tensor, w_BT: torch.Tensor, normalization: str = "token",
                max_tokens: int | None = None) -> torch.Tensor:
    """Weighted mean, over all tokens or per sequence then over sequences; or ('constant') the
    weighted sum over B sequences divided by B x `max_tokens`, whatever their lengths.

    >>> x = torch.tensor([[1.0, 3.0], [2.0, 0.0]]); w = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    >>> masked_mean(x, w).item(), masked_mean(x, w, "sequence").item(), masked_mean(x, w, "constant", 4).item()
    (2.0, 2.0, 0.75)
    """
    if normalization == "token":
        return (x_BT * w_BT).sum() / w_BT.sum().clamp(min=1e-8)
    if normalization == "constant":
        if not max_tokens or max_tokens < 1:
            raise ValueError(f"'constant' normalization needs max_tokens >= 1, got {max_tokens!r}")
        return (x_BT * w_BT).sum() / (x_BT.shape[0] * max_tokens)
    # A row without trained tokens counts as a zero: the mean is then over all B rows, as
    # `micro_batch_share` assumes, and a micro-batch of such rows gives 0, not the NaN of an empty mean.
    per_seq_B = (x_BT * w_BT).sum(-1) / w_BT.sum(-1).clamp(min=1e-8)
    return per_seq_B.mean()


def _reduce(x_BT: torch.Tensor, w_BT: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """`masked_mean` with the loss config's normalization."""
    return masked_mean(x_BT, w_BT, cfg.normalization, cfg.max_tokens)


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


def approx_kl(log_ratio_BT: torch.Tensor, weights_BT: torch.Tensor) -> float:
    """Token mean of k3 = (ratio - 1) - log ratio, an estimate of KL(behaviour || current) from
    the behaviour policy's samples (never negative; what PPO's `target_kl` early stop reads).

    >>> round(approx_kl(torch.tensor([[0.0, 0.1]]), torch.ones(1, 2)), 6)  # (e^0.1 - 1 - 0.1) / 2
    0.002585
    """
    with torch.no_grad():
        return masked_mean(log_ratio_BT.exp() - 1 - log_ratio_BT, weights_BT).item()


def _with_kl(loss: torch.Tensor, logprobs_BT: torch.Tensor, batch: LossBatch, cfg: LossConfig,
             metrics: dict[str, float]) -> torch.Tensor:
    if batch.ref_logprobs_BT is None:
        return loss
    kl_BT = kl_penalty(logprobs_BT, batch.ref_logprobs_BT, cfg.kl_estimator)
    kl = _reduce(kl_BT, batch.weights_BT, cfg)
    # logged as a per-token average: under 'constant' the penalty term is a sum over B x max_tokens
    shown = masked_mean(kl_BT.detach(), batch.weights_BT) if cfg.normalization == "constant" else kl
    metrics["kl"] = shown.item()
    return loss + cfg.kl_coef * kl if cfg.kl_coef else loss


@fixed_normalization("token")
def sft_loss(logprobs_BT: torch.Tensor, batch: LossBatch, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """Cross-entropy on the weighted tokens: a mean over every trained token of the batch, so a
    long reply weighs as many tokens as it has (`cfg.normalization` does not apply)."""
    nll = -masked_mean(logprobs_BT, batch.weights_BT, "token")
    return nll, {"nll": nll.item()}


def importance_sampling_loss(logprobs_BT: torch.Tensor, batch: LossBatch,
                             cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """REINFORCE with an importance weight for off-policy samples: -ratio * A."""
    log_ratio_BT = logprobs_BT - batch.behaviour_logprobs_BT
    ratio_BT = log_ratio_BT.exp()
    loss = -_reduce(ratio_BT * batch.advantages_BT, batch.weights_BT, cfg)
    metrics = {"ratio_mean": masked_mean(ratio_BT.detach(), batch.weights_BT).item(),
               "approx_kl": approx_kl(log_ratio_BT, batch.weights_BT)}
    return _with_kl(loss, logprobs_BT, batch, cfg, metrics), metrics


def _clipped_surrogate(logprobs_BT: torch.Tensor, batch: LossBatch,
                       cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """-min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A), averaged by `cfg.normalization`.

    The min picks the clipped term, constant in the policy, exactly where the ratio has left the
    band on the side its advantage pushes it: ratio > 1 + eps with A > 0, ratio < 1 - eps with
    A < 0. Those tokens carry no gradient, and `clip_fraction` is their share of the weighted
    tokens (a ratio outside the band on the other side still has its gradient: it is not counted).
    """
    log_ratio_BT = logprobs_BT - batch.behaviour_logprobs_BT
    ratio_BT = log_ratio_BT.exp()
    adv_BT = batch.advantages_BT
    surrogate_BT = torch.minimum(ratio_BT * adv_BT, ratio_BT.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps) * adv_BT)
    loss = -_reduce(surrogate_BT, batch.weights_BT, cfg)
    with torch.no_grad():
        clipped_BT = (((ratio_BT > 1 + cfg.clip_eps) & (adv_BT > 0)) | ((ratio_BT < 1 - cfg.clip_eps) & (adv_BT < 0)))
    metrics = {"clip_fraction": masked_mean(clipped_BT.float(), batch.weights_BT).item(),
               "ratio_mean": masked_mean(ratio_BT.detach(), batch.weights_BT).item(),
               "approx_kl": approx_kl(log_ratio_BT, batch.weights_BT)}
    return loss, metrics


def value_loss(batch: LossBatch, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """0.5 * max((V - R)^2, (V_clipped - R)^2), V_clipped = V_old + clip(V - V_old, +-value_clip).

    Metrics: `value_loss`, `explained_variance` (1 - Var[R - V] / Var[R] over weighted tokens;
    1 is a perfect critic, 0 no better than a constant), `value_clip_fraction` (share of weighted
    tokens whose value moved past the clip away from its return: no value gradient there).
    """
    if batch.values_BT is None or batch.returns_BT is None or batch.old_values_BT is None:
        raise ValueError("the value loss needs values_BT, old_values_BT and returns_BT: the algorithm must be "
                         "registered with value_head=True and its datums scored with GAE")
    v_BT, ret_BT, w_BT = batch.values_BT, batch.returns_BT, batch.weights_BT
    err_BT = (v_BT - ret_BT).square()
    value_clipped_BT = torch.zeros_like(w_BT, dtype=torch.bool)
    if cfg.value_clip > 0:
        v_clipped_BT = batch.old_values_BT + (v_BT - batch.old_values_BT).clamp(-cfg.value_clip, cfg.value_clip)
        clipped_err_BT = (v_clipped_BT - ret_BT).square()
        # the clipped branch wins (and blocks the gradient) only where V left the band
        value_clipped_BT = ((v_BT - batch.old_values_BT).abs() > cfg.value_clip) & (clipped_err_BT > err_BT)
        err_BT = torch.maximum(err_BT, clipped_err_BT)
    loss = 0.5 * _reduce(err_BT, w_BT, cfg)
    with torch.no_grad():
        var_ret = masked_mean((ret_BT - masked_mean(ret_BT, w_BT)).square(), w_BT)
        resid_BT = ret_BT - v_BT
        var_resid = masked_mean((resid_BT - masked_mean(resid_BT, w_BT)).square(), w_BT)
        explained = (1 - var_resid / var_ret).item() if var_ret > 1e-12 else 0.0
    return loss, {"value_loss": loss.item(), "explained_variance": explained,
                  "value_clip_fraction": masked_mean(value_clipped_BT.float(), w_BT).item(),
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


def grpo_loss(logprobs_BT: torch.Tensor, batch: LossBatch, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO (Shao et al., 2024): the critic-free clipped surrogate on group-normalised advantages
    plus `kl_coef` * KL, averaged by `cfg.normalization` (the paper's: 'sequence')."""
    loss, metrics = _clipped_surrogate(logprobs_BT, batch, cfg)
    return _with_kl(loss, logprobs_BT, batch, cfg, metrics), metrics


@fixed_normalization("constant")
def dr_grpo_loss(logprobs_BT: torch.Tensor, batch: LossBatch, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training"): GRPO without its two
    biases. Advantages are group-centred, not divided by the group's std (the registry pairs
    this loss with `group_centered`), and every per-token term (surrogate and KL) is summed and
    divided by a constant, sequences x `cfg.max_tokens`, instead of by each reply's length: a
    token weighs the same in a long reply as in a short one and in every batch. This is TRL's
    `loss_type="dr_grpo"` (constant `max_completion_length`); `cfg.normalization` is ignored."""
    return grpo_loss(logprobs_BT, batch, replace(cfg, normalization="constant"))
