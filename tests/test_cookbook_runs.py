"""The cookbook harness of `benchmarks.tinker_api`: recipe commands, the client's environment,
the recipe's own metrics and checkpoint files (samples written by the cookbook's logger code,
tests/data/cookbook/make_logs.py), timeouts, one-line errors; and the in-process replica's
copies of the recipe's problem draw and reward."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import cookbook_replica as replica
from benchmarks import cookbook_runs as cr

DATA = Path(__file__).parent / "data" / "cookbook"
HAS_COOKBOOK = cr.COOKBOOK_PYTHON.exists()
needs_cookbook = pytest.mark.skipif(not HAS_COOKBOOK, reason="no .venv-cookbook (scripts/setup_cookbook makes it)")


def _args(argv: list[str]) -> dict[str, str]:
    return dict(a.split("=", 1) for a in argv[3:])


def test_math_rl_command_names_the_recipe_and_every_setting(tmp_path):
    argv = cr.math_rl_argv(tmp_path / "smol", "http://127.0.0.1:8123", tmp_path / "log", max_steps=40, seed=2,
                           settings={"learning_rate": 3e-3}, python="/x/python")
    assert argv[:3] == ["/x/python", "-m", "tinker_cookbook.recipes.math_rl.train"]
    a = _args(argv)
    assert a["model_name"] == str((tmp_path / "smol").resolve())  # absolute: the service opens it too
    assert (a["env"], a["loss_fn"], a["renderer_name"]) == ("arithmetic", "importance_sampling", "role_colon")
    assert a["learning_rate"] == "0.003" and a["max_steps"] == "40" and a["seed"] == "2"
    assert a["base_url"] == "http://127.0.0.1:8123" and a["behavior_if_log_dir_exists"] == "delete"
    assert {"lora_rank", "groups_per_batch", "group_size", "max_tokens", "eval_every", "save_every"} <= set(a)
    with pytest.raises(ValueError, match="max_steps"):
        cr.math_rl_argv(tmp_path, "http://x", tmp_path, max_steps=0)
    with pytest.raises(ValueError, match="wandb_name"):
        cr.math_rl_argv(tmp_path, "http://x", tmp_path, max_steps=1, settings={"wandb_name": "a b"})


def test_chat_sl_command_takes_a_conversations_file(tmp_path):
    argv = cr.chat_sl_argv(tmp_path, "http://h", tmp_path / "log", "/d/conversations.jsonl", python="p")
    a = _args(argv)
    assert argv[2] == "tinker_cookbook.recipes.chat_sl.train" and a["dataset"] == "/d/conversations.jsonl"
    assert a["renderer_name"] == "role_colon" and a["lr_schedule"] == "constant"
    with pytest.raises(ValueError, match="must be a .jsonl"):
        cr.chat_sl_argv(tmp_path, "http://h", tmp_path, "no_robots")


def test_client_env_points_at_the_service_and_at_nothing_else():
    env = cr.client_env("http://127.0.0.1:9", runs_dir="/r", base={"PYTHONPATH": "/repo", "PATH": "/bin"})
    assert env["TINKER_BASE_URL"] == "http://127.0.0.1:9" and env["TINKER_API_KEY"].startswith("tml-")
    assert env["TINKER_TELEMETRY"] == "0" and env["HF_HUB_OFFLINE"] == "1" and env["WANDB_MODE"] == "disabled"
    assert "PYTHONPATH" not in env and env["PATH"] == "/bin" and env["TINKER_COOKBOOK_RUNS_DIR"] == "/r"


def test_rl_metrics_as_the_cookbook_writes_them():
    rows = cr.read_metrics(DATA / "math_rl")
    curve = cr.metric_curve(rows, cr.CORRECT_KEY)
    assert [s for s, _ in curve] == list(range(9)) and curve[0] == (0, 0.03)
    assert cr.gain(curve) == pytest.approx((0.14 + 0.16 + 0.17) / 3 - (0.03 + 0.05 + 0.02) / 3)
    assert "  0:0.030" in cr.curve_line(curve)
    final = cr.final_checkpoint(DATA / "math_rl")
    assert final["sampler_path"] == "tinker://s-0:train:0/sampler_weights/final"


def test_sl_metrics_and_final_checkpoint_as_the_cookbook_writes_them():
    losses = cr.metric_curve(cr.read_metrics(DATA / "chat_sl"), cr.SL_LOSS_KEY)
    assert len(losses) == 8 and cr.loss_fell(losses)
    assert not cr.loss_fell(list(reversed([(i, v) for i, (_, v) in enumerate(losses)])))
    assert cr.final_checkpoint(DATA / "chat_sl")["state_path"].endswith("/weights/final")


@needs_cookbook
def test_the_samples_are_what_the_cookbooks_own_logger_writes(tmp_path):
    """Regenerate the sample logs with the installed cookbook: the committed ones are its output."""
    p = subprocess.run([str(cr.COOKBOOK_PYTHON), str(DATA / "make_logs.py"), str(tmp_path)], capture_output=True,
                       text=True, timeout=300, env=cr.client_env("http://127.0.0.1:9"), cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    for run in ("math_rl", "chat_sl"):
        for name in ("metrics.jsonl", "checkpoints.jsonl"):
            assert cr.read_metrics(tmp_path / run) == cr.read_metrics(DATA / run)
            want = [json.loads(x) for x in (DATA / run / name).read_text().splitlines()]
            assert [json.loads(x) for x in (tmp_path / run / name).read_text().splitlines()] == want


def test_bad_logs_fail_with_one_line_naming_the_file(tmp_path):
    with pytest.raises(cr.RecipeError, match="wrote no .*metrics.jsonl"):
        cr.read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "env/all/correct": 0.1}\nnot json\n{"step": 1}\n')
    with pytest.raises(cr.RecipeError, match="line 2 is not JSON"):
        cr.read_metrics(tmp_path)
    # a run killed mid-write: the cut last line is dropped
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "env/all/correct": 0.1}\n{"step": 1, "env/al')
    assert cr.read_metrics(tmp_path) == [{"step": 0, "env/all/correct": 0.1}]
    with pytest.raises(cr.RecipeError, match="not a finite number"):
        cr.metric_curve([{"step": 0, "k": "nan"}], "k")
    with pytest.raises(cr.RecipeError, match="needs 6 logged steps, got 5"):
        cr.gain([(i, 0.0) for i in range(5)])
    (tmp_path / "checkpoints.jsonl").write_text('{"name": "000020", "state_path": "tinker://a/weights/000020"}\n')
    with pytest.raises(cr.RecipeError, match='no record named "final"'):
        cr.final_checkpoint(tmp_path)


def test_a_recipe_past_its_time_is_killed_with_its_children(tmp_path):
    """The group is killed: a child the recipe started (its rollout workers) does not outlive it."""
    child_pid = tmp_path / "child.pid"
    code = ("import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
            f"open({str(child_pid)!r}, 'w').write(str(c.pid)); print('started', flush=True); time.sleep(60)")
    t0 = time.perf_counter()
    run = cr.run_recipe([sys.executable, "-c", code], dict(os.environ), tmp_path, tmp_path / "out.txt", timeout_s=3)
    assert run.timed_out and time.perf_counter() - t0 < 30
    with pytest.raises(cr.RecipeError) as e:
        run.check("math_rl")
    assert "did not finish in" in str(e.value) and "last line: started" in str(e.value) and "\n" not in str(e.value)
    pid = int(child_pid.read_text())
    for _ in range(50):
        if not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the recipe's child {pid} outlived the timeout")


def test_a_failed_recipe_reports_its_last_line(tmp_path):
    run = cr.run_recipe([sys.executable, "-c", "import sys; print('loading'); sys.exit('ConfigurationError: bad')"],
                        dict(os.environ), tmp_path, tmp_path / "out.txt", timeout_s=60)
    with pytest.raises(cr.RecipeError, match=r"chat_sl exited 1: ConfigurationError: bad \(output in"):
        run.check("chat_sl")


def test_replica_draws_the_recipes_problems_and_scores_like_it():
    # ArithmeticDataset.get_batch(0) with 3 groups (RandomState seeded by the batch index)
    import numpy as np

    rng = np.random.RandomState(0)
    want = [(int(rng.randint(0, 101)), int(rng.randint(0, 101))) for _ in range(3)]
    assert replica.recipe_problems(0, 3) == want and replica.recipe_problems(1, 3) != want
    assert replica.is_correct(" 42\n\nUser:", 40, 2) and not replica.is_correct(" 4 + 2 = 7", 4, 2)
    assert replica.is_correct(" 1,000", 999, 1)  # commas dropped, as check_answer does
    assert replica.is_correct(" 42\n\nUser: 7", 40, 2)  # text past the stop sequence is not the answer
    assert replica.is_correct(" 6\n\nUser: What is 9", 4, 2)
    assert replica.reward(" 6", False, 4, 2) == pytest.approx(0.9) and replica.reward(" 6\n\nUser:", True, 4, 2) == 1.0


@needs_cookbook
def test_replica_renders_prompts_with_the_cookbooks_renderer(tmp_path):
    from tinker_pipelines import cli

    out = tmp_path / "tiny"
    assert cli.main(["model-dir", "tiny", "--out", str(out)]) == 0
    prompts = replica.render_prompts(out, [(1, 2), (30, 4)], cr.COOKBOOK_PYTHON)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.decode(prompts[1]).endswith("User: What is 30 + 4?\n\nAssistant:")
    assert prompts[0][:len(prompts[0]) - 12] == prompts[1][:len(prompts[0]) - 12]  # the shared few-shot prefix
