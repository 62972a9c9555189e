"""DPO (Rafailov et al., 2023), the sigmoid loss: preference pairs, no reward model, no sampling.

A reply's implicit reward is `beta * (log pi(y|x) - log pi_ref(y|x))`, with sequence
logprobs summed over the reply's tokens; the loss is `-log sigmoid(r_chosen - r_rejected)`.
Batches hold the pair `(chosen, rejected)` in rows 2i and 2i + 1; under LoRA the reference is
the base with the adapter disabled, under full-parameter training a frozen copy (the learner
provides `ref_logprobs_BT` because the algorithm is registered with `needs_reference`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tinker_pipelines.algorithms.losses import LossBatch, LossConfig


def dpo_sigmoid_loss(chosen_logps_B: torch.Tensor, rejected_logps_B: torch.Tensor,
                     ref_chosen_logps_B: torch.Tensor, ref_rejected_logps_B: torch.Tensor,
                     beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair sigmoid DPO loss and the implicit rewards of both replies (label smoothing 0).

    Inputs are sequence logprobs (summed over each reply's tokens), one per pair. The rewards are
    detached: they are for logging and accuracy, the gradient flows through the loss only.

    >>> losses, rc, rr = dpo_sigmoid_loss(torch.tensor([-1.0]), torch.tensor([-3.0]),
    ...                                   torch.tensor([-2.0]), torch.tensor([-2.0]), beta=0.5)
    >>> round(losses.item(), 4), rc.item(), rr.item()   # -log sigmoid(0.5 * (1 - (-1)))
    (0.3133, 0.5, -0.5)
    """
    chosen_logratios_B = chosen_logps_B - ref_chosen_logps_B
    rejected_logratios_B = rejected_logps_B - ref_rejected_logps_B
    losses_B = -F.logsigmoid(beta * (chosen_logratios_B - rejected_logratios_B))
    return losses_B, beta * chosen_logratios_B.detach(), beta * rejected_logratios_B.detach()


def dpo_loss(logprobs_BT: torch.Tensor, batch: LossBatch, cfg: LossConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """Mean sigmoid DPO loss over the pairs of a batch whose rows 2i / 2i + 1 are chosen / rejected.

    Sequence logprobs are sums over weighted tokens (the reply; prompt and padding weigh 0), so a
    multi-turn reply counts every policy token and no environment token.

    >>> w = torch.ones(2, 1); lp = torch.tensor([[-1.0], [-3.0]]); ref = torch.full((2, 1), -2.0)
    >>> loss, m = dpo_loss(lp, LossBatch(w, ref_logprobs_BT=ref), LossConfig(beta=0.5))
    >>> round(loss.item(), 4), m["dpo/accuracy"], m["dpo/margin"]
    (0.3133, 1.0, 1.0)
    """
    B = logprobs_BT.shape[0]
    if B % 2:
        raise ValueError(f"dpo needs (chosen, rejected) pairs in rows 2i, 2i + 1; got a batch of {B} rows "
                         "(a micro-batch split a pair?)")
    if batch.ref_logprobs_BT is None:
        raise ValueError("dpo needs reference logprobs: build the learner with needs_reference=True")
    seq_B = (logprobs_BT * batch.weights_BT).sum(-1)
    ref_B = (batch.ref_logprobs_BT * batch.weights_BT).sum(-1)
    losses_P, chosen_P, rejected_P = dpo_sigmoid_loss(seq_B[0::2], seq_B[1::2], ref_B[0::2], ref_B[1::2], cfg.beta)
    margin_P = chosen_P - rejected_P
    metrics = {"dpo/accuracy": (margin_P > 0).float().mean().item(), "dpo/margin": margin_P.mean().item(),
               "dpo/chosen_reward": chosen_P.mean().item(), "dpo/rejected_reward": rejected_P.mean().item()}
    return losses_P.mean(), metrics
