"""A resident worker process: same metrics as in-process, many experiments, failures, bad input."""

import os
import signal
import socket
import time
from dataclasses import replace
from multiprocessing.connection import Client
from pathlib import Path

import pytest
import torch

from tinker_pipelines.config import config_from_dict
from tinker_pipelines.envs import Env
from tinker_pipelines.types import StepResult
from tinker_pipelines.training.learner import LearnerConfig
from tinker_pipelines.loops.train import Experiment, deterministic_metrics, train
from tinker_pipelines.worker import WorkerDiedError, WorkerError, messages
from tinker_pipelines.worker.client import RemoteLearner, WorkerClient, start_worker
from tinker_pipelines.worker.server import key_path

pytestmark = pytest.mark.e2e  # end to end (pyproject's `e2e` marker)

SMALL = {"seed": 3, "model": {"name": "tiny", "seed": 0, "dtype": "float32"},
         "env": {"path": "test_worker:ShortReplyEnv", "eval_kwargs": {}},
         "algorithm": {"name": "grpo", "kl_coef": 0.05},
         "training": {"iterations": 2, "groups_per_batch": 3, "group_size": 4, "max_new_tokens": 6,
                      "learning_rate": 1e-2},
         "eval": {"every": 2, "num_tasks": 8}}


class ShortReplyEnv(Env):
    """Rewards short replies: every group of a random policy has informative rewards."""

    def reset(self, seed=None):
        self.seed = seed or 0
        return [{"role": "user", "content": f"Say {self.seed % 10}."}]

    def step(self, action):
        return StepResult([], 1.0 / (1 + len(action)), True, {})


def _cfg(tmp_path, name, **over):
    data = {**SMALL, "output_dir": str(tmp_path / name), **over}
    return config_from_dict(data)


@pytest.fixture
def worker(tmp_path_factory):
    """A worker process on the tiny base (seed 0); yields (address, process)."""
    started = []

    def make(*extra):
        d = tmp_path_factory.mktemp("w")
        address = d / "w.sock"
        proc = start_worker("tiny", address, device="cpu", dtype="float32", extra=["--threads", str(torch.get_num_threads()), *extra], log=d / "log")
        started.append(proc)
        return address, proc

    yield make
    for proc in started:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)


def test_same_metrics_in_process_and_on_a_worker(tmp_path, worker):
    address, proc = worker("--no-batching")
    local = [deterministic_metrics(m) for m in train(_cfg(tmp_path, "local"))]
    remote = [deterministic_metrics(m) for m in train(_cfg(tmp_path, "remote"), worker=str(address))]
    assert local == remote
    assert all(m["informative_groups"] > 0 for m in local if m["iteration"] >= 0)
    a = torch.load(tmp_path / "local/checkpoints/iter_00001/optimizer.pt", weights_only=True)
    b = torch.load(tmp_path / "remote/checkpoints/iter_00001/optimizer.pt", weights_only=True)
    assert a["steps"] == b["steps"] == 2
    from safetensors.torch import load_file

    wa = load_file(str(tmp_path / "local/checkpoints/iter_00001/adapter_model.safetensors"))
    wb = load_file(str(tmp_path / "remote/checkpoints/iter_00001/adapter_model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_ppo_epochs_and_minibatches_give_the_same_metrics_on_a_worker(tmp_path, worker):
    """PPO's update loop (2 epochs x 2 shuffled minibatches, critic values over IPC) only calls
    forward_backward / optim_step, so a worker reproduces the in-process run exactly."""
    address, _ = worker("--no-batching")
    over = {"algorithm": {"name": "ppo", "ppo_epochs": 2, "minibatches": 2, "kl_coef": 0.05},
            "training": {**SMALL["training"], "iterations": 1}}
    local = [deterministic_metrics(m) for m in train(_cfg(tmp_path, "ppo-local", **over))]
    remote = [deterministic_metrics(m) for m in train(_cfg(tmp_path, "ppo-remote", **over), worker=str(address))]
    assert local == remote and local[-1]["optim_steps"] == 4 and local[-1]["clip_fraction"] > 0
    # the learner's config crosses the socket whole: activation checkpointing on the worker, same numbers
    over["training"]["gradient_checkpointing"] = True
    checkpointed = [deterministic_metrics(m) for m in train(_cfg(tmp_path, "ppo-gc", **over), worker=str(address))]
    assert checkpointed == local


def _solo_runs(address, cfgs, iterations=2):
    """Each config's per-iteration metrics run alone on the worker, one after the other."""
    solo = []
    for c in cfgs:
        exp = Experiment(c, worker=str(address), name="solo-" + Path(c.output_dir).name)
        solo.append([deterministic_metrics(exp.run_iteration(i)) for i in range(iterations)])
        exp.worker.close()
    return solo


def test_two_experiments_interleaved_equal_their_solo_runs(tmp_path, worker):
    address, _ = worker()
    cfgs = [_cfg(tmp_path, "e1", seed=1), _cfg(tmp_path, "e2", seed=2)]
    solo = _solo_runs(address, cfgs)
    # interleaved: each experiment on its own connection, iterations alternating
    exps = [Experiment(c, worker=str(address)) for c in cfgs]
    both = [[], []]
    for i in range(2):
        for k, exp in enumerate(exps):
            both[k].append(deterministic_metrics(exp.run_iteration(i)))
    for s, b in zip(solo, both):
        for ms, mb in zip(s, b):
            assert ms.keys() == mb.keys()
            for key in ms:
                assert mb[key] == pytest.approx(ms[key], abs=1e-4), key


def test_concurrent_experiments_equal_their_solo_runs_exactly(tmp_path, worker):
    """Three experiments running at once on one batching worker (their samples decoded in mixed
    batches, their forward_backward calls grouped) end each iteration with exactly the metrics
    of their solo runs: co-tenants change no float (CPU: batch-invariant decoding, and training
    passes of one experiment each)."""
    import threading

    address, _ = worker()
    cfgs = [_cfg(tmp_path, f"c{s}", seed=s, training={**SMALL["training"], "groups_per_batch": 2 + s})
            for s in (1, 2, 3)]
    solo = _solo_runs(address, cfgs)
    exps = [Experiment(c, worker=str(address)) for c in cfgs]
    together: list[list[dict]] = [[] for _ in exps]
    barrier, errors = threading.Barrier(len(exps)), []

    def run(k):
        try:
            barrier.wait()
            together[k] = [deterministic_metrics(exps[k].run_iteration(i)) for i in range(2)]
        except BaseException as e:  # re-raised below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(exps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    stats = WorkerClient(str(address)).stats()
    assert len(stats["adapters"]) >= len(exps)
    for k, (t, s) in enumerate(zip(together, solo)):
        for i, (a, b) in enumerate(zip(t, s)):
            assert a == b, (k, i, {m: (a[m], b.get(m)) for m in a if a[m] != b.get(m)})


def test_worker_refuses_bad_clients_and_bad_requests(tmp_path, worker):
    address, proc = worker()
    with pytest.raises(Exception):  # wrong key: the HMAC handshake fails
        Client(str(address), family="AF_UNIX", authkey=b"not the key")
    with pytest.raises(WorkerError, match="refused this client's auth key"):
        WorkerClient(address, authkey=b"wrong")
    raw = Client(str(address), family="AF_UNIX", authkey=key_path(address).read_bytes())
    raw.send_bytes(messages.encode(messages.Hello("0" * 12)))  # a client of another schema
    reply = messages.decode_reply(messages.Op.HELLO, raw.recv_bytes())
    assert isinstance(reply, messages.Error) and reply.error == "ProtocolError"
    assert f"schema '000000000000', this worker speaks {messages.SCHEMA!r}" in reply.message
    assert "\n" not in reply.message
    client = WorkerClient(address)
    with pytest.raises(WorkerError, match="unknown adapter 'nope'"):
        client.optim_step("nope")
    RemoteLearner(client, "exp", LearnerConfig(), seed=0)
    other = WorkerClient(address)
    with pytest.raises(WorkerError, match="already exists"):
        RemoteLearner(other, "exp", LearnerConfig(), seed=0)
    with pytest.raises(WorkerError, match="belongs to another client"):
        other.optim_step("exp")
    with pytest.raises(WorkerError, match="lora_rank 128"):
        RemoteLearner(other, "big", LearnerConfig(lora_rank=128), seed=0)
    with pytest.raises(WorkerError, match="match no module"):
        RemoteLearner(other, "odd", LearnerConfig(lora_targets=("nonexistent",)), seed=0)
    with pytest.raises(WorkerError, match="needs a worker of its own"):
        RemoteLearner(other, "full", LearnerConfig(mode="full"), seed=0)
    from tinker_pipelines.rollout.sampler import ContextOverflowError
    from tinker_pipelines.worker.client import RemoteSampler

    with pytest.raises(ContextOverflowError, match="exceeds the model context"):
        RemoteSampler(client, "exp").sample([[1] * 1020], 16)
    with pytest.raises(WorkerError, match="--max-rows"):
        RemoteSampler(client, "exp").sample([[1, 2]] * 300, 4)
    from tinker_pipelines.types import Datum

    long = Datum(tuple([1] * 1100), tuple([1] * 1100), tuple([1.0] * 1100), tuple([0.0] * 1100), tuple([1.0] * 1100))
    with pytest.raises(WorkerError, match="exceeds the model context"):
        client.forward_backward("exp", [long], "grpo", {})
    # the worker still serves
    out = RemoteSampler(client, "exp").sample([[1, 2, 3]], 4, 0.0)
    assert len(out) == 1 and proc.poll() is None


def test_config_with_another_base_is_refused(tmp_path, worker):
    address, _ = worker()
    cfg = _cfg(tmp_path, "x", model={"name": "tiny", "seed": 7})
    with pytest.raises(WorkerError, match="serves base"):
        Experiment(cfg, worker=str(address))


def test_client_dying_leaves_others_untouched_and_worker_cleans_up(tmp_path, worker):
    import multiprocessing as mp

    address, proc = worker()
    keep = Experiment(_cfg(tmp_path, "keep"), worker=str(address))
    before = deterministic_metrics(keep.run_iteration(0))
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=_rollout_forever, args=(str(address), str(tmp_path / "dying")))
    child.start()
    time.sleep(8)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    after = deterministic_metrics(keep.run_iteration(1))
    assert after["iteration"] == 1 and before["iteration"] == 0
    stats = keep.worker.stats()
    deadline = time.time() + 10
    while "dying" in stats["adapters"] and time.time() < deadline:
        time.sleep(0.2)
        stats = keep.worker.stats()
    assert stats["adapters"] == ["keep"]
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)
    assert not Path(address).exists() and not key_path(address).exists()


def _rollout_forever(address, out):
    torch.set_num_threads(1)
    exp = Experiment(_cfg(Path(out).parent, Path(out).name), worker=address, name="dying")
    while True:
        exp.rollout(0)


def test_killed_worker_is_a_clear_error_and_a_new_one_resumes_bit_exactly(tmp_path, worker):
    address, proc = worker()
    cfg = _cfg(tmp_path, "crash", training={**SMALL["training"], "iterations": 3})
    reference = [deterministic_metrics(m) for m in train(replace(cfg, output_dir=str(tmp_path / "ref")))]
    exp = Experiment(cfg, worker=str(address))
    m0 = exp.run_iteration(0)
    exp.save(tmp_path / "crash/ckpt0", m0)
    ro = exp.rollout(1)
    datums = exp.score(ro.groups)
    import threading

    failure = []

    def update():
        try:
            exp.learner.forward_backward(datums * 8, exp.algorithm.loss, exp.loss_cfg)
        except WorkerDiedError as e:
            failure.append(e)

    call = threading.Thread(target=update)
    call.start()
    time.sleep(0.05)  # the request is on its way or being computed
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    call.join(timeout=30)
    assert failure and "forward_backward of experiment 'crash'" in str(failure[0])
    address2, _ = worker()
    exp2 = Experiment(cfg, worker=str(address2))
    exp2.resume(tmp_path / "crash/ckpt0")
    rest = [deterministic_metrics(exp2.run_iteration(i)) for i in (1, 2)]
    assert rest == reference[1:] or all(
        r[k] == pytest.approx(f[k], abs=1e-4) for r, f in zip(rest, reference[1:]) for k in f)


def test_cli_errors_are_one_line(tmp_path):
    import subprocess
    import sys

    import yaml

    bad = subprocess.run([sys.executable, "-m", "tinker_pipelines", "worker", "--model", "nope"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: --model 'nope'")
    assert "Traceback" not in bad.stderr
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({**SMALL, "env": {"path": "arithmetic"}, "output_dir": str(tmp_path / "o")}))
    r = subprocess.run([sys.executable, "-m", "tinker_pipelines", "train", str(cfg), "--worker", str(tmp_path / "no.sock")],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "error: no worker at" in r.stderr and "Traceback" not in r.stderr


def test_an_adapter_recreated_after_its_client_left_trains(tmp_path, worker):
    """A step process per Dagster step: each creates the experiment's adapter anew after the
    previous client's copy was dropped (the last adapter on the worker)."""
    address, _ = worker()
    cfg = _cfg(tmp_path, "again")
    for _ in range(2):
        exp = Experiment(cfg, worker=str(address))
        metrics = exp.run_iteration(0)
        assert metrics["informative_groups"] > 0 and metrics["grad_norm"] > 0
        exp.worker.close()
        deadline = time.time() + 10
        probe = WorkerClient(address)
        while probe.stats()["adapters"] and time.time() < deadline:
            time.sleep(0.1)
        probe.close()
