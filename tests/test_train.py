"""The plain-Python loop end to end: seeding, resuming, the CLI."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import yaml

from dagster_env import SMALL
from tinker_pipelines.config import config_from_dict
from tinker_pipelines.loops.train import Experiment, deterministic_metrics, train


def test_same_seed_gives_identical_metrics(tmp_path, small_run):
    runs = [small_run[1]]  # the session's run of SMALL, in another directory (and process, under xdist)
    cfg = config_from_dict({**SMALL, "output_dir": str(tmp_path / "b")})
    runs.append([deterministic_metrics(m) for m in train(cfg)])
    assert runs[0] == runs[1]
    assert len(runs[0]) == 3 and "eval/exact_rate" in runs[0][-1] and "kl" in runs[0][0]
    other = config_from_dict({**SMALL, "seed": 4, "output_dir": str(tmp_path / "c")})
    assert [deterministic_metrics(m) for m in train(other)] != runs[0]


def test_resume_continues_identically(tmp_path, small_run):
    reference = small_run[1]  # SMALL uninterrupted
    part = config_from_dict({**SMALL, "output_dir": str(tmp_path / "part")})
    train(replace(part, training=replace(part.training, iterations=2)))
    rest = [deterministic_metrics(m) for m in train(part, resume=True)]
    assert rest == reference[2:]


def test_experiment_stages_match_the_loop(tmp_path):
    cfg = config_from_dict({**SMALL, "sft": {"steps": 0}, "output_dir": str(tmp_path / "loop")})
    loop = [deterministic_metrics(m) for m in train(cfg)]
    exp = Experiment(cfg)
    exp.start_rl()
    staged = [deterministic_metrics(exp.run_iteration(i)) for i in range(3)]
    assert staged == loop


@pytest.mark.e2e
def test_cli_train(tmp_path, small_run):
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump({**SMALL, "output_dir": str(tmp_path / "out")}))
    proc = subprocess.run([sys.executable, "-m", "tinker_pipelines", "train", str(cfg_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "iteration=2" in proc.stdout and "reward_mean=" in proc.stdout
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(l)["iteration"] for l in lines] == [-1, 0, 1, 2]
    assert [deterministic_metrics(json.loads(l)) for l in lines[1:]] == small_run[1]  # the CLI is the same loop
    assert (tmp_path / "out" / "checkpoints" / "iter_00002" / "adapter_model.safetensors").exists()


def test_cli_bad_config_exits_2(tmp_path):
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump({"training": {"learning_rate": -1}}))
    proc = subprocess.run([sys.executable, "-m", "tinker_pipelines", "train", str(cfg_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "training.learning_rate" in proc.stderr
