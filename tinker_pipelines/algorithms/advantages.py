"""Advantage estimators: pure functions from a group's rewards to per-episode advantages."""

from __future__ import annotations

from typing import Callable

import torch

AdvantageFn = Callable[[torch.Tensor], torch.Tensor]


def group_normalized(rewards_G: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (r - mean) / (std + eps) within the group (std with Bessel's correction).

    >>> [round(a, 4) for a in group_normalized(torch.tensor([1.0, 0.0, 0.0, 1.0])).tolist()]
    [0.866, -0.866, -0.866, 0.866]
    """
    return (rewards_G - rewards_G.mean()) / (rewards_G.std() + eps)


def group_centered(rewards_G: torch.Tensor) -> torch.Tensor:
    """Dr. GRPO: r - mean, no division by the std.

    >>> group_centered(torch.tensor([1.0, 0.0, 0.0, 0.0])).tolist()
    [0.75, -0.25, -0.25, -0.25]
    """
    return rewards_G - rewards_G.mean()


def leave_one_out(rewards_G: torch.Tensor) -> torch.Tensor:
    """RLOO: r_i minus the mean of the other G-1 rewards.

    >>> leave_one_out(torch.tensor([1.0, 0.0, 0.0])).tolist()
    [1.0, -0.5, -0.5]
    """
    G = rewards_G.numel()
    return (rewards_G - (rewards_G.sum() - rewards_G) / (G - 1))


ADVANTAGES: dict[str, AdvantageFn] = {
    "group_normalized": group_normalized,
    "group_centered": group_centered,
    "leave_one_out": leave_one_out,
}
