"""The run configs the README points at are valid for their Dagster jobs (no model work)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("job_name, path", [
    ("sft", "sft_quickstart.yaml"), ("rl", "rl_quickstart.yaml"),
    ("sft", "dpo_quickstart_sft.yaml"), ("dpo", "dpo_quickstart.yaml"),
])
def test_readme_run_config_validates_against_its_job(job_name, path):
    import dagster as dg

    from tinker_pipelines.config import config_from_dict
    from assets.definitions import defs

    run_config = yaml.safe_load((CONFIGS / path).read_text())
    job = defs.resolve_job_def(job_name)
    assert dg.validate_run_config(job, run_config)
    (op_config,) = [op["config"] for op in run_config["ops"].values()]
    library = {k: v for k, v in op_config.items() if k not in ("kl_bound", "champion_margin", "auto_continue")}
    config_from_dict(library)


def test_paired_run_configs_share_their_experiment_settings():
    for sft, later in (("sft_quickstart.yaml", "rl_quickstart.yaml"), ("dpo_quickstart_sft.yaml", "dpo_quickstart.yaml")):
        a, b = (next(iter(yaml.safe_load((CONFIGS / p).read_text())["ops"].values()))["config"] for p in (sft, later))
        assert a == b, (sft, later)
