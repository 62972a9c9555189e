"""`benchmarks.node` composes the node parts' figures into one last JSON line; each part's own
measurement is tested beside its code (test_node_workers, test_tinker_node, test_ranked_steps)."""

import json
import subprocess
import sys


def test_an_unknown_part_is_one_error_line():
    r = subprocess.run([sys.executable, "-m", "benchmarks.node", "--parts", "workers,gpus"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == "error: --parts: gpus not among workers, placement, tinker, ddp"


def test_the_placement_part_gives_its_keys_on_the_last_line():
    r = subprocess.run([sys.executable, "-m", "benchmarks.node", "--quick", "--parts", "placement"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    last = json.loads(r.stdout.strip().splitlines()[-1])
    assert last["placement_oversubscribed"] == 0 and 1 <= last["placement_max_devices_busy"] <= 8
    assert 0 < last["makespan_ratio"] <= 1.05, last  # no worse than FIFO whole-device on the node trace
