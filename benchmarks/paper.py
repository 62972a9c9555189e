"""The paper's results table, reproduced on this machine, side by side with the paper's figures.

    python -m benchmarks.paper                      # all three parts (2 CPU cores: ~50 min)
    python -m benchmarks.paper --part tools         # LoRA-PPO vs full-parameter PPO only
    python -m benchmarks.paper --part curves        # one seeded experiment through three entry points
    python -m benchmarks.paper --part race          # the two-agent game, two seeds

1. **LoRA vs full-parameter PPO on the tool task** (`multiply_tools`, SmolLM2-135M-Instruct).
   One warm start for both: 3 LoRA SFT steps on calculator demonstrations (the `sft_short`
   setting of `benchmarks.agentic`, which leaves held-out success well below 1), merged into the
   base weights. Then PPO from that one start with the same budget (iterations, episodes, epochs,
   minibatches) under `training.mode: lora` and `training.mode: full`, each in its own process,
   the two side by side (so that both see the same machine load). Reported: held-out success
   after RL (greedy, the same problems), wall time until the sampled training success first
   reaches `--target`, and each process's peak resident memory after the model loaded, overall
   and while sampling, updating and evaluating. Both modes checkpoint activations (recompute
   each decoder layer in backward; `--no-gradient-checkpointing` keeps them all).
   The paper: LoRA reaches full-parameter PPO's success 3x faster with ~40% less memory.
2. **Identical curves across entry points**: one seeded PPO experiment (the tiny model on
   `arithmetic`, SFT warm start, LoRA) through the plain loop (`train`), the Dagster `rl` job
   (one run per iteration on a sqlite instance, metrics read back from MLflow), and the plain
   loop on a resident worker (`tinker-pipelines worker`). The paper: identical curves on three
   clusters. Compared: every deterministic metric of every iteration, exactly.
3. **Two agents** (`benchmarks.agentic`'s race game, two LoRA adapters on one tiny base), two
   seeds side by side: each agent's win rate against the scripted `greedy` player before and
   after, and its lowest at any evaluation. The paper: the two agents converge stably.

Prints a table; the last line is one JSON object: `lora_success`, `full_success`,
`time_to_target_ratio` (full / LoRA; paper 3), `memory_ratio` (LoRA / full; paper ~0.6),
`curves_identical`, `agents_improved` (each agent of each seed +10 points or more against
`greedy`; P(winning move | total 6..8, racing to 9) after training at least halfway from a
uniform choice among the legal moves to certainty, 0.81 under the default exact landing, 0.67
under the reach rules; and no evaluation more than 5 points below its start: no collapse).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.lora_vs_full import reset_peak, status_mb

PAPER = {"time_to_target_ratio": 3.0, "memory_ratio": 0.6}
"""The paper's figures: full-parameter / LoRA time to the target success, LoRA / full memory."""

TOOLS_ENV = {"min_digits": 2, "max_digits": 3, "prompt_style": "short", "tools": ["calculator"]}
"""`multiply_tools` keyword arguments (the calculator on), training and evaluation alike."""

PPO = {"name": "ppo", "ppo_epochs": 2, "minibatches": 2, "vf_coef": 0.1}
"""The PPO settings both modes train with."""

MODE_LR = {"lora": 2e-4, "full": 2e-5}
"""Learning rate per mode: full-parameter fine-tuning of a pretrained 135M model at the usual
~1e-5 scale, LoRA at 10x that, the ratio at which LoRA's best rate sits above full fine-tuning's
in supervised and RL fine-tuning alike (Thinking Machines, "LoRA Without Regret", 2025). The
1e-3 that `benchmarks.agentic`'s GRPO uses on this task made PPO's LoRA policy collapse after
reaching the target (docs/algorithms.md, "The paper's table"); `--lora-lr` and `--full-lr` set
them."""


def tools_config(mode: str, base_dir: str, out: str, seed: int, iterations: int, eval_tasks: int,
                 gradient_checkpointing: bool = True, learning_rate: float | None = None) -> dict:
    """The PPO experiment of one mode, from the merged warm start in `base_dir`. Activation
    checkpointing is on by default in both modes, as RL fine-tuning frameworks run it on GPUs:
    without it a 135M model's activations at this sequence length outweigh the weights, their
    gradients and Adam's state together, and the peaks compare activations, not training modes."""
    return {"seed": seed, "output_dir": out, "model": {"name": base_dir},
            "env": {"path": "multiply_tools", "kwargs": dict(TOOLS_ENV)},
            "algorithm": dict(PPO),
            "training": {"mode": mode, "iterations": iterations, "learning_rate": learning_rate or MODE_LR[mode],
                         "lora_rank": 16, "lora_alpha": 32.0, "groups_per_batch": 4, "group_size": 6,
                         "max_new_tokens": 40, "max_turns": 3, "micro_batch_size": 4,
                         "gradient_checkpointing": gradient_checkpointing},
            "eval": {"every": iterations, "num_tasks": eval_tasks}}


def warm_start(out: str, seed: int) -> None:
    """`benchmarks.agentic`'s `sft_short` warm start (3 LoRA SFT steps on calculator
    demonstrations), merged into the weights and saved to `out` (model and tokenizer)."""
    from benchmarks.agentic import TOOLS_PRESETS, sft, tool_sft_examples
    from tinker_pipelines.checkpoint import seed_everything
    from tinker_pipelines.training.learner import Learner, LearnerConfig
    from tinker_pipelines.models import load_model

    t = TOOLS_PRESETS["sft_short"]
    seed_everything(seed)
    model, tok = load_model(t.model, seed=seed)
    learner = Learner(model, LearnerConfig(mode="lora", learning_rate=t.sft_learning_rate, **t.lora), tok.pad_token_id)
    # label "tools": the same demonstration batches as benchmarks.agentic's run (3 steps of 8
    # examples: which 24 a run sees decides much of where it starts)
    sft(learner.model, tok, tool_sft_examples(t, seed), t.sft_steps, t.sft_batch_size, t.sft_learning_rate, seed,
        "tools", learner)
    merged = learner.model.merge_and_unload()
    merged.save_pretrained(out)
    tok.save_pretrained(out)


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _measured(peaks: dict[str, float], phase: str, fn):
    """`fn`, recording its peak memory under `peaks[phase]`: the GPU's allocated memory when the
    model is on one (what the paper compares), else the process's resident memory."""
    import torch

    def run(*args, **kwargs):
        reset_peak()
        if _on_gpu():
            torch.cuda.reset_peak_memory_stats()
        try:
            return fn(*args, **kwargs)
        finally:
            mb = torch.cuda.max_memory_allocated() / 2**20 if _on_gpu() else status_mb("VmHWM")
            peaks[phase] = max(peaks.get(phase, 0.0), mb)
    return run


def _train_mode(cfg_dict: dict, target: float, queue) -> None:
    """One mode's PPO run in this (fresh) process: per-iteration success and time, final held-out
    success, peak memory after the model loaded, overall and in each phase (sampling the
    rollouts, the PPO update, greedy evaluation)."""
    import torch

    torch.set_num_threads(1)
    from tinker_pipelines.config import config_from_dict
    from tinker_pipelines.loops.experiment import Experiment

    cfg = config_from_dict(cfg_dict)
    exp = Experiment(cfg)
    import gc

    gc.collect()
    peaks: dict[str, float] = {}
    for phase, name in (("rollout", "rollout"), ("update", "train_step"), ("evaluation", "evaluate")):
        setattr(exp, name, _measured(peaks, phase, getattr(exp, name)))
    before = exp.evaluate()["eval/reward_mean"]
    curve, elapsed, reached = [], 0.0, None
    for it in range(cfg.training.iterations):
        m = exp.run_iteration(it)
        elapsed += m["time/iteration_s"] - m.get("time/eval_s", 0.0)  # training time, evaluation excluded
        curve.append((it, m["reward_mean"], round(elapsed, 1), m.get("clip_fraction", float("nan"))))
        if reached is None and m["reward_mean"] >= target:
            reached = elapsed
        print(f"  [{cfg.training.mode}] iteration {it}  train success {m['reward_mean']:.2f}  "
              f"clip_fraction {m.get('clip_fraction', float('nan')):.3f}  [{elapsed:.0f} s]", flush=True)
    queue.put({"mode": cfg.training.mode, "before": before, "after": m["eval/reward_mean"], "curve": curve,
               "time_to_target_s": reached, "train_s": elapsed, "peak_mb": max(peaks.values()), "peaks_mb": peaks,
               "memory": "gpu allocated" if _on_gpu() else "resident",
               "trainable": sum(p.numel() for p in exp.local_learner().params)})


def run_tools(seed: int, iterations: int, eval_tasks: int, target: float, gradient_checkpointing: bool = True,
              learning_rates: dict[str, float] | None = None) -> dict:
    print("== LoRA vs full-parameter PPO, multiply_tools, SmolLM2-135M-Instruct ==", flush=True)
    learning_rates = learning_rates or MODE_LR
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "warm_start")
        ctx = mp.get_context("spawn")
        proc = ctx.Process(target=warm_start, args=(base, seed))  # its memory is not the modes'
        proc.start()
        proc.join()
        if proc.exitcode:
            raise RuntimeError(f"the warm start failed (exit code {proc.exitcode})")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_train_mode, args=(tools_config(mode, base, os.path.join(tmp, mode), seed,
                                                                    iterations, eval_tasks, gradient_checkpointing,
                                                                    learning_rates[mode]),
                                                       target, queue))
                 for mode in ("lora", "full")]
        results = {r["mode"]: r for r in _gather(procs, queue)}
    return {**results, "gradient_checkpointing": gradient_checkpointing, "learning_rates": learning_rates}


def _gather(procs: list, queue) -> list:
    """Start `procs`, and collect one result from each; a child that dies without one is an error,
    not a wait for ever."""
    import queue as queues

    for p in procs:
        p.start()
    out = []
    while len(out) < len(procs):
        try:
            out.append(queue.get(timeout=10))
        except queues.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for p in procs:
                    p.kill()
                raise RuntimeError(f"a benchmark process died (exit code {dead[0].exitcode}); see its output above")
    for p in procs:
        p.join()
    return out


# -- 2. identical curves --------------------------------------------------------------------------

CURVES = {"seed": 11, "env": {"path": "arithmetic", "kwargs": {"max_operand": 3}},
          "algorithm": {"name": "ppo", "ppo_epochs": 2, "minibatches": 2},
          "training": {"mode": "lora", "iterations": 3, "learning_rate": 5e-3, "groups_per_batch": 4,
                       "group_size": 4, "max_new_tokens": 4},
          "sft": {"steps": 40, "batch_size": 16, "examples": 64, "learning_rate": 3e-3},
          "eval": {"every": 2, "num_tasks": 8}}
"""The seeded experiment of the curves part: SFT makes the groups' rewards vary, so PPO trains."""


def run_curves() -> dict:
    """The same experiment through the plain loop, the Dagster `rl` job and a resident worker."""
    print("== one seeded PPO experiment: plain loop, Dagster rl job, resident worker ==", flush=True)
    home = tempfile.mkdtemp(prefix="tinker-paper-home-")
    os.environ["TINKER_HOME"] = home  # read when the Dagster definitions are imported, below
    import dagster as dg
    import torch

    from assets.launch import run_iterations, run_sft
    from tinker_pipelines.config import config_from_dict
    from assets.definitions import defs
    from tinker_pipelines.loops.train import deterministic_metrics, train
    from tinker_pipelines.worker.client import start_worker

    try:
        plain_out = Path(home) / "plain"
        plain = [deterministic_metrics(m) for m in train(config_from_dict({**CURVES, "output_dir": str(plain_out)}))]
        with dg.DagsterInstance.local_temp(str(Path(home) / "dagster")) as instance:
            ok = (run_sft(instance, "paper-curves", CURVES, log_level="WARNING")
                  and all(run_iterations(instance, "paper-curves", CURVES, log_level="WARNING")))
        t = defs.resources["mlflow"].tracker()
        run_id = t.find_run("paper-curves")
        logged = {k: dict(t.history(run_id, k)) for k in set().union(*plain)} if ok else {}  # one read per metric
        dagster = [{k: logged[k].get(i) for k in row} for i, row in enumerate(plain)] if ok else []
        worker_out = Path(home) / "on_worker"
        shutil.copytree(plain_out / "sft", worker_out / "sft")  # the worker serves the warm start
        address = Path(home) / "w.sock"
        proc = start_worker(str(worker_out / "sft"), address, device="cpu", log=Path(home) / "worker.log",
                            extra=["--no-batching", "--threads", str(torch.get_num_threads())])
        try:
            on_worker = [deterministic_metrics(m) for m in train(
                config_from_dict({**CURVES, "output_dir": str(worker_out)}), worker=str(address))]
        finally:
            import signal

            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    keys = sorted(set().union(*plain))  # evaluation metrics appear only on the iterations that evaluate
    diff = {name: max((abs(a[k] - b[k]) if b.get(k) is not None else float("inf"))
                      for a, b in zip(plain, other) for k in a) if len(other) == len(plain) else float("inf")
            for name, other in (("dagster", dagster), ("worker", on_worker))}
    return {"plain": plain, "dagster": dagster, "worker": on_worker, "max_abs_diff": diff, "keys": keys,
            "identical": all(d == 0 for d in diff.values())}


# -- 3. two agents ----------------------------------------------------------------------------------

def _race(seed: int, iterations: int, queue) -> None:
    import torch

    torch.set_num_threads(1)
    from benchmarks.agentic import RACE, run_race

    RACE["rl"]["iterations"] = iterations
    r = run_race(seed)
    queue.put((seed, {k: r[k] for k in ("curve", "take_win", "steer", "legal", "seconds")}))


def run_two_agents(seeds: list[int], iterations: int) -> dict:
    print(f"== two agents, race game, seeds {seeds} side by side ==", flush=True)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    return dict(_gather([ctx.Process(target=_race, args=(s, iterations, queue)) for s in seeds], queue))


# -- the table --------------------------------------------------------------------------------------

def _fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def report(tools: dict | None, curves: dict | None, race: dict | None, target: float) -> dict:
    result: dict = {}
    if tools:
        lora, full = tools["lora"], tools["full"]
        ttt = (full["time_to_target_s"] / lora["time_to_target_s"]
               if lora["time_to_target_s"] and full["time_to_target_s"] else None)
        mem = lora["peak_mb"] / full["peak_mb"]
        print(f"\n{'PPO on multiply_tools (SmolLM2-135M)':<40}{'LoRA':>10}{'full':>10}{'ratio':>8}{'paper':>8}")
        print(f"{'  held-out success after the warm start':<40}{lora['before']:>10.2f}{full['before']:>10.2f}")
        print(f"{'  held-out success after PPO':<40}{lora['after']:>10.2f}{full['after']:>10.2f}")
        print(f"{'  seconds to train success >= ' + format(target, '.2f'):<40}{_fmt(lora['time_to_target_s'], '.0f'):>10}"
              f"{_fmt(full['time_to_target_s'], '.0f'):>10}{_fmt(ttt):>8}{PAPER['time_to_target_ratio']:>8.1f}")
        print(f"{'  peak ' + lora['memory'] + ' memory MB':<40}{lora['peak_mb']:>10.0f}{full['peak_mb']:>10.0f}{mem:>8.2f}"
              f"{PAPER['memory_ratio']:>8.1f}")
        for phase in ("rollout", "update", "evaluation"):
            a, b = lora["peaks_mb"][phase], full["peaks_mb"][phase]
            print(f"{'    peak while ' + phase:<40}{a:>10.0f}{b:>10.0f}{a / b:>8.2f}")
        print(f"{'  trainable parameters':<40}{lora['trainable']:>10,}{full['trainable']:>10,}")
        print(f"{'  training seconds (all iterations)':<40}{lora['train_s']:>10.0f}{full['train_s']:>10.0f}"
              f"{full['train_s'] / lora['train_s']:>8.2f}")
        print("  train success per iteration: LoRA " + " ".join(f"{r:.2f}" for _, r, _, _ in lora["curve"])
              + " | full " + " ".join(f"{r:.2f}" for _, r, _, _ in full["curve"]))
        result.update(lora_success=lora["after"], full_success=full["after"],
                      success_before=lora["before"], comparable=round(abs(lora["after"] - full["after"]), 9) <= 0.05,
                      time_to_target_ratio=None if ttt is None else round(ttt, 3),
                      lora_time_to_target_s=lora["time_to_target_s"], full_time_to_target_s=full["time_to_target_s"],
                      memory_ratio=round(mem, 3), lora_peak_mb=round(lora["peak_mb"]),
                      full_peak_mb=round(full["peak_mb"]), target=target,
                      memory=lora["memory"], update_memory_ratio=round(lora["peaks_mb"]["update"] / full["peaks_mb"]["update"], 3),
                      peaks_mb={m: {k: round(v) for k, v in tools[m]["peaks_mb"].items()} for m in ("lora", "full")},
                      gradient_checkpointing=tools["gradient_checkpointing"], learning_rates=tools["learning_rates"],
                      clip_fraction_last=[lora["curve"][-1][3], full["curve"][-1][3]])
    if curves:
        print(f"\n{'one seeded PPO experiment':<40}{'iterations':>11}{'metrics':>9}{'max |diff|':>12}")
        for name in ("dagster", "worker"):
            print(f"{'  plain loop vs ' + ('Dagster rl job' if name == 'dagster' else 'resident worker'):<40}"
                  f"{len(curves[name]):>11}{len(curves['keys']):>9}{curves['max_abs_diff'][name]:>12.3g}")
        print("  reward_mean per iteration: " + " ".join(f"{m['reward_mean']:.3f}" for m in curves["plain"]))
        result.update(curves_identical=curves["identical"], curves_max_abs_diff=curves["max_abs_diff"])
    if race:
        from benchmarks.agentic import steer_totals, uniform_take_win, win_totals

        improved, lowest = True, {}
        uniform = uniform_take_win()
        reads = uniform + (1 - uniform) / 2
        wins, steers = win_totals(), steer_totals()
        win_col = f"P(win|{wins.start}..{wins.stop - 1})"
        steer_col = f"P({steers.stop}|{steers.start}..{steers.stop - 1})"
        print(f"\n{'race vs greedy (win rate)':<40}{'before':>8}{'after':>8}{'gain':>8}{'lowest':>8}"
              f"{win_col:>13}{steer_col:>11}{'P(legal)':>10}")
        for seed, r in sorted(race.items()):
            curve = r["curve"]
            for seat in ("a", "b"):
                before, after = curve[0][1][seat], curve[-1][1][seat]
                low = min(w[seat] for _, w in curve[1:])
                take_win = r["take_win"][-1][seat]
                improved &= after - before >= 0.10 and take_win >= reads and low >= before - 0.05
                lowest[f"seed{seed}_{seat}"] = low
                print(f"{'  seed ' + str(seed) + ', agent ' + seat.upper():<40}{before:>8.2f}{after:>8.2f}"
                      f"{after - before:>+8.2f}{low:>8.2f}{take_win:>13.2f}{r['steer'][-1][seat]:>11.2f}"
                      f"{r['legal'][-1][seat]:>10.2f}")
                result[f"race_seed{seed}_{seat}"] = [round(w[seat], 3) for _, w in curve]
                result[f"race_seed{seed}_{seat}_take_win"] = round(take_win, 3)
                result[f"race_seed{seed}_{seat}_steer"] = round(r["steer"][-1][seat], 3)
        print(f"  {win_col}: the winning move's probability at totals {wins.start}..{wins.stop - 1} ({uniform:.2f}:"
              f" a uniform choice among the legal moves; counted as reading the position from {reads:.2f});"
              f" {steer_col}: moving to {steers.stop} from {steers.start}..{steers.stop - 1} (1/3: uniform)")
        result.update(agents_improved=improved, race_lowest=lowest)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["all", "tools", "curves", "race"], default="all")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--iterations", type=int, default=8, help="PPO iterations of each mode")
    parser.add_argument("--eval-tasks", type=int, default=40, help="held-out problems, greedy")
    parser.add_argument("--target", type=float, default=0.8, help="training success that counts as reached")
    parser.add_argument("--no-gradient-checkpointing", dest="gradient_checkpointing", action="store_false",
                        help="tools part: keep every activation for backward (both modes)")
    parser.add_argument("--lora-lr", type=float, default=MODE_LR["lora"], help="tools part: LoRA's learning rate")
    parser.add_argument("--full-lr", type=float, default=MODE_LR["full"], help="tools part: full-parameter learning rate")
    parser.add_argument("--race-seeds", default="0,1")
    parser.add_argument("--race-iterations", type=int, default=40)
    args = parser.parse_args()
    for flag, lr in (("--lora-lr", args.lora_lr), ("--full-lr", args.full_lr)):
        if not 0 < lr < float("inf"):
            parser.error(f"{flag} must be positive, got {lr}")
    start = time.perf_counter()
    tools = (run_tools(args.seed, args.iterations, args.eval_tasks, args.target, args.gradient_checkpointing,
                       {"lora": args.lora_lr, "full": args.full_lr})
             if args.part in ("all", "tools") else None)
    curves = run_curves() if args.part in ("all", "curves") else None
    race = (run_two_agents([int(s) for s in args.race_seeds.split(",") if s], args.race_iterations)
            if args.part in ("all", "race") else None)
    result = report(tools, curves, race, args.target)
    print(f"  ({(time.perf_counter() - start) / 60:.1f} min)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
