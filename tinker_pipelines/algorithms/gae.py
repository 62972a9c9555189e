"""Generalised advantage estimation (Schulman et al., 2016) over an episode's policy tokens.

Every sampled token is an action. Its reward is 0 except at the last token of a policy turn,
which carries that turn's reward (and, on the episode's last token, the final reward too).
Prompt and environment tokens are not actions: GAE runs over the weighted positions only, so
the last token of turn k bootstraps from the value of the first token of turn k + 1. After the
episode's last token the value is 0 when the environment ended the episode (termination) and
`bootstrap`, the critic's estimate of the state reached, when the runner cut it short
(`max_turns`, context overflow: truncation is not termination).

Shapes: `N` is the number of policy tokens of one episode, `T` a datum's positions.
"""

from __future__ import annotations

import torch


def gae(rewards_N: torch.Tensor, values_N: torch.Tensor, gamma: float, lam: float,
        bootstrap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns (advantages + values) of one episode's N actions.

    delta_t = r_t + gamma * V_{t+1} - V_t, A_t = delta_t + gamma * lam * A_{t+1}, where V_N is
    `bootstrap`: 0 for a terminated episode, V(s_N) for a truncated one.

    >>> adv, ret = gae(torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.5, 0.5, 0.5]), gamma=1.0, lam=1.0)
    >>> adv.tolist(), ret.tolist()
    ([0.5, 0.5, 0.5], [1.0, 1.0, 1.0])
    >>> adv, _ = gae(torch.tensor([0.0, 1.0]), torch.tensor([0.5, 0.25]), gamma=0.5, lam=0.0)
    >>> adv.tolist()  # lam = 0: one-step TD errors, 0 + 0.5 * 0.25 - 0.5 and 1 - 0.25
    [-0.375, 0.75]
    >>> gae(torch.tensor([0.0, 1.0]), torch.tensor([0.5, 0.25]), gamma=0.5, lam=0.0, bootstrap=2.0)[0].tolist()
    [-0.375, 1.75]
    """
    if rewards_N.shape != values_N.shape or rewards_N.dim() != 1:
        raise ValueError(f"gae needs two 1-d tensors of one shape, got {tuple(rewards_N.shape)} and "
                         f"{tuple(values_N.shape)}")
    next_values_N = torch.cat([values_N[1:], values_N.new_full((1,), bootstrap)])
    deltas_N = rewards_N + gamma * next_values_N - values_N
    advantages_N = torch.empty_like(deltas_N)
    running = deltas_N.new_zeros(())
    # A backward scan: N is a reply's length (tens of tokens), so a Python loop is cheap here.
    for t in range(deltas_N.numel() - 1, -1, -1):
        running = deltas_N[t] + gamma * lam * running
        advantages_N[t] = running
    return advantages_N, advantages_N + values_N


def gae_over_weighted(rewards_T: torch.Tensor, values_T: torch.Tensor, weights_T: torch.Tensor,
                      gamma: float, lam: float, bootstrap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """`gae` over the positions with weight != 0 of a datum; other positions get 0.

    >>> w = torch.tensor([0.0, 1.0, 0.0, 0.0, 1.0])   # two one-token turns with env tokens between
    >>> r = torch.tensor([9.0, 0.0, 9.0, 9.0, 1.0])   # rewards on non-actions are ignored
    >>> adv, ret = gae_over_weighted(r, torch.zeros(5), w, gamma=0.5, lam=1.0)
    >>> adv.tolist(), ret.tolist()
    ([0.0, 0.5, 0.0, 0.0, 1.0], [0.0, 0.5, 0.0, 0.0, 1.0])
    """
    idx_N = weights_T.nonzero().squeeze(-1)
    adv_N, ret_N = gae(rewards_T[idx_N], values_T[idx_N], gamma, lam, bootstrap)
    advantages_T, returns_T = torch.zeros_like(values_T), torch.zeros_like(values_T)
    advantages_T[idx_N], returns_T[idx_N] = adv_N, ret_N
    return advantages_T, returns_T


def token_rewards(weights_T: list[float], turn_ends: list[int], turn_rewards: list[float],
                  final_reward: float) -> list[float]:
    """Per-position rewards of one datum: turn k's reward at position `turn_ends[k]` (its last
    sampled token), the final reward added at the last turn's last token, 0 elsewhere.

    >>> token_rewards([0, 1, 1, 0, 1], [2, 4], [0.5, 0.0], 1.0)
    [0.0, 0.0, 0.5, 0.0, 1.0]
    """
    rewards_T = [0.0] * len(weights_T)
    for end, r in zip(turn_ends, turn_rewards):
        rewards_T[end] += r
    if turn_ends:
        rewards_T[turn_ends[-1]] += final_reward
    return rewards_T


def whiten(advantages: list[torch.Tensor], weights: list[torch.Tensor], eps: float = 1e-8) -> list[torch.Tensor]:
    """Shift and scale advantages to mean 0, std 1 over every weighted position of a batch.

    Done once over the whole batch when it is scored, not per micro-batch inside the loss, so
    micro-batching leaves the update unchanged.

    >>> [a.tolist() for a in whiten([torch.tensor([1.0, 9.0]), torch.tensor([3.0])],
    ...                             [torch.tensor([1.0, 0.0]), torch.tensor([1.0])])]
    [[-1.0, 0.0], [1.0]]
    """
    flat = torch.cat([a[w != 0] for a, w in zip(advantages, weights)])
    if flat.numel() < 2:
        return [a * (w != 0) for a, w in zip(advantages, weights)]
    mean, std = flat.mean(), flat.std(unbiased=False)
    return [((a - mean) / (std + eps)) * (w != 0) for a, w in zip(advantages, weights)]
