"""The training engine: what turns datums into gradients and parameter updates.

- `interface`: `TrainingClient`, the Protocol every learner implements (the in-process
  `Learner`, `DeepSpeedLearner` and a worker's `RemoteLearner`); the loops are written against it.
- `gradient`: the one loss-and-gradient path (reference, forward, loss, finite check, micro-batch
  share, backward) that every learner and the worker's shared passes run.

The learner modules themselves (`learner`, `deepspeed_learner`, `learner_checkpoint`, ...) still
sit at the package root for now.
"""

from tinker_pipelines.training.interface import LearnerSettings, ResidentLearner, TrainingClient

__all__ = ["LearnerSettings", "ResidentLearner", "TrainingClient"]
