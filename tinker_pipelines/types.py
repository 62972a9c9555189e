"""Small typed domain objects shared by every layer.

An episode is recorded token-exactly: each turn keeps the prompt tokens the policy saw, the
tokens it sampled and their sampling logprobs. Tokens the environment contributed between turns
are in the next turn's prompt and never carry loss. Nothing is re-tokenized from text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypedDict


class Message(TypedDict, total=False):
    """One chat message, as chat templates expect it."""

    role: str
    content: str


Observation = list[Message]
"""What the agent sees: the chat messages added since its last action."""


@dataclass(frozen=True)
class StepResult:
    """What `Env.step` returns."""

    observation: Observation
    """Messages the environment appends to the conversation (empty when the episode is done)."""
    reward: float
    """Reward for this step."""
    done: bool
    """True when the episode has ended."""
    info: dict[str, Any] = field(default_factory=dict)
    """Free-form diagnostics (e.g. the correct answer); logged, never trained on."""


@dataclass(frozen=True)
class Turn:
    """One policy action inside an episode."""

    prompt_tokens: tuple[int, ...]
    """Every token of the context the policy saw, including earlier turns and env tokens."""
    sampled_tokens: tuple[int, ...]
    """Tokens the policy sampled for this action."""
    sampled_logprobs: tuple[float, ...]
    """Sampling logprobs of `sampled_tokens`, one per token."""
    reward: float
    """Reward the environment returned for this action."""
    action_text: str
    """The decoded action, as the environment received it."""
    sampled_support: tuple[int, ...] = ()
    """How many tokens the truncated sampling distribution kept for each sampled token (top-k /
    top-p / min-p; `Sample.support`); empty when sampling truncated nothing."""


@dataclass(frozen=True)
class Trajectory:
    """The token-exact record of one episode."""

    turns: tuple[Turn, ...]
    """The policy's actions in order; turn k's prompt extends turn k-1's prompt and sample."""
    final_reward: float
    """Reward given when the episode ended, on top of per-turn rewards."""
    task_id: str
    """Identifies the task; episodes of one task form a group."""
    stop_reason: str = "done"
    """'done', 'max_turns' or 'context_overflow'."""
    info: dict[str, Any] = field(default_factory=dict)
    """Diagnostics from the environment's last step."""

    @property
    def total_reward(self) -> float:
        """Sum of per-turn rewards and the final reward."""
        return sum(t.reward for t in self.turns) + self.final_reward

    @property
    def num_sampled_tokens(self) -> int:
        """Tokens the policy produced across all turns."""
        return sum(len(t.sampled_tokens) for t in self.turns)


@dataclass(frozen=True)
class TrajectoryGroup:
    """G episodes of the same task, for group baselines (GRPO, RLOO)."""

    trajectories: tuple[Trajectory, ...]
    """The episodes; all share one `task_id`."""

    @property
    def rewards(self) -> list[float]:
        """Total reward of each episode, in order."""
        return [t.total_reward for t in self.trajectories]


@dataclass(frozen=True)
class Datum:
    """One training example: SFT, RL and DPO all reduce to batches of these.

    Position t predicts `target_tokens[t]` from `input_tokens[: t + 1]`.
    """

    input_tokens: tuple[int, ...]
    """Model input, length T."""
    target_tokens: tuple[int, ...]
    """Next-token targets, length T."""
    weights: tuple[float, ...]
    """Loss weight per position (0 for prompt and environment tokens), length T."""
    behaviour_logprobs: tuple[float, ...] = ()
    """Sampling logprobs of the targets (0 where weight is 0); empty for SFT."""
    advantages: tuple[float, ...] = ()
    """Advantage per position; empty for SFT."""
    support_sizes: tuple[int, ...] = ()
    """How many tokens the truncated sampling distribution kept when each target was drawn (0
    where nothing was recorded); the learner renormalizes over as many of its own most likely
    tokens. Empty: untruncated sampling, or the cut is recomputed from the learner's top-k /
    top-p / min-p."""
    reference_logprobs: tuple[float, ...] = ()
    """The reference policy's logprobs of the targets, fixed when the batch was scored (0 before
    the first weighted position), so that several passes over the batch (PPO epochs) run the
    reference forward once; empty: the learner computes them in each `forward_backward`."""

    def __post_init__(self) -> None:
        T = len(self.input_tokens)
        optional = ("behaviour_logprobs", "advantages", "support_sizes", "reference_logprobs")
        for name in ("target_tokens", "weights", *optional):
            n = len(getattr(self, name))
            if n not in ((0, T) if name in optional else (T,)):
                raise ValueError(f"Datum.{name} has length {n}, expected {T}")


@dataclass(frozen=True)
class CriticDatum(Datum):
    """A datum scored with a critic (PPO): `advantages` come from GAE and the value head
    regresses on `returns`. Sequence fields are length T, 0 where the weight is 0."""

    rewards: tuple[float, ...] = ()
    """Per-position reward: each turn's reward on its last sampled token, the final reward on the last."""
    old_values: tuple[float, ...] = ()
    """The value head's estimates when the batch was scored."""
    returns: tuple[float, ...] = ()
    """GAE returns (advantages before whitening + old values)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        T = len(self.input_tokens)
        for name in ("rewards", "old_values", "returns"):
            if len(getattr(self, name)) != T:
                raise ValueError(f"CriticDatum.{name} has length {len(getattr(self, name))}, expected {T}")


@dataclass(frozen=True)
class PreferencePair:
    """Two episodes of the same task, the first scored higher than the second."""

    task_id: str
    """The task both episodes played."""
    chosen: Trajectory
    """An episode with the group's highest total reward (the first such, in sampling order)."""
    rejected: Trajectory
    """An episode with the group's lowest total reward (the first such, in sampling order)."""

    def __post_init__(self) -> None:
        if self.chosen.turns[0].prompt_tokens != self.rejected.turns[0].prompt_tokens:
            raise ValueError(f"preference pair of task {self.task_id}: chosen and rejected start from different prompts")
        if not self.chosen.total_reward > self.rejected.total_reward:
            raise ValueError(f"preference pair of task {self.task_id}: chosen reward {self.chosen.total_reward} "
                             f"is not above rejected reward {self.rejected.total_reward}")

    @property
    def reward_gap(self) -> float:
        """Chosen minus rejected total reward (> 0)."""
        return self.chosen.total_reward - self.rejected.total_reward
