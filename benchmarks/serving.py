"""The OpenAI-compatible endpoint under load: 16 concurrent clients on loopback, 1 vs 4 adapters,
against the same batches decoded in-process.

    python -m benchmarks.serving [--requests 96] [--max-tokens 16] [--time-limit 120] [--model tiny]

Setup (a temporary TINKER_HOME): 4 versions of `tinker-bench` registered as the `rl` asset
registers them (LoRA adapters of `--model`, the tiny model by default; B drawn at random so each
decodes differently), one endpoint (`build_server`, uvicorn on 127.0.0.1) over their base. Each
run: 16 client threads, each with one keep-alive connection, send greedy `/v1/completions`
requests (short arithmetic prompts, `max_tokens` tokens) until `--requests` have been answered or `--time-limit` passed;
requests go round-robin to 1 adapter or to 4. Every batch the compute thread ran is recorded
and then replayed in-process (`Sampler.sample_requests` on the same engine, same requests), which
is the cost of the decoding alone.

Each setting runs twice, interleaved, and the faster run is reported (a shared machine stalls).

`--omp-wait-policy` (default `passive`, what `start_server_process` gives a served process) is set
before torch loads: with libgomp's default, torch's OpenMP worker spins after every parallel
region and, on a machine with few cores, takes a core from the decode thread and the HTTP threads
(docs/serving.md, "Figures"). `default` leaves the environment as it is, to compare.

Last line: JSON with throughput_ratio_4_vs_1 (requests/s with 4 adapters / with 1; >= 0.8 means
mixing adapters costs little), p95_ms (4 adapters), server_vs_inprocess (server requests/s /
in-process replay requests/s, 4 adapters; the HTTP, JSON and scheduling overhead).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

CLIENTS = 16
EXP = "bench"


def register_versions(n: int, model: str = "tiny") -> None:
    """`n` versions of tinker-bench in this TINKER_HOME's registry, tagged as the `rl` asset tags them."""
    import torch

    from tinker_pipelines.config import config_from_dict
    from tinker_pipelines.loops.experiment import Experiment
    from tinker_pipelines.serving.registry import registry_from_env
    from tinker_pipelines.tracking import registered_model_name
    from tinker_pipelines.tracking.mlflow_tracker import EXPERIMENT_TAG, checks_tags

    cfg = {"seed": 0, "model": {"name": model, "device": "cpu", "dtype": "float32"},
           "env": {"path": "arithmetic", "kwargs": {"max_operand": 9}}, "algorithm": {"name": "grpo"},
           "training": {"mode": "lora", "iterations": 1}, "sft": {"steps": 0}}
    exp = Experiment(config_from_dict(cfg))
    exp.start_rl()
    tracker, _ = registry_from_env()
    run_id = tracker.experiment_run(EXP)
    gen = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(n):
            with torch.no_grad():
                for name, p in exp.local_learner().model.named_parameters():
                    if "lora_B" in name:
                        p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            path = Path(tmp) / f"iter_{k}"
            record = exp.save(path)
            tracker.register_adapter(run_id, registered_model_name(EXP), path, f"adapters/iter_{k:05d}", tags={
                "partition": f"{EXP}:{k}", "content_hash": record["content_hash"], EXPERIMENT_TAG: EXP,
                "iteration": str(k), **checks_tags([])})


def load(url: str, models: list[str], requests: int, max_tokens: int, time_limit: float) -> dict:
    """16 clients until `requests` answers or `time_limit` s; latencies and requests/s."""
    host, port = url.split("//")[1].split("/")[0].split(":")
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    issued = [0]
    deadline = time.monotonic() + time_limit

    def client(c: int) -> None:
        conn = http.client.HTTPConnection(host, int(port), timeout=time_limit + 30)
        while True:
            with lock:
                if issued[0] >= requests or time.monotonic() > deadline:
                    break
                i = issued[0]
                issued[0] += 1
            body = {"model": models[i % len(models)], "prompt": f"{i % 10} + {(i * 7) % 10} =",
                    "max_tokens": max_tokens, "temperature": 0}
            start = time.perf_counter()
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            r = conn.getresponse()
            payload = json.loads(r.read())
            took = time.perf_counter() - start
            with lock:
                if r.status != 200:
                    errors.append(payload["error"]["message"])
                latencies.append(took)
        conn.close()

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    q = statistics.quantiles(latencies, n=20)
    return {"requests": len(latencies), "wall_s": wall, "rps": len(latencies) / wall,
            "p50_ms": statistics.median(latencies) * 1000, "p95_ms": q[18] * 1000}


def replay(engine, batches: list) -> float:
    """Requests/s of decoding the recorded batches in-process, one after another."""
    start = time.perf_counter()
    n = 0
    for batch in batches:
        engine.sampler.sample_requests(batch)
        n += len(batch)
    return n / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=96, help="requests per run (bounded also by --time-limit)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--time-limit", type=float, default=120.0, help="seconds per run at most")
    ap.add_argument("--model", default="tiny", help="catalog base of the adapters (tiny, smollm2-135m-instruct)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--omp-wait-policy", choices=["passive", "active", "default"], default="passive",
                    help="OMP_WAIT_POLICY for this process (default: leave the environment's)")
    args = ap.parse_args()
    os.environ["TINKER_HOME"] = tempfile.mkdtemp(prefix="tinker-bench-serving-")
    if args.omp_wait_policy != "default":  # read once, when torch loads libgomp
        os.environ["OMP_WAIT_POLICY"] = args.omp_wait_policy.upper()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from tinker_pipelines.serving.launch import ServerThread, build_server
    from tinker_pipelines.tracking import registered_model_name

    register_versions(4, args.model)
    name = registered_model_name(EXP)
    adapters = [f"{name}/{v}" for v in range(1, 5)]
    server = build_server(ref=adapters[0], max_adapters=4, device="cpu", dtype="float32")
    thread = ServerThread(server)
    print(f"{args.model}, {CLIENTS} clients on {thread.url}, up to {args.requests} requests x {args.max_tokens} tokens "
          f"per run; torch threads {torch.get_num_threads()}; OMP_WAIT_POLICY {os.environ.get('OMP_WAIT_POLICY', 'unset')}; "
          f"load avg {os.getloadavg()[0]:.2f}")
    # warm-up, untimed, with the measured workload: adapters load on first use, outside the timed runs
    load(thread.url, adapters, args.requests, args.max_tokens, args.time_limit)
    rows: dict[str, dict] = {}
    # each setting twice, interleaved, the faster run kept: on a shared machine a run can stall
    for label, models in [("4 adapters", adapters), ("1 adapter", adapters[:1])] * 2:
        server.backend.record = []
        res = load(thread.url, models, args.requests, args.max_tokens, args.time_limit)
        batches, server.backend.record = server.backend.record, None
        res["batch_mean"] = sum(map(len, batches)) / len(batches)
        res["inprocess_rps"] = replay(server.backend.engine, batches)
        print(f"  {label}: {res['rps']:.2f} req/s, p95 {res['p95_ms']:.0f} ms (in-process {res['inprocess_rps']:.2f})")
        if label not in rows or res["rps"] > rows[label]["rps"]:
            rows[label] = res
    thread.stop()
    print(f"{'':<11} {'requests':>8} {'req/s':>7} {'p50 ms':>8} {'p95 ms':>8} {'req/batch':>9} {'in-process req/s':>17}")
    for label, r in rows.items():
        print(f"{label:<11} {r['requests']:>8} {r['rps']:>7.2f} {r['p50_ms']:>8.0f} {r['p95_ms']:>8.0f} "
              f"{r['batch_mean']:>9.1f} {r['inprocess_rps']:>17.2f}")
    one, four = rows["1 adapter"], rows["4 adapters"]
    print(json.dumps({"model": args.model, "throughput_ratio_4_vs_1": round(four["rps"] / one["rps"], 3), "p95_ms": round(four["p95_ms"], 1),
                      "server_vs_inprocess": round(four["rps"] / four["inprocess_rps"], 3),
                      "rps_1": round(one["rps"], 2), "rps_4": round(four["rps"], 2),
                      "p95_ms_1": round(one["p95_ms"], 1)}))


if __name__ == "__main__":
    main()
