"""The training engine: what turns datums into gradients and parameter updates.

- `interface`: `TrainingClient`, the Protocol every learner implements (the in-process
  `Learner`, `DeepSpeedLearner` and a worker's `RemoteLearner`); the loops are written against it.
- `gradient`: the one loss-and-gradient path (reference, forward, loss, finite check, micro-batch
  share, backward) that every learner and the worker's shared passes run.
- `rules`: the rules a learner's settings obey, stated once for `LearnerConfig` and the config.
- `learner` (the in-process learner, `LearnerConfig`, `ValueHead`), `learner_checkpoint` (its
  checkpoints), `deepspeed_learner` and `distributed` (ZeRO over torchrun ranks).
- Their internals: `padding`, `prefix_sharing`, `lora_linear` (fused LoRA layers),
  `activation_checkpointing`, `master_weights` (fp32 masters for bf16; the dtype rule itself is
  `models.dtypes`, shared with the sampler), and `allocator` (glibc heap settings of processes that sample and train).

Importing the package loads nothing (the names below load on first use): the command line
imports `allocator` before it may start torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LearnerSettings", "ResidentLearner", "TrainingClient"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from tinker_pipelines.training import interface

        return getattr(interface, name)
    raise AttributeError(f"module 'tinker_pipelines.training' has no attribute {name!r}")
