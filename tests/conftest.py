"""Shared fixtures: the tiny model is built once per session and copied per test."""

from __future__ import annotations

import copy

import pytest
import torch

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(scope="session")
def _tiny_pristine():
    from tinker_pipelines.models import load_model

    return load_model("tiny", seed=0)


@pytest.fixture
def tiny(_tiny_pristine):
    """(model, tokenizer): a fresh copy of the tiny model for each test."""
    model, tokenizer = _tiny_pristine
    return copy.deepcopy(model), tokenizer
