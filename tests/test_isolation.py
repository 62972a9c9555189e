"""The suite's isolation from global state (`conftest._same_global_rng_state`)."""

import random

import numpy as np
import torch

from tinker_pipelines.checkpoint import seed_everything


def _draws() -> tuple[float, float, float]:
    return torch.rand(1).item(), random.random(), float(np.random.rand())


def test_a_test_that_draws_from_the_global_rngs():
    _draws()


def test_the_next_test_starts_from_the_same_global_rng_state():
    first = _draws()
    seed_everything(0)
    assert first == _draws()
