"""The algorithm layer: losses and advantage estimators as pure functions, selected by name."""

from tinker_pipelines.algorithms.advantages import ADVANTAGES
from tinker_pipelines.algorithms.losses import LossBatch, LossConfig, fixed_normalization, kl_penalty, masked_mean
from tinker_pipelines.algorithms.registry import ALGORITHMS, Algorithm, get_algorithm, register_algorithm
from tinker_pipelines.algorithms.tinker_losses import TINKER_LOSSES, TinkerLoss, TinkerLossError, tinker_loss

__all__ = ["ADVANTAGES", "ALGORITHMS", "Algorithm", "LossBatch", "LossConfig", "fixed_normalization",
           "get_algorithm", "kl_penalty", "masked_mean", "register_algorithm", "TINKER_LOSSES", "TinkerLoss",
           "TinkerLossError", "tinker_loss"]
