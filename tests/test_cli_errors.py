"""`tinker-pipelines train` on bad input: one `error: ...` line on stderr naming the cause, a
non-zero exit, never a traceback, and nothing already saved is lost. Each test is a row of
docs/bad_input.md. A few run the real command in a subprocess (the path a user takes, where an
escaping exception would print a traceback); the rest call `cli.main` in this process, which is
the same code without the interpreter start."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from tinker_pipelines import cli

ENVS = textwrap.dedent('''
    from tinker_pipelines.envs import Env
    from tinker_pipelines.types import StepResult


    class Fine(Env):
        def reset(self, seed=None):
            self._seed = seed
            return [{"role": "user", "content": "Say 1."}]

        def step(self, action):  # uniform rewards: no gradient, so no optimizer step to wait for
            return StepResult([], 1.0, True, {})


    class StepCrash(Fine):
        def step(self, action):
            raise KeyError("no such cell")


    class TupleStep(Fine):
        def step(self, action):
            return [], 1.0, True, {}


    class LongPrompt(Fine):
        def reset(self, seed=None):
            self._seed = seed
            return [{"role": "user", "content": "x " * 3000}]


    class CtorCrash(Fine):
        def __init__(self):
            raise FileNotFoundError("tasks.csv")


    class BrokenSFT(Fine):
        @staticmethod
        def sft_examples(n, seed=0):
            return [1 / 0]


    class CtrlC(Fine):
        """Ctrl-C at the 4th step: in iteration 1 (the eval before training takes 1, each iteration 2)."""
        calls = 0

        def step(self, action):
            type(self).calls += 1
            if type(self).calls == 4:
                raise KeyboardInterrupt
            return super().step(action)
''')

TINY = {"model": {"name": "tiny", "dtype": "float32"}, "env": {"path": "cli_fault_envs:Fine"},
        "training": {"iterations": 1, "groups_per_batch": 1, "group_size": 2, "max_new_tokens": 2},
        "eval": {"every": 100, "num_tasks": 1}}


@pytest.fixture(scope="module")
def envs_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli_envs")
    (d / "cli_fault_envs.py").write_text(ENVS)
    mp = pytest.MonkeyPatch()
    mp.syspath_prepend(str(d))
    yield d
    mp.undo()


def config(tmp_path: Path, **sections) -> Path:
    data = {k: dict(v) for k, v in TINY.items()}
    for k, v in sections.items():
        data[k] = {**data.get(k, {}), **v} if isinstance(v, dict) else v
    data.setdefault("output_dir", str(tmp_path / "out"))
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def run_cli(args: list[str], envs_dir: Path, preexec_fn=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(envs_dir), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "tinker_pipelines", *args], capture_output=True, text=True,
                          env=env, timeout=300, preexec_fn=preexec_fn)


def main(argv: list[str], capsys) -> tuple[int, str]:
    rc = cli.main(argv)
    return rc, capsys.readouterr().err


def error_line(stderr: str, *fragments: str) -> str:
    """The single `error:` line, which ends stderr; progress bars and warnings may come before it."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and lines[-1] == errors[0], stderr
    for f in fragments:
        assert f in errors[0], errors[0]
    return errors[0]


# -- through the real command -------------------------------------------------------------------

def test_yaml_syntax_error(tmp_path, envs_dir):
    path = tmp_path / "broken.yaml"
    path.write_text("seed: 0\ntraining: {iterations: 1\neval: {every: 1}\n")
    p = run_cli(["train", str(path)], envs_dir)
    assert p.returncode == 2
    error_line(p.stderr, f"config file {path} is not valid YAML", "line 3")


def test_env_crash_after_the_model_loads(tmp_path, envs_dir):
    p = run_cli(["train", str(config(tmp_path, env={"path": "cli_fault_envs:StepCrash"}))], envs_dir)
    assert p.returncode == 1
    error_line(p.stderr, "error: environment StepCrash raised in step(): KeyError: 'no such cell'")


# -- the same code in this process --------------------------------------------------------------

@pytest.fixture
def no_model(monkeypatch):
    """Config faults must be reported before any model loads."""
    import tinker_pipelines.loops.experiment as experiment
    import tinker_pipelines.models as models

    def boom(*a, **k):
        raise AssertionError("a model was loaded")

    for module in (models, experiment):
        monkeypatch.setattr(module, "load_model", boom)


@pytest.mark.parametrize("sections,message", [
    ({"training": {"learning_rte": 1e-3}}, "unknown field training.learning_rte"),
    ({"training": {"iterations": "ten"}}, "training.iterations must be int, got 'ten'"),
    ({"training": {"group_size": 0}}, "training.group_size must be >= 1, got 0"),
    ({"algorithm": {"name": "reinforce9"}}, "algorithm.name 'reinforce9' is unknown"),
    ({"model": {"name": "/no/such/model"}}, "model.name '/no/such/model' is neither"),
    ({"training": {"deepspeed": {"stage": 2}}}, "training.mode must be 'full' with training.deepspeed.stage 2"),
    ({"env": {"path": "cli_fault_envs:Fine", "kwargs": {"level": 3}}}, "env.kwargs {'level': 3} do not fit"),
    ({"sft": {"steps": 5}}, "sft.steps is 5 but env 'cli_fault_envs:Fine' has no sft_examples()"),
])
def test_config_faults(tmp_path, envs_dir, no_model, capsys, sections, message):
    rc, err = main(["train", str(config(tmp_path, **sections))], capsys)
    assert rc == 2
    error_line(err, f"error: {message}")
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_config_file_faults(tmp_path, no_model, capsys):
    cases = {tmp_path / "missing.yaml": f"error: config file {tmp_path / 'missing.yaml'} does not exist",
             tmp_path: f"error: config file {tmp_path} is a directory"}
    (tmp_path / "list.yaml").write_text("- seed: 0\n")
    cases[tmp_path / "list.yaml"] = "error: config must be a mapping, got list"
    for path, message in cases.items():
        rc, err = main(["train", str(path)], capsys)
        assert rc != 0 and error_line(err) == message


def test_output_dir_that_cannot_be_written(tmp_path, envs_dir, no_model, capsys):
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "run"  # a directory under a file: refused even for root
    rc, err = main(["train", str(config(tmp_path, output_dir=str(out)))], capsys)
    assert rc == 2
    error_line(err, f"error: output_dir {out} cannot be written: [Errno 20] Not a directory")


@pytest.mark.parametrize("env_path,message", [
    ("TupleStep", "environment TupleStep.step() returned tuple ([], 1.0, True, {}), not StepResult (a Gym-style"),
    ("LongPrompt", "the first prompt of LongPrompt (task 10000000) has"),
    ("CtorCrash", "environment CtorCrash ('cli_fault_envs:CtorCrash') raised in its constructor: "
                  "FileNotFoundError: tasks.csv"),
], ids=["tuple-step", "long-prompt", "constructor"])
def test_env_faults(tmp_path, envs_dir, capsys, env_path, message):
    rc, err = main(["train", str(config(tmp_path, env={"path": f"cli_fault_envs:{env_path}"}))], capsys)
    assert rc == 1
    line = error_line(err, f"error: {message}")
    if env_path == "LongPrompt":
        assert "exceeds the model context of 1024" in line


def test_ctrl_c_keeps_what_was_saved(tmp_path, envs_dir, capsys):
    import cli_fault_envs

    cli_fault_envs.CtrlC.calls = 0
    out = tmp_path / "out"
    rc, err = main(["train", str(config(tmp_path, env={"path": "cli_fault_envs:CtrlC"}, training={"iterations": 2}))],
                   capsys)
    assert rc == 130
    error_line(err, f"error: interrupted; checkpoints written so far are kept in {out}")
    assert sorted(q.name for q in (out / "checkpoints").iterdir()) == ["iter_00000"]
    assert [json.loads(m)["iteration"] for m in (out / "metrics.jsonl").read_text().splitlines()] == [-1, 0]


def test_unexpected_error_is_one_line_with_its_type(tmp_path, envs_dir, capsys):
    cfg = config(tmp_path, env={"path": "cli_fault_envs:BrokenSFT"}, sft={"steps": 1})
    rc, err = main(["train", str(cfg)], capsys)
    assert rc == 1
    error_line(err, "error: ZeroDivisionError: division by zero")
    with pytest.raises(ZeroDivisionError):  # --traceback: the exception itself, for debugging
        cli.main(["train", str(cfg), "--traceback"])


# -- checkpoints: refused with the reason, and left as they were ------------------------------------

@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, envs_dir):
    """A finished one-iteration run (checkpoint iter_00000), copied by each test below."""
    d = tmp_path_factory.mktemp("finished")
    assert cli.main(["train", str(config(d))]) == 0
    return d / "out"


def reuse(finished_run: Path, tmp_path: Path) -> tuple[Path, Path, dict[str, bytes]]:
    """(the run's copy, its checkpoint, every file's bytes before the command)."""
    import shutil

    out = tmp_path / "out"
    shutil.copytree(finished_run, out)
    return out, out / "checkpoints" / "iter_00000", {str(f): f.read_bytes() for f in out.rglob("*") if f.is_file()}


def unchanged(out: Path, before: dict[str, bytes]) -> bool:
    return {str(f): f.read_bytes() for f in out.rglob("*") if f.is_file()} == before


@pytest.mark.parametrize("sections,argv,message", [
    ({}, [], "output_dir {out} already holds 1 checkpoint(s) of an earlier run (iter_00000..iter_00000): resume it "
             "(--resume), choose another output_dir, or start over (--overwrite deletes them)"),
    ({"training": {"learning_rate": 1e-3}}, ["--resume"],
     "checkpoint {ckpt} was made with another config: training.learning_rate (0.0001 -> 0.001); resume with the "
     "config it was made with, or start a fresh output_dir"),
    ({"model": {"name": "tiny", "kwargs": {"hidden_size": 64}}}, ["--resume"],
     "checkpoint {ckpt} was made with another config: "),
    ({}, ["--resume", "--overwrite"], "resume and overwrite exclude each other"),
], ids=["stale-output-dir", "other-config", "other-model", "resume-and-overwrite"])
def test_checkpoint_of_another_run(finished_run, tmp_path, envs_dir, capsys, sections, argv, message):
    out, ckpt, before = reuse(finished_run, tmp_path)
    rc, err = main(["train", str(config(tmp_path, **sections)), *argv], capsys)
    assert rc == (2 if "--overwrite" in argv else 1)
    line = error_line(err, "error: " + message.format(out=out, ckpt=ckpt))
    if "model" in sections:
        assert "model.kwargs.hidden_size (None -> 64)" in line
    assert unchanged(out, before)


@pytest.mark.parametrize("damage,why", [
    ("truncate", "optimizer.pt has {size} bytes, the record says {full} (truncated?)"),
    ("no-record", "it has no record.json (a write that never finished?)"),
])
def test_resume_from_a_damaged_checkpoint(finished_run, tmp_path, envs_dir, capsys, damage, why):
    out, ckpt, _ = reuse(finished_run, tmp_path)
    full = (ckpt / "optimizer.pt").stat().st_size
    if damage == "truncate":
        (ckpt / "optimizer.pt").write_bytes((ckpt / "optimizer.pt").read_bytes()[:full // 2])
    else:
        (ckpt / "record.json").unlink()
    kept = {f.name: f.read_bytes() for f in ckpt.iterdir()}
    rc, err = main(["train", str(config(tmp_path)), "--resume"], capsys)
    assert rc == 1
    line = error_line(err, f"error: no complete checkpoint in {out / 'checkpoints'}: iter_00000 failed verification")
    assert why.format(size=full // 2, full=full) in line
    assert {f.name: f.read_bytes() for f in ckpt.iterdir()} == kept  # refused, not deleted


def small_disk() -> None:
    """In the child: no file may grow past 64 KiB, so writing the 380 KB adapter fails with EFBIG
    (Python ignores SIGXFSZ, so the write returns the error instead of killing the process)."""
    import resource

    resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))


def test_disk_fills_while_a_checkpoint_is_written(finished_run, tmp_path, envs_dir):
    out, ckpt, before = reuse(finished_run, tmp_path)
    p = run_cli(["train", str(config(tmp_path, training={"iterations": 2})), "--resume"], envs_dir, small_disk)
    assert p.returncode == 1
    error_line(p.stderr, f"error: writing a checkpoint under output_dir {out} failed", "File too large")
    from tinker_pipelines.checkpoint import read_record

    # iteration 1's half-written checkpoint is gone; iteration 0's is whole, byte for byte, and so are its metrics
    assert sorted(q.name for q in (out / "checkpoints").iterdir()) == ["iter_00000"]
    assert read_record(ckpt)["iteration"] == 1 and unchanged(out, before)


def test_naming_a_checkpoint_without_its_record(finished_run, tmp_path, envs_dir):
    from tinker_pipelines.checkpoint import CheckpointError
    from tinker_pipelines.config import load_config
    from tinker_pipelines.loops.train import Experiment

    out, ckpt, _ = reuse(finished_run, tmp_path)
    (ckpt / "record.json").unlink()
    exp = Experiment(load_config(config(tmp_path)))
    with pytest.raises(CheckpointError, match=f"^{ckpt} is not a complete checkpoint: it has no record.json"):
        exp.resume(ckpt)
    assert (ckpt / "adapter_model.safetensors").exists()


def test_worker_with_model_kwargs_its_builder_does_not_take(tmp_path, capsys):
    rc, err = main(["worker", "--model", "tiny", "--model-kwargs", '{"hiden": 3}', "--socket", str(tmp_path / "w.sock")],
                   capsys)
    assert rc == 2 and not (tmp_path / "w.sock").exists()  # refused before the model loads
    error_line(err, "error: --model-kwargs.hiden is not an argument of tiny (known: hidden_size, num_layers, arch)")


def test_warnings_are_one_line_and_library_noise_is_dropped(finished_run, tmp_path, envs_dir):
    """A warning the user can act on (a half-written checkpoint skipped on resume) is one
    `warning: ...` line; Python's `file:line: UserWarning` form and transformers' deprecation
    noise on every training step are not shown."""
    import shutil

    out, ckpt, _ = reuse(finished_run, tmp_path)
    damaged = out / "checkpoints" / "iter_00001"  # a newer checkpoint that fails verification
    shutil.copytree(ckpt, damaged)
    (damaged / "adapter_model.safetensors").write_bytes(b"damaged")
    p = run_cli(["train", str(config(tmp_path, training={"iterations": 2})), "--resume"], envs_dir)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = [part.strip() for line in p.stderr.splitlines() for part in line.split("\r")]  # tqdm redraws with \r
    warned = [line for line in lines if line.startswith("warning:")]
    assert len(warned) == 1 and warned[0].startswith(f"warning: skipping {damaged}"), p.stderr
    for noise in ("UserWarning", "FutureWarning", "is_gradient_checkpointing", "warnings.warn"):
        assert noise not in p.stderr, p.stderr


def test_tinker_serve_refuses_a_public_host_without_a_key(tmp_path, capsys):
    home = str(tmp_path)
    rc, err = main(["tinker", "serve", "--model", "tiny", "--host", "0.0.0.0", "--home", home], capsys)
    assert rc == 2 and err.strip().splitlines() == [
        "error: --host 0.0.0.0 is not loopback: without an API key this service accepts any key, so it only listens "
        "on 127.0.0.1; set one with --api-key-env"]
    rc, err = main(["tinker", "serve", "--model", "tiny", "--api-key-env", "NO_SUCH_VAR_HERE", "--home", home], capsys)
    assert rc == 2 and err.strip().splitlines() == [
        "error: --api-key-env NO_SUCH_VAR_HERE: that environment variable is empty or unset"]
    rc, err = main(["tinker", "serve", "--model", "no-such-model", "--home", home], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "no-such-model" in err
    rc, err = main(["tinker", "serve", "--model", "tiny", "--memory-gb", "0", "--home", home], capsys)
    assert rc == 2 and err.strip() == "error: --memory-gb must be > 0, got 0.0"
    rc, err = main(["tinker", "serve", "--model", "tiny", "--pass-tokens", "-1", "--home", home], capsys)
    assert rc == 2 and err.strip() == "error: --pass-tokens must be >= 0 (0: one pass per call), got -1"
