"""benchmarks.scheduler without a daemon: the burst's plan and the simulated part on a small trace."""

from __future__ import annotations

import json

from benchmarks import scheduler as bench
from benchmarks import scheduler_sim as sim


def test_the_burst_mixes_the_kinds_and_orders_dependencies():
    assert bench.counts(20) == {"lora_rl": 8, "full_rl": 4, "sft": 4, "inference": 4}
    assert sum(bench.counts(7).values()) == 7
    specs = bench.plan(20)
    assert len(specs) == 20 and len({(s.job, s.partition, s.experiment) for s in specs}) == 20
    order = {s.partition: i for i, s in enumerate(specs) if s.partition}
    for i, s in enumerate(specs):
        if s.kind == "inference":  # reads the version iteration 0 of its experiment registers, queued after it
            assert s.config["ops"]["inference_results"]["config"]["model"] == f"tinker-{s.experiment}/1"
            assert order[f"{s.experiment}:0"] < i
        if s.job == "rl":
            name, it = s.partition.split(":")
            assert it == "0" or order[f"{name}:{int(it) - 1}"] < i
            mode = s.config["ops"]["rollout_batch"]["config"]["training"]["mode"]
            assert mode == ("full" if s.kind == "full_rl" else "lora")
    assert {s.kind for s in bench.plan(4, ("lora_rl", "full_rl", "sft"))} == {"lora_rl", "full_rl", "sft"}


def test_sim_part_on_a_small_trace(capsys):
    measured = {"lora_rl": {"runs": 8, "devices": 1, "memory_gb": 2.0, "sharing": "lora", "run_step_s": 10.0},
                "sft": {"runs": 4, "devices": 1, "memory_gb": 0.0, "sharing": "exclusive", "run_step_s": 8.0},
                "broken": {"runs": 2, "devices": 1, "memory_gb": 2.0, "sharing": "lora", "run_step_s": None}}
    kinds, scale = bench.sim_kinds(measured, real_gpu_memory_gb=8.0)
    assert [k.name for k in kinds] == ["lora_rl", "sft"]  # a kind without a successful run is left out
    lora = kinds[0]
    assert lora.memory_gb == 20.0 and lora.sharing == "lora" and abs(lora.share - 2 / 3) < 1e-9
    assert abs(sum(k.share * k.median_min for k in kinds) - bench.TARGET_MEAN_MIN) < 1e-6
    # simulate() replays both schedules' audit logs and fails on any over-subscription
    out = bench.sim_part(kinds, ratio=1.215, jobs_n=60, seed=1, load=1.5, log=lambda *a: None)
    for key in ("makespan_ratio", "mean_wait_ratio", "sim_utilization", "fifo_utilization", "makespan_bound",
                "goal_met", "aggregate_ratio_needed", "sensitivity"):
        assert key in out
    assert out["jobs"] == 60 and 0 < out["sim_utilization"] <= 1
    assert out["makespan_ratio"] >= out["makespan_bound"] - 1e-9
    assert out["goal_met"] == (out["makespan_ratio"] <= bench.GOAL)

    result = bench.main(["--part", "sim", "--jobs", "40"])  # the built-in MEASURED kinds
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last == json.loads(json.dumps(result)) and "makespan_ratio" in last


def test_scheduler_sim_still_runs_its_own_trace():
    jobs = sim.trace(30, 0)
    assert sim.kinds_of(jobs) and all(j.kind in sim.KINDS for j in jobs)
    assert sim.main(["--jobs", "30"])["jobs"] == 30


def test_node_trace_sizes_lora_kinds_by_the_estimate_and_fills_every_device(capsys):
    from benchmarks import node_placement
    from tinker_pipelines.scheduler.estimate import ModelShape, estimate_memory

    kinds = {k.name: k for k in sim.node_kinds()}
    shape = ModelShape.from_config(sim.NODE_BASES["llama3-8b"])
    rl = kinds["lora_rl:llama3-8b"]
    assert rl.memory_gb == round(estimate_memory(shape, "bfloat16", sim.NODE_RL_BATCH, 16).total_gb, 3)
    assert abs(rl.memory_gb - rl.resident_gb - 16.06) < 0.01  # the difference is the base's bf16 weights
    out = node_placement.main(["--jobs", "80"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == out
    assert out["devices"] == 8 and out["max_devices_busy"] == 8 and out["oversubscribed"] == 0
    assert 0 < out["makespan_ratio"] < 1.0 and out["jobs"] == 80
    assert sim.main(["--node", "--jobs", "40"])["devices"] == 8
