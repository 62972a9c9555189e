"""Adapters parked on a worker between step processes: claimed in the state they were left in,
exactly as if never left; rebuilt from the checkpoint when the state asked for is another."""

import time
from dataclasses import replace

import pytest

from test_worker import _cfg, worker  # noqa: F401 (the worker fixture)
from tinker_pipelines.loops.train import Experiment, deterministic_metrics
from tinker_pipelines.worker import WorkerError
from tinker_pipelines.worker.client import NEVER_SAVED, WorkerClient

pytestmark = pytest.mark.e2e  # end to end (pyproject's `e2e` marker)


def _stats(address):
    c = WorkerClient(address)
    try:
        return c.stats()
    finally:
        c.close()


def test_a_claimed_adapter_continues_exactly_and_another_state_is_rebuilt(tmp_path, worker):
    address, _ = worker("--no-batching")
    cfg = _cfg(tmp_path, "parked", eval={"every": 1, "num_tasks": 4})  # 2 iterations, each evaluated
    ref = Experiment(cfg, worker=str(address), name="ref")
    reference = [deterministic_metrics(ref.run_iteration(i)) for i in range(2)]
    ref.worker.close()

    got, hashes = [], [NEVER_SAVED]
    for i in range(2):  # one client per iteration, as one step process per step
        exp = Experiment(cfg, worker=str(address), name="p")
        assert exp.resume_parked(i, hashes[-1]) == (i > 0)  # nothing is parked before the first
        assert exp.iteration == i
        got.append(deterministic_metrics(exp.run_iteration(i)))
        assert not exp.park()  # trained past its last checkpoint: no checkpoint holds this state
        hashes.append(exp.save(tmp_path / f"ckpt{i}", got[-1])["content_hash"])
        assert exp.park()
        exp.worker.close()
    assert got == reference
    assert _stats(address)["parked"] == ["p"]

    # a retry of iteration 1 asks for the state after iteration 0: the parked one (after 1) is dropped
    again = Experiment(cfg, worker=str(address), name="p")
    assert not again.resume_parked(1, hashes[1])
    assert _stats(address)["parked"] == []
    again.resume(tmp_path / "ckpt0")
    assert deterministic_metrics(again.run_iteration(1)) == reference[1]


def test_a_parked_adapter_needs_its_tag_and_spec_and_expires(tmp_path, worker):
    address, _ = worker("--park-ttl-s", "1.5")
    cfg = _cfg(tmp_path, "x")
    a = Experiment(cfg, worker=str(address), name="x")
    a.start_rl()
    assert a.park()
    other = WorkerClient(address)
    with pytest.raises(WorkerError, match="'x' is parked"):
        other.optim_step("x")
    other.close()
    a.worker.close()

    # another learning rate is another experiment's adapter under the same name: not taken over
    b = Experiment(replace(cfg, training=replace(cfg.training, learning_rate=0.5)), worker=str(address), name="x")
    assert not b.resume_parked(0, NEVER_SAVED)
    assert b.learner.steps == 0 and _stats(address)["claims"] == 0
    assert b.park()
    b.worker.close()
    time.sleep(2.0)
    stats = _stats(address)  # the next request drops what waited past --park-ttl-s
    assert stats["adapters"] == [] and stats["parked"] == []


def test_worker_refuses_a_negative_park_ttl():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "tinker_pipelines", "worker", "--park-ttl-s", "-1"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip() == "error: --park-ttl-s must be >= 0, got -1"
