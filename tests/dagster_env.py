"""Shared setup of the Dagster/MLflow tests: one temporary project home for the session.

`assets.definitions` builds its resources from `TINKER_HOME` when imported, so this
module sets it first; every test uses its own experiment name (the resident-model cache and the
MLflow runs are keyed by it).
"""

from __future__ import annotations

import os
import tempfile

if "assets.definitions" not in __import__("sys").modules:
    os.environ["TINKER_HOME"] = tempfile.mkdtemp(prefix="tinker-test-home-")
os.environ.setdefault("OMP_NUM_THREADS", "1")

SMALL = {
    "seed": 3,
    # fp32 whatever the CPU: `auto` is bf16 on CPUs with AMX/AVX512-BF16, and these runs' numbers
    # (and the exact comparisons between them) were measured in fp32
    "model": {"name": "tiny", "dtype": "float32"},
    "env": {"path": "arithmetic", "kwargs": {"max_operand": 3}},
    "algorithm": {"name": "grpo", "kl_coef": 0.05},
    "training": {"mode": "lora", "iterations": 3, "learning_rate": 5e-3, "groups_per_batch": 4,
                 "group_size": 4, "max_new_tokens": 4},
    "sft": {"steps": 40, "batch_size": 16, "examples": 64, "learning_rate": 3e-3},
    "eval": {"every": 2, "num_tasks": 8},
}
"""The small config of tests/test_train.py: SFT makes rewards vary, so groups are informative."""

NO_SFT = {**SMALL, "sft": {"steps": 0}}


def tinker_home():
    from tinker_pipelines.tracking import default_home

    return default_home().ensure()


def tracker():
    from assets.definitions import defs

    return defs.resources["mlflow"].tracker()


def materializations(instance, asset: str, partition: str | None = None):
    import dagster as dg

    filt = dg.AssetRecordsFilter(asset_key=dg.AssetKey(asset), asset_partitions=[partition] if partition else None)
    return instance.fetch_materializations(filt, limit=100).records


def metadata(record) -> dict:
    return {k: v.value for k, v in record.asset_materialization.metadata.items()}
