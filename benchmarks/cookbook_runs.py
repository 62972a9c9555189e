"""tinker-cookbook's recipes as a user runs them: commands, environment, subprocess, metrics.

The recipes run unmodified, from `.venv-cookbook` (`scripts/setup_cookbook`), against a Tinker
service URL. Everything here is read from tinker-cookbook 0.5.8's source:

- both recipes take `chz` arguments `key=value` (`recipes/math_rl/train.py::CLIConfig`,
  `recipes/chat_sl/train.py::CLIConfig`); `renderer_name` must be given for a model directory,
  else the recipe asks `model_info` for the model's recommended renderer and a local path is an
  "Unknown model" (`ConfigurationError`) there;
- `behavior_if_log_dir_exists=delete`: the default `ask` waits for a keyboard;
- metrics: `ml_log.JsonLogger` appends one JSON object per step to `{log_path}/metrics.jsonl`,
  `{"step": i, ...}`; RL's correctness is `env/all/correct` (`rl/metric_util.py` prefixes
  `ProblemEnv.step`'s `correct` with `env/all/`), SL's loss is `train_mean_nll`
  (`supervised/train.py`);
- checkpoints: `{log_path}/checkpoints.jsonl`, one record per save (`name`, `state_path`,
  `sampler_path` as `tinker://` paths; the end of a run saves one named `final`).

This module imports nothing heavy (no torch): the tests import it to check commands and parsing.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COOKBOOK_PYTHON = REPO / ".venv-cookbook" / "bin" / "python"
MATH_RL = "tinker_cookbook.recipes.math_rl.train"
CHAT_SL = "tinker_cookbook.recipes.chat_sl.train"
CORRECT_KEY = "env/all/correct"
"""The arithmetic recipe's fraction of correct answers in a step's training samples."""
SL_LOSS_KEY = "train_mean_nll"
"""chat_sl's per-token mean negative log-likelihood of a step's batch."""
API_KEY = "tml-tinker-pipelines-bench"
"""The SDK refuses, before sending anything, a key that does not start with `tml-`."""

RL_SETTINGS = {
    "env": "arithmetic", "loss_fn": "importance_sampling", "renderer_name": "role_colon",
    "lora_rank": 8, "groups_per_batch": 8, "group_size": 8, "max_tokens": 4, "learning_rate": 5e-4,
    "temperature": 1.0, "eval_every": 0, "save_every": 0,
}
"""`math_rl` on SmolLM2-135M on a 2-core CPU (docs/tinker.md says why each value)."""
SL_SETTINGS = {
    "renderer_name": "role_colon", "lora_rank": 8, "batch_size": 16, "num_epochs": 2, "learning_rate": 1e-3,
    "lr_schedule": "constant", "max_length": 1024, "save_every": 0, "eval_every": 0,
}
"""`chat_sl` on the cookbook's 128 example conversations: 8 steps an epoch."""


class RecipeError(RuntimeError):
    """A recipe run that failed, timed out, or left metrics that cannot be read; one line."""


def _chz(settings: dict) -> list[str]:
    """`key=value` arguments in chz's syntax (floats as Python writes them, booleans lower-case)."""
    out = []
    for k, v in settings.items():
        if v is None:
            continue
        text = str(v).lower() if isinstance(v, bool) else str(v)
        if not text or any(c.isspace() for c in text):
            raise ValueError(f"recipe argument {k}={v!r} must be a non-empty value without spaces")
        out.append(f"{k}={text}")
    return out


def math_rl_argv(model_dir: str | Path, base_url: str, log_path: str | Path, max_steps: int, seed: int = 0,
                 settings: dict | None = None, python: str | Path = COOKBOOK_PYTHON) -> list[str]:
    """The command line of the unmodified arithmetic RL recipe against `base_url`."""
    if max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    s = {**RL_SETTINGS, **(settings or {})}
    s.update(model_name=str(Path(model_dir).resolve()), base_url=base_url, log_path=str(log_path),
             max_steps=max_steps, seed=seed, behavior_if_log_dir_exists="delete")
    return [str(python), "-m", MATH_RL, *_chz(s)]


def chat_sl_argv(model_dir: str | Path, base_url: str, log_path: str | Path, dataset: str | Path,
                 settings: dict | None = None, python: str | Path = COOKBOOK_PYTHON) -> list[str]:
    """The command line of the unmodified chat SL recipe on a `.jsonl` of conversations."""
    if not str(dataset).endswith(".jsonl"):
        raise ValueError(f"dataset {dataset} must be a .jsonl file (chat_sl reads other names as hub datasets)")
    s = {**SL_SETTINGS, **(settings or {})}
    s.update(model_name=str(Path(model_dir).resolve()), base_url=base_url, log_path=str(log_path),
             dataset=str(dataset), behavior_if_log_dir_exists="delete")
    return [str(python), "-m", CHAT_SL, *_chz(s)]


def example_conversations(python: str | Path = COOKBOOK_PYTHON) -> Path:
    """The cookbook's shipped `example_data/conversations.jsonl` in its environment."""
    code = "import pathlib, tinker_cookbook; print(pathlib.Path(tinker_cookbook.__file__).parent)"
    p = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": ""})
    if p.returncode != 0:
        raise RecipeError(f"tinker_cookbook does not import in {python} (run scripts/setup_cookbook): "
                          f"{(p.stderr.strip().splitlines() or ['?'])[-1]}")
    path = Path(p.stdout.strip()) / "example_data" / "conversations.jsonl"
    if not path.is_file():
        raise RecipeError(f"the cookbook ships no {path}")
    return path


def client_env(base_url: str, api_key: str = API_KEY, runs_dir: str | Path | None = None,
               base: dict | None = None) -> dict[str, str]:
    """A Tinker client's environment: the service URL and key, no telemetry, no model hub, no
    tracking service; nothing of this project's Python path (the client has its own packages)."""
    env = dict(os.environ if base is None else base)
    env.pop("PYTHONPATH", None)
    env.update(TINKER_BASE_URL=base_url, TINKER_API_KEY=api_key, TINKER_TELEMETRY="0", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", TOKENIZERS_PARALLELISM="false")
    if runs_dir is not None:
        env["TINKER_COOKBOOK_RUNS_DIR"] = str(runs_dir)
    return env


@dataclass
class RecipeRun:
    """A finished (or killed) recipe process."""

    argv: list[str]
    log_path: Path
    returncode: int | None
    seconds: float
    output: Path
    """Its stdout and stderr."""
    timed_out: bool = False

    def last_line(self) -> str:
        """The last non-empty line it printed (its error, when it failed)."""
        try:
            lines = [ln.strip() for ln in self.output.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "(no output)"
        return lines[-1] if lines else "(no output)"

    def check(self, what: str) -> None:
        """Raise `RecipeError` (one line) unless it exited 0."""
        if self.timed_out:
            raise RecipeError(f"{what} did not finish in {self.seconds:.0f} s (killed); last line: {self.last_line()}; "
                              f"output in {self.output}")
        if self.returncode != 0:
            raise RecipeError(f"{what} exited {self.returncode}: {self.last_line()} (output in {self.output})")


def start_recipe(argv: list[str], env: dict[str, str], output: Path, cwd: Path) -> subprocess.Popen:
    """Start a recipe in its own process group (so a timeout ends its children too)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    with open(output, "wb") as f:
        return subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                cwd=cwd, start_new_session=True)


def wait_recipe(proc: subprocess.Popen, argv: list[str], log_path: Path, output: Path, t0: float,
                timeout_s: float) -> RecipeRun:
    """Wait for a started recipe up to `timeout_s` after `t0`; a late one is killed (its group)."""
    try:
        proc.wait(timeout=max(0.0, timeout_s - (time.perf_counter() - t0)))
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue
    return RecipeRun(argv, Path(log_path), proc.returncode, time.perf_counter() - t0, output, timed_out)


def run_recipe(argv: list[str], env: dict[str, str], log_path: Path, output: Path, timeout_s: float) -> RecipeRun:
    """Run one recipe to its end, or kill it after `timeout_s`."""
    t0 = time.perf_counter()
    proc = start_recipe(argv, env, output, Path(log_path).parent)
    return wait_recipe(proc, argv, log_path, output, t0, timeout_s)


def read_metrics(log_path: str | Path) -> list[dict]:
    """The rows of `{log_path}/metrics.jsonl`, in file order; a malformed line raises
    `RecipeError` naming it (a run killed mid-write may leave the last line cut: that one is
    dropped, as it would be by any reader of a log still being written)."""
    f = Path(log_path) / "metrics.jsonl"
    if not f.is_file():
        raise RecipeError(f"the recipe wrote no {f}")
    lines = f.read_text().splitlines()
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) and not f.read_text().endswith("\n"):
                break
            raise RecipeError(f"{f} line {i} is not JSON: {line[:80]!r}") from None
        if not isinstance(row, dict):
            raise RecipeError(f"{f} line {i} is not a JSON object")
        rows.append(row)
    return rows


def metric_curve(rows: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of every row that has `key`, by step; a step logged twice (a resumed run)
    keeps its last value. A non-numeric value raises `RecipeError` naming the step."""
    by_step: dict[int, float] = {}
    for row in rows:
        if key not in row:
            continue
        step, value = row.get("step"), row[key]
        if not isinstance(step, int) or isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            raise RecipeError(f"metrics row {row.get('step')!r}: {key} = {value!r} is not a finite number at an "
                              "integer step")
        by_step[step] = float(value)
    return sorted(by_step.items())


def gain(curve: list[tuple[int, float]], k: int = 3) -> float:
    """Mean of the last `k` values minus mean of the first `k` (the issue's `cookbook_rl_gain`);
    needs at least 2k points, so the two ends do not overlap."""
    if len(curve) < 2 * k:
        raise RecipeError(f"a gain over {k} steps at each end needs {2 * k} logged steps, got {len(curve)}")
    values = [v for _, v in curve]
    return sum(values[-k:]) / k - sum(values[:k]) / k


def loss_fell(losses: list[tuple[int, float]]) -> bool:
    """Whether the loss fell: the mean of its last quarter (at least one step) is below the mean
    of its first quarter. Needs two steps or more."""
    if len(losses) < 2:
        raise RecipeError(f"chat_sl logged {len(losses)} step(s) of {SL_LOSS_KEY}; at least 2 are needed")
    q = max(1, len(losses) // 4)
    values = [v for _, v in losses]
    return sum(values[-q:]) / q < sum(values[:q]) / q


def final_checkpoint(log_path: str | Path) -> dict:
    """The recipe's final save in `{log_path}/checkpoints.jsonl` (`sampler_path`, `state_path`)."""
    f = Path(log_path) / "checkpoints.jsonl"
    if not f.is_file():
        raise RecipeError(f"the recipe wrote no {f}")
    records = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    # save_final_async names the record "final" (its loop_state carries no "final" flag).
    finals = [r for r in records if r.get("name") == "final" or r.get("final") is True]
    if not finals:
        raise RecipeError(f"{f} has no record named \"final\" (the run did not finish)")
    record = finals[-1]
    for key in ("sampler_path", "state_path"):
        if not str(record.get(key, "")).startswith("tinker://"):
            raise RecipeError(f"{f}: the final record's {key} is {record.get(key)!r}, not a tinker:// path")
    return record


def curve_line(curve: list[tuple[int, float]], per_line: int = 10) -> str:
    """The curve as printed: `step:value` pairs, `per_line` to a line."""
    cells = [f"{s:>3}:{v:.3f}" for s, v in curve]
    return "\n".join("  " + "  ".join(cells[i:i + per_line]) for i in range(0, len(cells), per_line))
