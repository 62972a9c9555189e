"""How a policy samples its turns, declared once.

`SamplingSettings` is the episode runner's config (`rollout.episodes.RolloutConfig` is this
class) and the base of every config that samples episodes: the experiment's `training` section
(`config.TrainingConfig`), self-play training (`loops.multiagent.MultiAgentConfig`) and the
agentic benchmark's settings. They inherit the fields, their doc lines and `check_sampling`,
and only restate a default where theirs differs, so the rules and the docs cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from tinker_pipelines.rollout.truncation import check_params


@dataclass(frozen=True)
class SamplingSettings:
    """How episodes are sampled."""

    # The order is the positional order `RolloutConfig(max_new_tokens, temperature, max_turns)` callers use.
    max_new_tokens: int = 16
    """Tokens the policy may produce per turn (a turn ends earlier at an end-of-turn token or a
    stop string)."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy; training needs > 0, as its logprobs are divided by the
    temperature)."""
    max_turns: int = 1
    """Policy turns per episode before it is cut off."""
    top_k: int = 0
    """Sample among the k most likely tokens (0: off); the learner's logprobs are those of the
    truncated, renormalized distribution the sampler drew from (`rollout.truncation`)."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of most likely tokens with this much mass (1.0: off)."""
    min_p: float = 0.0
    """Sample among tokens at least min_p x as likely as the most likely one (0.0: off)."""
    stop: tuple[str, ...] = ()
    """Stop strings: a turn ends at the sampled token that completes one (kept in the
    trajectory); the environment sees the text before it. Also in evaluation."""

    def check_sampling(self, prefix: str) -> None:
        """Raise ValueError naming the first field out of range, after `prefix` ('training.').

        >>> SamplingSettings(max_turns=0).check_sampling("training.")
        Traceback (most recent call last):
        ...
        ValueError: training.max_turns must be >= 1, got 0
        """
        for name in ("max_new_tokens", "max_turns"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{prefix}{name} must be >= 1, got {value!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"{prefix}temperature must be >= 0 (0: greedy), got {self.temperature!r}")
        check_params(self.top_k, self.top_p, self.min_p, prefix=prefix)
        if isinstance(self.stop, str) or not all(isinstance(x, str) and x for x in self.stop):
            raise ValueError(f"{prefix}stop must be non-empty strings, got {self.stop!r}")

    def sampling(self) -> SamplingSettings:
        """These settings alone, as the episode runner takes them (a subclass's other fields dropped)."""
        return SamplingSettings(**{f.name: getattr(self, f.name) for f in dataclasses.fields(SamplingSettings)})

    def sampling_kwargs(self) -> dict[str, Any]:
        """The sampler keyword arguments that differ from plain sampling (none by default)."""
        out: dict[str, Any] = {k: getattr(self, k) for k, off in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0))
                               if getattr(self, k) != off}
        if self.stop:
            out["stop"] = tuple(self.stop)
        return out
