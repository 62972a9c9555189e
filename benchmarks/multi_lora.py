"""Many experiments on one resident worker vs one alone, side by side in one run.

    python -m benchmarks.multi_lora [--model smollm2-135m-instruct] [--iterations 2]

`--model` is a catalog name or a model directory (scripts/gpu_check passes one of SmolLM2's shape
with random weights, and `--env reply_length`: a random model earns no arithmetic reward, so its
groups would be uniform and nothing would train). `--dtype` defaults to float32 on the CPU and
bfloat16 on CUDA.

Parts (all on this machine, on `--device` in `--dtype`):
- sampling: one mixed batch (4 adapters x 4 rows) through the worker's decoder vs one adapter x
  16 rows (its merged-weight decode, what a single experiment gets) vs PEFT's `adapter_names`
  mixed batch through HF `generate` on the same batch; tokens/s of the fastest of
  `--sampling-reps` (6) calls each, interleaved.
- sampling with adapters of mixed ranks (`mixed_ranks_part`): 8 adapters of ranks 4 to 64 x 2
  rows each in one mixed batch vs the same 16 rows of one rank-8 adapter alone (its merged-weight
  decode), fastest of `--sampling-reps` interleaved calls; also vs that adapter's 16 rows alone
  through the mixed-adapter decoder (what a lone experiment gets on a worker).
- a worker with 1 experiment vs a worker with 4 experiments (different seeds) running their RL
  iterations concurrently (one client thread each): peak RSS of each worker, aggregate tokens/s
  (sampled plus trained), and each experiment's per-iteration metrics against its solo run (with
  batching on: `identical` within 1e-4 relative, `identical_exact` bit for bit, which holds on CPU
  unless `--max-train-rows` lets experiments share training passes; on a third worker with
  batching off, the 4 concurrent experiments must equal their solo runs on that worker exactly).
- the same 4 experiments as 4 separate in-process trainers (4 processes), peak RSS summed, for reference.
- the ceiling of sharing on this device (`ceiling_part`): the work of 4 experiments' iterations
  as 4 separate calls vs one call over all their rows on merged weights (sampling and training
  each), weighed by a solo iteration's split: what an ideal sharing of one base would reach here.
  The training gain is noisy on 2 CPU cores (0.85-1.31x measured); above 1 it is room that
  shared training passes (`--max-train-rows`) could use.

`--only-sampling` runs the two sampling parts alone (their keys only).

Last line: JSON with memory_ratio, sampling_ratio, sampling_ratio_mixed_ranks
(goal >= 0.8), sampling_ratio_mixed_ranks_vs_unmerged, peft_sampling_ratio, aggregate_ratio,
aggregate_ceiling, ceiling_sampling_gain, ceiling_training_gain, identical, identical_exact,
identical_exact_unbatched, separate_processes_memory_ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from tinker_pipelines.config import config_from_dict
from tinker_pipelines.envs.base import Env
from tinker_pipelines.loops.experiment import Experiment, deterministic_metrics
from tinker_pipelines.types import StepResult
from tinker_pipelines.worker.client import start_worker

N_EXP = 4


DEVICE = "cpu"
"""Where the workers and models run (`--device`)."""
DTYPE = "float32"
"""The models' dtype (`--dtype`), in the experiments, the sampling part and the workers."""
ENV = "arithmetic"
"""The experiments' environment (`--env`): 'arithmetic' or 'reply_length' (`ReplyLengthEnv`)."""


class ReplyLengthEnv(Env):
    """One turn rewarded 1 / (1 + characters of the reply): a random-weight model's replies differ
    in length, so every group's rewards differ and every experiment trains every iteration."""

    def reset(self, seed: int | None = None):
        self._seed = seed or 0
        return [{"role": "user", "content": f"Say {self._seed % 10}."}]

    def step(self, action: str) -> StepResult:
        return StepResult([], 1.0 / (1 + len(action)), True, {})


def default_dtype(device: str) -> str:
    """`--dtype` when not given: fp32 on the CPU (bf16 matmuls are far slower there), bf16 on CUDA.

    >>> default_dtype("cpu"), default_dtype("cuda:1")
    ('float32', 'bfloat16')
    """
    return "bfloat16" if device.startswith("cuda") else "float32"


def experiment_config(model: str, seed: int, out: Path) -> dict:
    # Partial credit for a reply that contains the sum: rewards vary within groups from the start,
    # so every experiment trains every iteration (as RL experiments do) and the four stay in step.
    env = {"path": "arithmetic", "kwargs": {"max_operand": 9 if model != "tiny" else 3, "partial_credit": 1.0}}
    if ENV == "reply_length":
        env = {"path": "benchmarks.multi_lora:ReplyLengthEnv", "eval_kwargs": {}}
    return {"seed": seed, "output_dir": str(out / f"exp{seed}"), "model": {"name": model, "seed": 0, "device": DEVICE,
                                                                    "dtype": DTYPE},
            "env": env, "algorithm": {"name": "grpo"},
            "training": {"mode": "lora", "iterations": 10, "learning_rate": 2e-3, "groups_per_batch": 4, "group_size": 4,
                         "max_new_tokens": 16, "micro_batch_size": 16},
            "eval": {"every": 1000, "num_tasks": 1}}


SPLIT: dict[str, list[float]] = {}
"""Per run kind, the mean seconds per iteration an experiment spent in rollout and in training."""


def run_experiments(address: str, model: str, seeds: list[int], iterations: int, out: Path,
                    kind: str = "") -> tuple[dict, float, float]:
    """Each seed's experiment on the worker, concurrently; returns (metrics per seed, tokens, wall s)."""
    results: dict[int, list[dict]] = {}
    timings: list[tuple[float, float]] = []
    errors: list[BaseException] = []
    exps = {s: Experiment(config_from_dict(experiment_config(model, s, out)), worker=address, name=f"exp{s}")
            for s in seeds}
    for e in exps.values():
        e.start_rl()
    barrier = threading.Barrier(len(seeds))

    def go(seed: int) -> None:
        try:
            barrier.wait()
            ms = [exps[seed].run_iteration(i) for i in range(iterations)]
            timings.extend((m["time/rollout_s"], m["time/train_s"]) for m in ms)
            results[seed] = [deterministic_metrics(m) for m in ms]
        except BaseException as e:  # reported below
            errors.append(e)

    start = time.perf_counter()
    threads = [threading.Thread(target=go, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    if kind:
        SPLIT.setdefault(kind, []).extend(timings)
    tokens = sum(m.get("sampled_tokens", 0) + m.get("trained_tokens", 0) for ms in results.values() for m in ms)
    for e in exps.values():
        e.worker.close()
    return results, tokens, wall


def worker_stats(address: str) -> dict:
    from tinker_pipelines.worker.client import WorkerClient

    c = WorkerClient(address)
    try:
        return c.stats()
    finally:
        c.close()


def close_enough(a: list[dict], b: list[dict], tol: float = 1e-4) -> bool:
    return all(x.keys() == y.keys() and all(abs(x[k] - y[k]) <= tol * max(1.0, abs(y[k])) for k in x)
               for x, y in zip(a, b, strict=True))


def differences(a: list[dict], b: list[dict]) -> list[str]:
    """'iteration: metric a vs b' for every metric further apart than close_enough allows."""
    out = []
    for i, (x, y) in enumerate(zip(a, b)):
        for k in sorted(set(x) | set(y)):
            if k not in x or k not in y or abs(x[k] - y[k]) > 1e-4 * max(1.0, abs(y[k])):
                out.append(f"{i}: {k} {x.get(k)} vs {y.get(k)}")
    return out


def _with_adapters(model, ranks: dict[str, int]):
    """`model` under PEFT with one LoRA adapter per name (its rank; lora_alpha = 2 x rank, as the
    Tinker service sets it) on every attention and MLP projection, B drawn small so that each
    adapter changes the samples."""
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft = None
    for name, r in ranks.items():
        cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets)
        peft = get_peft_model(model, cfg, adapter_name=name) if peft is None else (peft.add_adapter(name, cfg) or peft)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 1e-3)
    return peft.eval()


def _prompts(tok, rows: int) -> list[list[int]]:
    from tinker_pipelines.models import encode_chat

    return [encode_chat(tok, [{"role": "user", "content": f"Repeat this: {1000 + 37 * i}"}]) for i in range(rows)]


def sampling_part(model_name: str, rows: int = 16, tokens: int = 32, reps: int = 6) -> dict:
    from tinker_pipelines.models import load_model
    from tinker_pipelines.rollout.sampler import Sampler, SampleRequest

    model, tok = load_model(model_name, device=DEVICE, dtype=DTYPE)
    names = [f"exp{i}" for i in range(N_EXP)]
    peft = _with_adapters(model, {n: 8 for n in names})
    prompts = _prompts(tok, rows)
    sampler = Sampler(peft, tok.pad_token_id, [])  # no stops: every row decodes `tokens` tokens
    per = rows // N_EXP

    def mixed():
        return sampler.sample_requests([SampleRequest(prompts[i * per:(i + 1) * per], tokens, 1.0,
                                                      torch.Generator().manual_seed(i), n) for i, n in enumerate(names)])

    def single():
        peft.set_adapter(names[0])
        return sampler.sample(prompts, tokens, 1.0, torch.Generator().manual_seed(0))

    def peft_mixed():
        peft.set_adapter(names[0])
        ids = torch.full((rows, max(len(p) for p in prompts)), tok.pad_token_id, device=model.device)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, -len(p):] = torch.tensor(p, device=model.device)
            mask[i, -len(p):] = 1
        with torch.inference_mode():
            return peft.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                                 do_sample=True, adapter_names=[names[i // per] for i in range(rows)],
                                 pad_token_id=tok.pad_token_id)

    times = {"mixed": [], "single": [], "peft": []}
    for fn in (mixed, single, peft_mixed):  # warm-up (fused weights, caches)
        fn()
    for _ in range(reps):  # interleaved so load on the machine hits all three alike
        for key, fn in (("mixed", mixed), ("single", single), ("peft", peft_mixed)):
            t = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t)
    tps = {k: rows * tokens / min(v) for k, v in times.items()}
    return tps


MIXED_RANKS = (4, 8, 12, 16, 24, 32, 48, 64)
"""The adapters' ranks in `mixed_ranks_part` (lora_alpha = 2 x rank, as the Tinker service sets it)."""


def mixed_ranks_part(model_name: str, rows: int = 16, tokens: int = 32, reps: int = 6) -> dict:
    """Tokens/s of one mixed batch of 8 adapters of `MIXED_RANKS` (rows / 8 rows each) vs the
    same rows of one rank-8 adapter alone: merged into the weights (`solo`, what `sampling_part`
    compares with) and through the mixed-adapter decoder (`solo_unmerged`); fastest of `reps`
    interleaved calls each. Every row decodes `tokens` tokens (no stop tokens)."""
    from tinker_pipelines.models import load_model
    from tinker_pipelines.rollout.sampler import Sampler, SampleRequest

    model, tok = load_model(model_name, device=DEVICE, dtype=DTYPE)
    names = [f"r{r}" for r in MIXED_RANKS]
    peft = _with_adapters(model, dict(zip(names, MIXED_RANKS)))
    prompts = _prompts(tok, rows)
    sampler = Sampler(peft, tok.pad_token_id, [])
    per = rows // len(names)
    solo_name = names[MIXED_RANKS.index(8)]

    def mixed():
        return sampler.sample_requests([SampleRequest(prompts[i * per:(i + 1) * per], tokens, 1.0,
                                                      torch.Generator().manual_seed(i), n) for i, n in enumerate(names)])

    def solo():
        peft.set_adapter(solo_name)
        return sampler.sample(prompts, tokens, 1.0, torch.Generator().manual_seed(0))

    def solo_unmerged():
        return sampler.sample_requests([SampleRequest(prompts, tokens, 1.0, torch.Generator().manual_seed(0),
                                                      solo_name)])

    modes = (("mixed", mixed), ("solo", solo), ("solo_unmerged", solo_unmerged))
    times: dict[str, list[float]] = {k: [] for k, _ in modes}
    for _, fn in modes:  # warm-up (fused weights, checked forms)
        fn()
    for _ in range(reps):
        for key, fn in modes:
            t = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t)
    return {k: rows * tokens / min(v) for k, v in times.items()}


def ceiling_part(model_name: str, out: Path, reps: int = 3) -> dict:
    """What an ideal sharing of one base would gain on this device, measured: the work of N_EXP
    experiments' iterations done as N_EXP separate calls vs as one call over all their rows, on
    one experiment's merged weights (an ideal mixed batch: no per-row deltas, no batching rules).
    Sampling: `run_groups` over each experiment's groups vs over all of them at once. Training:
    `forward_backward` over each experiment's datums vs over all of them in one micro-batch.
    Returns the gain of each phase: time of the separate calls / time of the one call, fastest of
    `reps` (`aggregate_ceiling` weighs them by a real iteration's split)."""
    import dataclasses
    import random

    from tinker_pipelines.loops.experiment import EVAL_SEED_OFFSET
    from tinker_pipelines.rollout.episodes import run_groups

    exp = Experiment(config_from_dict(experiment_config(model_name, 1, out / "ceiling")), name="ceiling")
    learner = exp.start_rl()
    t = exp.cfg.training
    rng = random.Random(0)
    seeds = [[rng.randrange(EVAL_SEED_OFFSET) for _ in range(t.groups_per_batch)] for _ in range(N_EXP)]
    all_seeds = [x for s in seeds for x in s]

    def sample(task_seeds: list[int]):
        return run_groups(exp.sampler(), exp.tokenizer, exp.env_spec, task_seeds, t.group_size, exp.rollout_cfg,
                          torch.Generator().manual_seed(len(task_seeds)))

    datums = [exp.score(sample(s)) for s in seeds]  # also the warm-up of every sampling shape
    sample(all_seeds)
    one_mb = dataclasses.replace(learner.cfg, micro_batch_size=sum(len(d) for d in datums))

    def train(batches: list) -> None:
        for d in batches:  # an experiment whose groups were all uniform trains nothing, as in a real iteration
            if d:
                learner.forward_backward(d, exp.algorithm.loss, exp.loss_cfg)
        learner.optimizer.zero_grad(set_to_none=True)  # timing only: the adapter never steps

    def train_one() -> None:
        cfg, learner.cfg = learner.cfg, one_mb
        try:
            train([[x for d in datums for x in d]])
        finally:
            learner.cfg = cfg

    phases = {"sampling": (lambda: [sample(s) for s in seeds], lambda: sample(all_seeds)),
              "training": (lambda: train(datums), train_one)}
    best: dict[str, list[float]] = {}
    for _ in range(reps):  # interleaved so the machine's load hits both sides alike
        for name, (separate, together) in phases.items():
            for side, fn in (("separate", separate), ("together", together)):
                start = time.perf_counter()
                fn()
                key = f"{name}_{side}"
                best[key] = [*best.get(key, []), time.perf_counter() - start]
    s = {k: min(v) for k, v in best.items()}
    return {"sampling_gain": s["sampling_separate"] / s["sampling_together"],
            "training_gain": s["training_separate"] / s["training_together"], **{f"{k}_s": v for k, v in s.items()}}


def aggregate_ceiling(rollout_s: float, train_s: float, sampling_gain: float, training_gain: float) -> float:
    """The aggregate ratio of an iteration that spends `rollout_s` sampling and `train_s` training
    alone when each phase runs `gain` times faster shared (a gain below 1 is not taken: a worker
    can always give each experiment its own passes).

    >>> round(aggregate_ceiling(2.0, 2.0, 2.0, 1.0), 3)
    1.333
    """
    return (rollout_s + train_s) / (rollout_s / max(1.0, sampling_gain) + train_s / max(1.0, training_gain))


def separate_processes(model: str, out: Path) -> float:
    """Peak RSS (MB) summed over N_EXP in-process trainers run at the same time."""
    code = ("import resource,sys,json,torch; torch.set_num_threads(1)\n"
            f"import benchmarks.multi_lora as b; b.DEVICE, b.DTYPE, b.ENV = {DEVICE!r}, {DTYPE!r}, {ENV!r}\n"
            "from tinker_pipelines.config import config_from_dict\n"
            "from tinker_pipelines.loops.experiment import Experiment\n"
            "from benchmarks.multi_lora import experiment_config\n"
            "from pathlib import Path\n"
            f"e = Experiment(config_from_dict(experiment_config({model!r}, int(sys.argv[1]), Path({str(out)!r}))))\n"
            "e.start_rl(); e.run_iteration(0)\n"
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(s)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
             for s in range(N_EXP)]
    return sum(float(p.communicate()[0].decode().strip().splitlines()[-1]) for p in procs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sampling-reps", type=int, default=6,
                        help="interleaved timed calls per sampling mode (the fastest counts)")
    parser.add_argument("--only-sampling", action="store_true",
                        help="run the sampling parts alone (no workers, no experiments)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--env", choices=["arithmetic", "reply_length"], default="arithmetic",
                        help="the experiments' environment (reply_length: rewards vary for a random-weight model)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                        help="the models' dtype (default: float32 on cpu, bfloat16 on cuda)")
    parser.add_argument("--max-train-rows", type=int, default=0,
                        help="the batching workers' --max-train-rows (0: experiments never share a training pass)")
    parser.add_argument("--window-ms", type=float, default=None,
                        help="the workers' --window-ms (how long a cycle waits for the other clients)")
    parser.add_argument("--hold-ms", type=float, default=None,
                        help="the workers' --hold-ms (how long held samples wait for co-tenants to sample; 0: none)")
    parser.add_argument("--trace", action="store_true", help="workers log each cycle (TINKER_WORKER_TRACE=1)")
    args = parser.parse_args(argv)
    if args.trace:
        os.environ["TINKER_WORKER_TRACE"] = "1"
    global DEVICE, DTYPE, ENV
    DEVICE, DTYPE, ENV = args.device, args.dtype or default_dtype(args.device), args.env
    torch.set_num_threads(args.threads)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so `finally` stops the workers
    out = Path(tempfile.mkdtemp(prefix="multi-lora-"))
    seeds = list(range(1, N_EXP + 1))
    print(f"model {args.model} ({DTYPE} on {DEVICE}), {N_EXP} experiments, {args.iterations} iterations each; "
          f"load avg {os.getloadavg()[0]:.2f}; "
          f"worker logs in {out}")

    tps = sampling_part(args.model, reps=args.sampling_reps)
    ranks_tps = mixed_ranks_part(args.model, reps=args.sampling_reps)
    ranks_keys = {"sampling_ratio_mixed_ranks": round(ranks_tps["mixed"] / ranks_tps["solo"], 3),
                  "sampling_ratio_mixed_ranks_vs_unmerged": round(ranks_tps["mixed"] / ranks_tps["solo_unmerged"], 3)}
    if args.only_sampling:
        print(f"sampling: 4 adapters x 4 rows, mixed batch {tps['mixed']:.1f} tok/s; 1 adapter x 16 rows (merged) "
              f"{tps['single']:.1f} tok/s; PEFT {tps['peft']:.1f} tok/s")
        print(f"sampling: 8 adapters of ranks {MIXED_RANKS[0]}-{MIXED_RANKS[-1]} x 2 rows {ranks_tps['mixed']:.1f} "
              f"tok/s; rank 8 x 16 rows merged {ranks_tps['solo']:.1f}, unmerged {ranks_tps['solo_unmerged']:.1f} tok/s")
        print(json.dumps({"sampling_ratio": round(tps["mixed"] / tps["single"], 3),
                          "peft_sampling_ratio": round(tps["peft"] / tps["single"], 3), **ranks_keys,
                          "model": args.model, "dtype": DTYPE, "device": DEVICE,
                          "load_avg_end": round(os.getloadavg()[0], 2)}))
        return 0
    ceiling = ceiling_part(args.model, out)
    workers = {}
    try:
        share = ["--max-train-rows", str(args.max_train_rows)]
        if args.window_ms is not None:
            share += ["--window-ms", str(args.window_ms)]
        if args.hold_ms is not None:
            share += ["--hold-ms", str(args.hold_ms)]
        for kind, extra in (("solo", share), ("shared", share), ("unbatched", ["--no-batching"])):
            address = str(out / f"{kind}.sock")
            workers[kind] = (address, start_worker(args.model, address, device=DEVICE, dtype=DTYPE,
                                                   extra=["--threads", str(args.threads), *extra],
                                                   log=out / f"{kind}.log"))
        solo, solo_tokens, solo_wall = {}, 0.0, 0.0
        for s in seeds:  # each experiment alone on its worker (the previous one's adapter is dropped)
            r, tokens, wall = run_experiments(workers["solo"][0], args.model, [s], args.iterations, out, "solo")
            solo.update(r)
            solo_tokens, solo_wall = solo_tokens + tokens, solo_wall + wall
        solo_rss = worker_stats(workers["solo"][0])["peak_rss_mb"]
        shared, shared_tokens, shared_wall = run_experiments(workers["shared"][0], args.model, seeds,
                                                             args.iterations, out, "shared")
        shared_rss = worker_stats(workers["shared"][0])["peak_rss_mb"]
        solo_unbatched = {}
        for s in seeds:  # the exact reference: each alone on the batching-off worker
            solo_unbatched.update(run_experiments(workers["unbatched"][0], args.model, [s], args.iterations, out)[0])
        unbatched, _, unbatched_wall = run_experiments(workers["unbatched"][0], args.model, seeds, args.iterations, out)
    finally:
        for _, proc in workers.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=60)
    separate_rss = separate_processes(args.model, out)

    solo_tps, shared_tps = solo_tokens / solo_wall, shared_tokens / shared_wall
    solo_rollout_s, solo_train_s = (statistics.fmean(x[i] for x in SPLIT["solo"]) for i in (0, 1))
    ceiling["aggregate_ceiling"] = aggregate_ceiling(solo_rollout_s, solo_train_s, ceiling["sampling_gain"],
                                                     ceiling["training_gain"])
    ceiling["training_share"] = solo_train_s / (solo_rollout_s + solo_train_s)
    identical = all(close_enough(shared[s], solo[s]) for s in seeds)
    identical_exact = all(shared[s] == solo[s] for s in seeds)
    for s in seeds:
        for line in differences(shared[s], solo[s])[:6]:
            print(f"  experiment {s}, iteration {line}")
    exact = all(unbatched[s] == solo_unbatched[s] for s in seeds)
    rows = [("sampling: 4 adapters x 4 rows, mixed batch", f"{tps['mixed']:.1f} tok/s"),
            ("sampling: 1 adapter x 16 rows (merged)", f"{tps['single']:.1f} tok/s"),
            ("sampling: PEFT adapter_names + generate", f"{tps['peft']:.1f} tok/s"),
            (f"sampling: 8 adapters of ranks {MIXED_RANKS[0]}-{MIXED_RANKS[-1]} x 2 rows, mixed batch",
             f"{ranks_tps['mixed']:.1f} tok/s"),
            ("sampling: 1 rank-8 adapter x 16 rows, merged / unmerged",
             f"{ranks_tps['solo']:.1f} / {ranks_tps['solo_unmerged']:.1f} tok/s"),
            ("worker, 1 experiment at a time: peak RSS", f"{solo_rss:.0f} MB"),
            ("worker, 4 experiments at once: peak RSS", f"{shared_rss:.0f} MB"),
            ("4 separate processes: peak RSS summed", f"{separate_rss:.0f} MB"),
            ("ideal sharing (one call over 4 experiments' rows vs 4 calls): sampling / training gain",
             f"{ceiling['sampling_gain']:.2f}x / {ceiling['training_gain']:.2f}x"),
            ("  training's share of a solo iteration on the worker", f"{ceiling['training_share']:.2f}"),
            ("  aggregate ceiling on this device (gains weighed by that split)", f"{ceiling['aggregate_ceiling']:.2f}x"),
            ("1 experiment alone: tokens/s (sampled+trained)", f"{solo_tps:.1f}"),
            ("4 experiments at once, batched: tokens/s", f"{shared_tps:.1f}"),
            ("4 experiments at once, unbatched: wall s", f"{unbatched_wall:.1f}"),
            *((f"{kind}: mean s per iteration in rollout / training",
               f"{sum(r for r, _ in t) / len(t):.2f} / {sum(x for _, x in t) / len(t):.2f}") for kind, t in SPLIT.items()),
            ("metrics vs solo (batched, 1e-4)", str(identical)), ("metrics vs solo (batched, exact)", str(identical_exact)),
            ("metrics vs solo (unbatched, exact)", str(exact))]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print(json.dumps({"memory_ratio": round(shared_rss / solo_rss, 3),
                      "sampling_ratio": round(tps["mixed"] / tps["single"], 3), **ranks_keys,
                      "peft_sampling_ratio": round(tps["peft"] / tps["single"], 3),
                      "aggregate_ratio": round(shared_tps / solo_tps, 3),
                      "aggregate_ceiling": round(ceiling["aggregate_ceiling"], 3),
                      "ceiling_sampling_gain": round(ceiling["sampling_gain"], 3),
                      "ceiling_training_gain": round(ceiling["training_gain"], 3), "identical": identical,
                      "identical_exact": identical_exact, "max_train_rows": args.max_train_rows,
                      "window_ms": args.window_ms, "hold_ms": args.hold_ms,
                      "identical_exact_unbatched": exact,
                      "separate_processes_memory_ratio": round(separate_rss / solo_rss, 3),
                      "model": args.model, "env": ENV, "dtype": DTYPE, "device": DEVICE, "iterations": args.iterations,
                      "load_avg_end": round(os.getloadavg()[0], 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
