"""The plain-Python loop end to end: seeding, resuming, the CLI."""

import json
import subprocess
import sys
from dataclasses import replace

import yaml

from tinker_pipelines.config import config_from_dict
from tinker_pipelines.loops.train import Experiment, deterministic_metrics, train

SMALL = {
    "seed": 3,
    "env": {"path": "arithmetic", "kwargs": {"max_operand": 3}},
    "algorithm": {"name": "grpo", "kl_coef": 0.05},
    "training": {"mode": "lora", "iterations": 3, "learning_rate": 5e-3, "groups_per_batch": 4,
                 "group_size": 4, "max_new_tokens": 4},
    "sft": {"steps": 40, "batch_size": 16, "examples": 64, "learning_rate": 3e-3},
    "eval": {"every": 2, "num_tasks": 8},
}


def test_same_seed_gives_identical_metrics(tmp_path):
    runs = []
    for name in ("a", "b"):
        cfg = config_from_dict({**SMALL, "output_dir": str(tmp_path / name)})
        runs.append([deterministic_metrics(m) for m in train(cfg)])
    assert runs[0] == runs[1]
    assert len(runs[0]) == 3 and "eval/exact_rate" in runs[0][-1] and "kl" in runs[0][0]
    other = config_from_dict({**SMALL, "seed": 4, "output_dir": str(tmp_path / "c")})
    assert [deterministic_metrics(m) for m in train(other)] != runs[0]


def test_resume_continues_identically(tmp_path):
    full = config_from_dict({**SMALL, "output_dir": str(tmp_path / "full")})
    reference = [deterministic_metrics(m) for m in train(full)]
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


def test_cli_train(tmp_path):
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump({**SMALL, "output_dir": str(tmp_path / "out")}))
    proc = subprocess.run([sys.executable, "-m", "tinker_pipelines", "train", str(cfg_path)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "iteration=2" in proc.stdout and "reward_mean=" in proc.stdout
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(l)["iteration"] for l in lines] == [-1, 0, 1, 2]
    assert (tmp_path / "out" / "checkpoints" / "iter_00002" / "adapter_model.safetensors").exists()


def test_cli_bad_config_exits_2(tmp_path):
    cfg_path = tmp_path / "cfg.yaml"
    cfg_path.write_text(yaml.safe_dump({"training": {"learning_rate": -1}}))
    proc = subprocess.run([sys.executable, "-m", "tinker_pipelines", "train", str(cfg_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "training.learning_rate" in proc.stderr
