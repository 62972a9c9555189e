"""What every learner offers, declared once: `TrainingClient`.

`Learner` (in-process, LoRA or full), `DeepSpeedLearner` (ZeRO, collective) and `RemoteLearner`
(an adapter on a resident worker) implement it; the loops (`Experiment`, `train_epochs`, DPO's
steps, the Dagster assets) call nothing else on a learner, so they run unchanged on any of the
three. These are Tinker's primitives: `forward_backward` accumulates a gradient, `optim_step`
applies it, `compute_logprobs` is the forward, `save_state` / `load_state` checkpoint.

`ResidentLearner` is the narrower view the checkpoint code (`learner_checkpoint`) needs of a
learner whose modules live in this process. Neither Protocol imports a learner module, so the
checkpoint code depends on this module, not on `learner` (which imports it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from tinker_pipelines.algorithms.losses import LossConfig, LossFn
from tinker_pipelines.types import Datum


@runtime_checkable
class LearnerSettings(Protocol):
    """The settings of a learner that the loops read (`LearnerConfig` has them and more)."""

    @property
    def mode(self) -> str:
        """'lora' or 'full'."""

    @property
    def micro_batch_size(self) -> int:
        """Sequences per forward pass."""

    @property
    def needs_reference(self) -> bool:
        """Whether losses get reference logprobs (a KL penalty is on)."""

    @property
    def value_head(self) -> bool:
        """Whether a value head is trained beside the policy."""


@runtime_checkable
class TrainingClient(Protocol):
    """One trained policy: accumulate gradients, step, score datums, checkpoint.

    `forward_backward` and `optim_step` of a `DeepSpeedLearner`, and its `save_state` /
    `load_state`, are collective: every rank calls them with the same arguments."""

    cfg: LearnerSettings
    """How its parameters are trained."""
    steps: int
    """Optimizer steps taken (restored by `load_state`)."""
    device: torch.device
    """Where its parameters live (a worker's device for a `RemoteLearner`: a name only, every
    tensor it returns crosses as plain lists)."""

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the policy computes in (its base weights')."""

    def activate(self) -> None:
        """Make this policy the one a model shared by several learners applies (its adapter)."""

    def forward_backward(self, datums: list[Datum], loss_fn: LossFn,
                         loss_cfg: LossConfig = LossConfig()) -> dict[str, float]:
        """Accumulate the gradient of `loss_fn` over `datums`; returns the batch's metrics."""

    def optim_step(self) -> dict[str, float]:
        """Clip and apply the accumulated gradient; returns at least `grad_norm` (pre-clip)."""

    def compute_logprobs(self, datums: list[Datum]) -> list[list[float]]:
        """The policy's logprob of every target token, per datum (the forward, no gradient)."""

    def compute_reference_logprobs(self, datums: list[Datum]) -> list[list[float]]:
        """The KL reference's logprob of every target token, per datum."""

    def compute_values(self, datums: list[Datum]) -> list[list[float]]:
        """The value head's estimate at every position, per datum."""

    def save_state(self, path: str | Path, record: dict[str, Any] | None = None,
                   extra_rng: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write a checkpoint atomically; returns its record (with the content hash)."""

    def load_state(self, path: str | Path) -> dict[str, Any]:
        """Restore weights, optimizer and RNG states from `save_state`; returns the record."""

    def verify_checkpoint(self, path: str | Path, probe_tokens: list[int]) -> dict[str, Any]:
        """Check a checkpoint this learner wrote against its resident weights."""


class ResidentLearner(Protocol):
    """A learner whose modules live in this process, as its checkpoints read and restore it."""

    cfg: Any
    """Its `LearnerConfig` (a dataclass: the record holds `asdict(cfg)`)."""
    base_name: str
    adapter_name: str
    model: torch.nn.Module
    value_head: torch.nn.Module | None
    optimizer: torch.optim.Optimizer
    steps: int
    device: torch.device

    def activate(self) -> None:
        """Make its adapter the one the model applies."""
