"""Tinker's primitives over a real worker process: forward_backward with per-datum logprobs,
forward-only, AdamParams, weights-only loads, shared passes, and errors that name their field."""

import math
import os
import signal
import threading
from dataclasses import asdict

import pytest
import torch

from tinker_pipelines.algorithms.tinker_losses import TinkerLossError, datum_from_tinker, tinker_loss
from tinker_pipelines.models import load_model
from tinker_pipelines.training.learner import Learner, LearnerConfig
from tinker_pipelines.worker import WorkerError
from tinker_pipelines.worker.client import WorkerClient, start_worker

CFG = LearnerConfig(mode="lora", micro_batch_size=2, lora_rank=4, learning_rate=1e-3)
ADAM = {"learning_rate": 5e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 1.0}
TOKENS = [[5, 9, 12, 7, 30, 31], [5, 9, 40, 41, 42, 8, 17], [6, 10, 11, 13]]


def ce(tokens=TOKENS, scale=1.0):
    return [datum_from_tinker(t[:-1], {"target_tokens": t[1:], "weights": [0.0] + [scale] * (len(t) - 2)})
            for t in tokens]


def rl(tokens=TOKENS):
    g = torch.Generator().manual_seed(4)
    return [datum_from_tinker(t[:-1], {"target_tokens": torch.tensor(t[1:]),
                                       "logprobs": -torch.rand(len(t) - 1, generator=g) * 3,
                                       "advantages": torch.randn(len(t) - 1, generator=g)}) for t in tokens]


def _worker(tmp_path_factory, dtype):
    d = tmp_path_factory.mktemp("tw")
    proc = start_worker("tiny", d / "w.sock", device="cpu", dtype=dtype, log=d / "log",
                        extra=["--threads", str(torch.get_num_threads()), "--window-ms", "1000"])
    yield d / "w.sock"
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def address(tmp_path_factory):
    yield from _worker(tmp_path_factory, "float32")


@pytest.fixture(scope="module")
def address_bf16(tmp_path_factory):
    yield from _worker(tmp_path_factory, "bfloat16")


def local(seed, dtype="float32"):
    model, tok = load_model("tiny", seed=0, dtype=dtype)
    return Learner(model, CFG, tok.pad_token_id, adapter_name=f"local{seed}", init_seed=seed)


def steps(run, datums, loss, n=2):
    """n rounds of forward_backward then optim_step(ADAM) through `run` (a learner or a client's
    adapter); each round's logprobs, metrics and step metrics."""
    return [(*run.tinker_forward_backward(datums, loss), run.optim_step(ADAM)) for _ in range(n)]


class Remote:
    """One client's adapter, with the learner's method names."""

    def __init__(self, address, name, seed):
        self.client, self.name = WorkerClient(address), name
        self.client.create(name, asdict(CFG), seed)

    def tinker_forward_backward(self, datums, loss, forward_only=False):
        return self.client.tinker_forward_backward(self.name, datums, loss.name, dict(loss.config), forward_only)

    def optim_step(self, adam):
        return self.client.optim_step(self.name, adam)


def test_tinker_steps_on_a_worker_equal_the_in_process_learner(address):
    remote = Remote(address, "solo", 11)
    datums, loss = ce(), tinker_loss("cross_entropy")
    want = steps(local(11), datums, loss)
    got = steps(remote, datums, loss)
    assert got == want  # logprobs, loss:sum and grad_norm, float for float
    assert set(got[0][1]) == {"loss:sum"} and got[1][1]["loss:sum"] < got[0][1]["loss:sum"]
    assert [len(x) for x in got[0][0]] == [len(d.input_tokens) for d in datums]
    # forward-only: the forward's logprobs and loss, and no gradient left behind for the next step
    logprobs, metrics = remote.tinker_forward_backward(datums, loss, forward_only=True)
    assert logprobs == remote.client.compute_logprobs("solo", datums)
    assert remote.optim_step({**ADAM, "learning_rate": 0.0})["grad_norm"] == 0.0
    remote.client.close()


def test_two_adapters_tinker_calls_in_one_cycle_equal_each_alone(address):
    a, b = Remote(address, "a", 21), Remote(address, "b", 22)
    work = [(a, ce(), tinker_loss("cross_entropy")), (b, rl(), tinker_loss("ppo", {"clip_high_threshold": 1.1}))]
    want = [steps(local(21), *work[0][1:]), steps(local(22), *work[1][1:])]
    before = a.client.stats()["shared_passes"]
    got: list = [None, None]

    def run(k):
        r, datums, loss = work[k]
        got[k] = steps(r, datums, loss)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == want
    assert a.client.stats()["shared_passes"] >= before + 2  # both rounds' calls shared their cycle
    a.client.close()
    b.client.close()


def test_weights_only_load_starts_a_fresh_optimizer(address, tmp_path):
    remote = Remote(address, "ck", 31)
    datums, loss = ce(), tinker_loss("cross_entropy")
    steps(remote, datums, loss)
    remote.client.save_state("ck", str(tmp_path / "ck"))
    steps(remote, datums, loss, 1)
    remote.client.load_state("ck", str(tmp_path / "ck"), optimizer=False)
    after_weights_only = steps(remote, datums, loss, 1)
    remote.client.load_state("ck", str(tmp_path / "ck"))
    after_full = steps(remote, datums, loss, 1)
    lr = local(31)
    lr.load_state(tmp_path / "ck", optimizer=False)
    assert after_weights_only == steps(lr, datums, loss, 1)
    assert after_weights_only[0][:2] == after_full[0][:2]  # the same weights were loaded
    lp = remote.client.compute_logprobs("ck", datums)
    remote.client.load_state("ck", str(tmp_path / "ck"), optimizer=False)
    assert remote.client.compute_logprobs("ck", datums) != lp  # the step after a fresh Adam state differs
    remote.client.close()


def test_bad_tinker_calls_name_their_field_and_the_worker_serves_on(address):
    remote = Remote(address, "bad", 41)
    c = remote.client
    with pytest.raises(TinkerLossError, match="not supported by this service; supported: cross_entropy") as e:
        c.tinker_forward_backward("bad", ce(), "stable_reinforce", {}, False)
    assert e.value.field == "loss_fn"
    with pytest.raises(TinkerLossError, match=r"data\[0\].loss_fn_inputs.logprobs is missing") as e:
        c.tinker_forward_backward("bad", ce(), "ppo", {}, False)
    assert e.value.field == "data[0].loss_fn_inputs.logprobs"
    with pytest.raises(TinkerLossError) as e:
        c.tinker_forward_backward("bad", rl(), "dro", {}, False)
    assert e.value.field == "loss_fn_config.beta"
    with pytest.raises(WorkerError, match=r"datum 1: token id 1000000 in a datum is outside the model's vocabulary"):
        c.tinker_forward_backward("bad", ce([[1, 2, 3], [1, 10**6, 3]]), "cross_entropy", {}, False)
    with pytest.raises(WorkerError, match="datum 0: a datum of 5000 tokens exceeds the model context"):
        c.tinker_forward_backward("bad", ce([[1] * 5001]), "cross_entropy", {}, False)
    with pytest.raises(WorkerError, match=r"adam_params.eps must be positive, got 0.0"):
        c.optim_step("bad", {**ADAM, "eps": 0.0})
    logprobs, metrics = c.tinker_forward_backward("bad", ce(), "cross_entropy", {}, False)  # still serving
    assert len(logprobs) == 3 and metrics["loss:sum"] > 0
    c.close()


def test_bf16_worker_tinker_steps_equal_the_in_process_bf16_learner(address_bf16):
    """A bf16 base: the adapters and their Adam states stay fp32, the logprobs and the loss are
    fp32 computations over bf16 logits; the worker computes what the in-process learner does."""
    a, b = Remote(address_bf16, "a", 51), Remote(address_bf16, "b", 52)
    assert a.client.info["dtype"] == "bfloat16"
    work = [(a, ce(), tinker_loss("cross_entropy")), (b, rl(), tinker_loss("cispo"))]
    got: list = [None, None]

    def run(k):
        r, datums, loss = work[k]
        got[k] = steps(r, datums, loss)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [steps(local(51, "bfloat16"), *work[0][1:]), steps(local(52, "bfloat16"), *work[1][1:])]
    assert all(torch.isfinite(torch.tensor(x)).all() for run in got for lp, _, _ in run for x in lp)
    assert got[0][1][1]["loss:sum"] < got[0][0][1]["loss:sum"]


def test_lora_config_on_a_worker_unembed_decodes_in_the_mixed_batch_and_a_rank_too_large_is_named(address):
    from tinker_pipelines.training.rules import tinker_lora_settings
    from tinker_pipelines.worker.client import sample_call

    c = WorkerClient(address)
    fields, seed = tinker_lora_settings({"rank": 4, "seed": 61})
    c.create("unembed", {**fields, "micro_batch_size": 2}, seed)
    fields, seed = tinker_lora_settings({"rank": 4, "seed": 62, "train_unembed": False})
    c.create("body", {**fields, "micro_batch_size": 2}, seed)
    for name in ("unembed", "body"):  # train both a little, so each adapter changes the function
        c.tinker_forward_backward(name, ce(), "cross_entropy", {}, False)
        c.optim_step(name, ADAM)
    other = WorkerClient(address)  # a second client, so the two sample calls meet in one cycle
    other.create("body2", {**fields, "micro_batch_size": 2}, 63)
    clients = [c, other]
    calls = [sample_call(n, [[5, 9, 12]], 5, 1.0, torch.Generator().manual_seed(k))
             for k, n in enumerate(("unembed", "body2"))]
    before = c.stats()
    together: list = [None, None]

    def run(k):
        together[k] = clients[k].sample(calls[k]).samples

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = c.stats()  # the cycle's one batch decoded both adapters, the unembed one included
    assert (after["mixed_batches"], after["mixed_batch_errors"]) == (before["mixed_batches"] + 1,
                                                                     before["mixed_batch_errors"])
    assert together[0] == c.sample(calls[0]).samples and together[1] == other.sample(calls[1]).samples
    with pytest.raises(WorkerError, match=r"lora_rank 128 \(a Tinker client's lora_config.rank\); this worker hosts "
                                          r"ranks up to 64"):
        c.create("huge", {**tinker_lora_settings({"rank": 128})[0]}, 1)
    c.close()
    other.close()


def _sample(c, adapter, prompts, **kw):
    from tinker_pipelines.worker import messages as M

    args = {"max_new_tokens": 6, "temperature": 1.0, **kw}
    return c.sample(M.SampleCall(adapter, prompts, **args))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tinker_sampling_seed_num_samples_stop_ids_top_k_off(dtype, address, address_bf16):
    addr = address if dtype == "float32" else address_bf16
    c, other = WorkerClient(addr), WorkerClient(addr)
    c.create(f"s{dtype}", asdict(CFG), 71)
    other.create(f"o{dtype}", asdict(CFG), 72)
    name, prompt = f"s{dtype}", [[5, 9, 12, 7]]
    alone = _sample(c, name, prompt, seed=7, num_samples=3)
    assert len(alone.samples) == 3 and alone.generator_state is None and alone.prompt_logprobs is None
    assert len({s.tokens for s in alone.samples}) > 1  # three draws, not one repeated
    got: list = [None, None]

    def run(k):  # the same request again, in one cycle with another client's
        got[k] = (_sample(c, name, prompt, seed=7, num_samples=3) if k == 0 else
                  _sample(other, f"o{dtype}", [[6, 10, 11], [8, 8]], seed=3, max_new_tokens=9))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got[0].samples == alone.samples  # same seed, same tokens, whoever shares the batch
    assert _sample(c, name, prompt, seed=8, num_samples=3).samples != alone.samples
    assert _sample(c, name, prompt, seed=7, num_samples=3, top_k=-1).samples == alone.samples  # -1: off
    greedy = _sample(c, name, prompt, temperature=0.0, max_new_tokens=8).samples[0]
    stop_at = greedy.tokens[2]
    first = greedy.tokens.index(stop_at)
    stopped = _sample(c, name, prompt, temperature=0.0, max_new_tokens=8, stop_token_ids=[stop_at]).samples[0]
    assert stopped.tokens == greedy.tokens[:first + 1] and stopped.stop_reason == "stop"
    with pytest.raises(WorkerError, match=r"stop token id 100000 is outside the model's vocabulary"):
        _sample(c, name, prompt, stop_token_ids=[100000])
    with pytest.raises(WorkerError, match="num_samples must be an integer >= 1"):
        _sample(c, name, prompt, num_samples=0)
    c.close()
    other.close()


def test_prompt_logprobs_base_sampling_and_a_read_only_checkpoint_sampler(address, tmp_path):
    from tinker_pipelines.rollout.sampler import ContextOverflowError
    from tinker_pipelines.rollout.truncation import target_logprobs

    c = WorkerClient(address)
    c.create("pl", asdict(CFG), 81)
    for _ in range(2):
        c.tinker_forward_backward("pl", ce(), "cross_entropy", {}, False)
        c.optim_step("pl", ADAM)
    prompts = [[5, 9, 12, 7, 30], [6]]
    out = _sample(c, "pl", prompts, seed=1, prompt_logprobs=True)
    lp = out.prompt_logprobs
    assert len(lp) == 2 and all(math.isnan(x[0]) for x in lp) and len(lp[0]) == 5 and len(lp[1]) == 1
    d = datum_from_tinker(prompts[0][:-1], {"target_tokens": prompts[0][1:], "weights": [1.0] * 4})
    assert lp[0][1:] == c.compute_logprobs("pl", [d])[0]  # the adapter's, exactly
    # the base without any adapter: anyone may sample it, its prompt logprobs are the bare model's
    base = _sample(c, "", prompts, seed=1, prompt_logprobs=True)
    model, _ = load_model("tiny", seed=0)
    with torch.no_grad():
        ids = torch.tensor([prompts[0]])
        want = target_logprobs(model(input_ids=ids[:, :-1]).logits, ids[:, 1:], 1.0)[0].tolist()
    assert base.prompt_logprobs[0][1:] == pytest.approx(want, abs=1e-5) and base.prompt_logprobs[0][1:] != lp[0][1:]
    assert len(base.samples) == 2 and base.samples != out.samples
    # a saved checkpoint as a read-only adapter samples as the adapter it was saved from
    c.save_state("pl", str(tmp_path / "pl"))
    record = c.create_sampler("ro", tmp_path / "pl")
    assert record["learner"]["lora_rank"] == CFG.lora_rank
    assert _sample(c, "ro", prompts, seed=1, prompt_logprobs=True).samples == out.samples
    with pytest.raises(WorkerError, match="adapter 'ro' is read-only"):
        c.tinker_forward_backward("ro", ce(), "cross_entropy", {}, False)
    with pytest.raises(WorkerError, match="adapter 'ro' is read-only"):
        c.optim_step("ro", ADAM)
    assert c.tinker_forward_backward("ro", ce(), "cross_entropy", {}, True)[0] == \
        c.tinker_forward_backward("pl", ce(), "cross_entropy", {}, True)[0]  # forward-only is fine
    with pytest.raises(ContextOverflowError, match="exceeds the model context"):
        _sample(c, "ro", [[5] * 5000])
    with pytest.raises(WorkerError, match=r"token id 100000 in a prompt is outside the model's vocabulary"):
        _sample(c, "", [[5, 100000]])
    assert len(_sample(c, "ro", prompts, seed=2).samples) == 2  # still serving
    c.close()


def _unembed_adapter(c, name, seed):
    """A Tinker-shaped adapter (attention, MLP and lm_head LoRA), trained one step so that it
    changes what the model samples."""
    from tinker_pipelines.training.rules import tinker_lora_settings

    fields, seed = tinker_lora_settings({"rank": 4, "seed": seed})
    c.create(name, {**fields, "lora_targets": list(fields["lora_targets"]), "micro_batch_size": 2}, seed)
    c.tinker_forward_backward(name, ce(), "cross_entropy", {}, False)
    c.optim_step(name, ADAM)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_copied_adapter_samples_as_its_source_did_and_later_steps_leave_it(dtype, address, address_bf16):
    c = WorkerClient(address if dtype == "float32" else address_bf16)
    src, copy, prompts = f"cs{dtype}", f"cc{dtype}", [[5, 9, 12, 7], [6, 10]]
    _unembed_adapter(c, src, 91)
    before = _sample(c, src, prompts, seed=5, num_samples=2, prompt_logprobs=True)
    forward = c.tinker_forward_backward(src, ce(), "cross_entropy", {}, True)[0]
    assert c.copy_adapter(src, copy) == 1  # the source's optimizer steps
    got = _sample(c, copy, prompts, seed=5, num_samples=2, prompt_logprobs=True)
    assert got.samples == before.samples  # tokens and logprobs, exactly
    assert [x[1:] for x in got.prompt_logprobs] == [x[1:] for x in before.prompt_logprobs]  # (the first is NaN)
    assert c.tinker_forward_backward(copy, ce(), "cross_entropy", {}, True)[0] == forward
    c.tinker_forward_backward(src, ce(), "cross_entropy", {}, False)
    c.optim_step(src, ADAM)
    assert _sample(c, src, prompts, seed=5, num_samples=2).samples != before.samples  # the source moved on
    assert _sample(c, copy, prompts, seed=5, num_samples=2).samples == before.samples  # its copy did not
    with pytest.raises(WorkerError, match=f"adapter '{copy}' is read-only"):
        c.optim_step(copy, ADAM)
    c.close()


def test_copy_adapter_refusals_name_the_adapter_and_the_worker_serves_on(address):
    c = WorkerClient(address)
    _unembed_adapter(c, "crsrc", 92)
    c.copy_adapter("crsrc", "crcopy")
    other = WorkerClient(address)
    other.create("crother", asdict(CFG), 93)
    other.create("crparked", asdict(CFG), 94)
    other.park("crparked", "tag")
    refusals = [(c, "nope", "x1", "unknown adapter 'nope'"),
                (other, "crsrc", "x2", "adapter 'crsrc' belongs to another client"),
                (c, "crsrc", "crcopy", "adapter 'crcopy' already exists"),
                (c, "crsrc", "crother", "adapter 'crother' already exists"),  # another client's
                (c, "crsrc", "crparked", "adapter 'crparked' already exists"),  # parked: refused, not dropped
                (c, "crsrc", "a.b", "adapter name 'a.b' is not allowed")]
    for client, src, name, message in refusals:
        with pytest.raises(WorkerError, match=message) as e:
            client.copy_adapter(src, name)
        assert "\n" not in str(e.value)
    stats = c.stats()
    assert not {"x1", "x2", "a.b"} & set(stats["adapters"]) and "crparked" in stats["parked"]
    assert other.create("crparked", asdict(CFG), 94, claim="tag").claimed
    other.close()
    assert len(_sample(c, "crcopy", [[5, 9]], seed=1).samples) == 1  # still serving
    c.close()


def test_runtime_snapshots_are_in_memory_copies_dropped_past_keep_snapshots(address):
    from tinker_pipelines.serving.tinker.runtime import LoraShape, Runtime

    rt = Runtime(address, keep_snapshots=2)
    rt.close()  # its shared connection is not used here; idle, it would hold every cycle for the batching window
    t = rt.create(LoraShape(rank=4, seed=95), "")
    rt.forward_backward(t, ce(), "cross_entropy", {}, False)
    rt.optim_step(t, ADAM)
    names = [rt.snapshot(t) for _ in range(3)]
    adapters = set(t.conn.stats()["adapters"])
    assert names[0] not in adapters and {t.adapter, *names[1:]} <= adapters and t.snapshots == names[1:]
    assert _sample(t.conn, names[2], [[5, 9, 12]], seed=3).samples == _sample(t.conn, t.adapter, [[5, 9, 12]],
                                                                               seed=3).samples
    t.close()


def test_copy_adapter_refuses_a_full_parameter_experiment_naming_it():
    from tinker_pipelines.models import stop_token_ids
    from tinker_pipelines.worker.engine import Engine, EngineConfig, RequestError

    model, tok = load_model("tiny", seed=0)
    e = Engine(model, tok.pad_token_id, stop_token_ids(tok), "tiny", EngineConfig(exclusive=True))
    e.create(1, "full", {"mode": "full"}, 0, "")
    with pytest.raises(RequestError, match="adapter 'full' trains every parameter"):
        e.copy_adapter(1, "full", "fullcopy")
    assert set(e.hosted) == {"full"}
