"""Algorithms by name: a loss plus the advantage estimator it is used with.

Adding an algorithm is a pure function and one `register_algorithm` call; no agent, env or
runtime code changes.
"""

from __future__ import annotations

from dataclasses import dataclass

from tinker_pipelines.algorithms.advantages import ADVANTAGES
from tinker_pipelines.algorithms.dpo import dpo_loss
from tinker_pipelines.algorithms.losses import (
    LossFn,
    dr_grpo_loss,
    grpo_loss,
    importance_sampling_loss,
    ppo_loss,
    sft_loss,
)


@dataclass(frozen=True)
class Algorithm:
    """A training objective."""

    name: str
    """The name configs use."""
    loss: LossFn
    """The loss function."""
    advantages: str | None
    """Name of the group advantage estimator (see `ADVANTAGES`); None for supervised losses and
    for value-head algorithms, whose advantages come from GAE over the critic's values."""
    min_group_size: int = 1
    """Smallest group size the estimator is defined for."""
    value_head: bool = False
    """The learner trains a value head beside the policy and the loss reads values and returns (PPO)."""
    pairwise: bool = False
    """A preference loss: datums come in (chosen, rejected) pairs, rows 2i and 2i + 1 of a batch."""
    needs_reference: bool = False
    """The loss reads reference logprobs even without a KL penalty (DPO)."""
    epochs: int = 1
    """Passes over each rollout when `algorithm.ppo_epochs` is not set (PPO: 4)."""
    normalization: str | None = None
    """The loss normalization the algorithm is defined with (Dr. GRPO: 'constant'); None: it
    follows `algorithm.normalization` ('sequence' when unset)."""


ALGORITHMS: dict[str, Algorithm] = {}


def _where(fn: object) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def register_algorithm(algorithm: Algorithm, overwrite: bool = False) -> Algorithm:
    """Make `algorithm` available by name; returns it.

    A name already taken by another definition is refused (`ValueError` naming both) unless
    `overwrite=True`, since replacing it silently would change what every config that names it
    trains. Registering the same definition again (a module imported twice, a worker's
    `--import`) is allowed."""
    if not isinstance(algorithm.name, str) or not algorithm.name:
        raise ValueError(f"an algorithm's name must be a non-empty string, got {algorithm.name!r}")
    if algorithm.advantages is not None and algorithm.advantages not in ADVANTAGES:
        raise ValueError(f"algorithm {algorithm.name!r}: unknown advantage estimator {algorithm.advantages!r}; "
                         f"known: {', '.join(sorted(ADVANTAGES))}")
    old = ALGORITHMS.get(algorithm.name)
    if old is not None and not overwrite and _signature(old) != _signature(algorithm):
        raise ValueError(f"algorithm name {algorithm.name!r} is already registered with loss {_where(old.loss)}; "
                         f"register {_where(algorithm.loss)} under another name (or pass overwrite=True)")
    ALGORITHMS[algorithm.name] = algorithm
    return algorithm


def _signature(a: Algorithm) -> tuple:
    """What makes two registrations the same definition: the loss by qualified name (a module
    imported again makes new function objects) and every other field."""
    return (_where(a.loss), a.advantages, a.min_group_size, a.value_head, a.pairwise, a.needs_reference, a.epochs,
            a.normalization)


def get_algorithm(name: str) -> Algorithm:
    """The registered algorithm `name`; `ValueError` naming `algorithm.name` otherwise."""
    try:
        return ALGORITHMS[name]
    except KeyError:
        raise ValueError(f"algorithm.name {name!r} is unknown; registered: {', '.join(sorted(ALGORITHMS))}") from None


register_algorithm(Algorithm("sft", sft_loss, None))
register_algorithm(Algorithm("importance_sampling", importance_sampling_loss, "group_centered", 2))
# PPO scores with its critic (GAE), not a group baseline: any group size works.
# PPO reuses each rollout: 4 epochs (TRL's num_ppo_epochs, cleanrl's update_epochs), whole batch per step.
register_algorithm(Algorithm("ppo", ppo_loss, None, value_head=True, epochs=4))
register_algorithm(Algorithm("dr_grpo", dr_grpo_loss, "group_centered", 2, normalization="constant"))
register_algorithm(Algorithm("grpo", grpo_loss, "group_normalized", 2))
register_algorithm(Algorithm("rloo", importance_sampling_loss, "leave_one_out", 2))
register_algorithm(Algorithm("dpo", dpo_loss, None, pairwise=True, needs_reference=True))
