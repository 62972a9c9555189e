"""The Tinker service's top-k and target logprobs (`topk_prompt_logprobs`, `topk_sample_logprobs`,
`prompt_logprobs_last_n`, `target_prompt_logprobs`) through the pinned `tinker` SDK, unmodified,
on loopback, checked against the tiny model's own logprobs computed here in-process.

One service (tiny base, fp32, CPU worker) is shared by the module's tests, as in
tests/test_tinker_service.py.
"""

from __future__ import annotations

import math
import os
import time
from concurrent.futures import Future

import numpy as np
import pytest
import torch

import tinker
from tinker import types

from tinker_pipelines.models import load_model
from tinker_pipelines.serving.tinker.launch import start_service
from tinker_pipelines.serving.tinker.runtime import LoraShape
from tinker_pipelines.serving.tinker.wire import MAX_TOPK_LOGPROBS

pytestmark = pytest.mark.e2e  # a worker process and an HTTP service

KEY = "tml-test-key"
THREADS = str(torch.get_num_threads())
PROMPT = [5, 9, 13, 21, 34, 55, 3, 8]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    handle = start_service("tiny", home=tmp_path_factory.mktemp("tinker"), api_key=KEY, device="cpu",
                           dtype="float32", gap_timeout_s=3.0, worker_args=["--threads", THREADS])
    yield handle
    handle.stop()


@pytest.fixture
def client(service):
    sc = tinker.ServiceClient(base_url=service.url, api_key=KEY)
    yield sc
    sc.close("success").result()


@pytest.fixture(scope="module")
def base_model():
    torch.set_num_threads(int(THREADS))
    model, _ = load_model("tiny", seed=0, dtype="float32", device="cpu")
    return model.eval()


@torch.no_grad()
def _logprobs(model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V]: row i is the model's next-token distribution at prompt position i + 1."""
    logits = model(input_ids=torch.tensor([prompt[:-1]])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def _topk(lp_TV: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    vals, ids = lp_TV.topk(k, dim=-1)
    return [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]


def _assert_rows_equal(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert [t for t, _ in g] == [t for t, _ in w]
        assert [x for _, x in g] == pytest.approx([x for _, x in w], abs=1e-5)


def _sample(sc, prompt=PROMPT, n=1, **kw):
    params = kw.pop("params", types.SamplingParams(max_tokens=3, temperature=1.0))
    return sc.sample(types.ModelInput.from_ints(prompt), n, params, **kw)


def test_topk_prompt_logprobs_equal_a_direct_topk_of_the_base_and_of_an_adapter(client, base_model):
    sc = client.create_sampling_client(base_model="tiny").result()
    got = _sample(sc, n=3, include_prompt_logprobs=True, topk_prompt_logprobs=5).result()
    want = _logprobs(base_model, PROMPT)
    assert got.topk_prompt_logprobs[0] is None and got.prompt_logprobs[0] is None  # no prefix
    _assert_rows_equal(got.topk_prompt_logprobs[1:], _topk(want, 5))
    own = want.gather(1, torch.tensor(PROMPT[1:])[:, None]).squeeze(1).tolist()
    assert got.prompt_logprobs[1:] == pytest.approx(own, abs=1e-5)
    assert len(got.sequences) == 3 and all(s.topk_logprobs is None for s in got.sequences)

    # an adapter one SFT step away from the base: the service's and an in-process learner's agree
    from tinker_pipelines.training.learner import Learner, LearnerConfig

    tc = client.create_lora_training_client("tiny", rank=4, seed=3).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints(PROMPT[:-1]), loss_fn_inputs={
        "target_tokens": types.TensorData.from_numpy(np.asarray(PROMPT[1:], np.int64)),
        "weights": types.TensorData.from_numpy(np.ones(len(PROMPT) - 1, np.float32))})
    adam = types.AdamParams(learning_rate=5e-2)
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(adam).result()
    adapted = tc.save_weights_and_get_sampling_client().result()

    model, tok = load_model("tiny", seed=0, dtype="float32", device="cpu")
    shape = LoraShape(4, 3)
    cfg = {k: tuple(v) if isinstance(v, list) else v for k, v in shape.learner().items()}
    local = Learner(model, LearnerConfig(**cfg), tok.pad_token_id, base_name="tiny", adapter_name="local",
                    init_seed=shape.seed)
    from tinker_pipelines.algorithms.tinker_losses import datum_from_tinker, tinker_loss

    local.tinker_forward_backward([datum_from_tinker(PROMPT[:-1], {k: v.to_torch() for k, v in
                                                                  datum.loss_fn_inputs.items()})],
                                  tinker_loss("cross_entropy"))
    local.optim_step(adam.model_dump())
    want_adapter = _logprobs(local.model.eval(), PROMPT)
    assert not torch.allclose(want_adapter, want, atol=1e-3)  # the step moved it
    got = _sample(adapted, topk_prompt_logprobs=MAX_TOPK_LOGPROBS).result()
    assert got.prompt_logprobs is None  # top-k alone was asked
    _assert_rows_equal(got.topk_prompt_logprobs[1:], _topk(want_adapter, MAX_TOPK_LOGPROBS))


def test_topk_sample_logprobs_agree_with_the_sampled_tokens(client):
    sc = client.create_sampling_client(base_model="tiny").result()
    got = _sample(sc, n=4, params=types.SamplingParams(max_tokens=6, temperature=0.7), topk_sample_logprobs=4).result()
    for s in got.sequences:
        assert len(s.topk_logprobs) == len(s.tokens) == len(s.logprobs)
        for token, lp, row in zip(s.tokens, s.logprobs, s.topk_logprobs):
            values = [x for _, x in row]
            assert len(row) == 4 and values == sorted(values, reverse=True)
            ids = [t for t, _ in row]
            if token in ids:  # the sampled token's logprob is the one its row reports
                assert values[ids.index(token)] == pytest.approx(lp, abs=1e-6)
            else:
                assert lp <= values[-1] + 1e-6
    # truncated sampling: only tokens with mass are listed, and their mass is the whole distribution
    got = _sample(sc, n=2, params=types.SamplingParams(max_tokens=4, temperature=1.0, top_k=2),
                  topk_sample_logprobs=5).result()
    for s in got.sequences:
        for token, lp, row in zip(s.tokens, s.logprobs, s.topk_logprobs):
            assert len(row) == 2 and token in [t for t, _ in row]
            assert sum(math.exp(x) for _, x in row) == pytest.approx(1.0, abs=1e-5)
            assert dict(row)[token] == pytest.approx(lp, abs=1e-6)


def test_prompt_logprobs_last_n_scores_only_the_last_n(client, base_model):
    sc = client.create_sampling_client(base_model="tiny").result()
    full = _sample(sc, include_prompt_logprobs=True, topk_prompt_logprobs=3).result()
    got = _sample(sc, include_prompt_logprobs=True, topk_prompt_logprobs=3, prompt_logprobs_last_n=3).result()
    n = len(PROMPT)
    assert got.prompt_logprobs[:n - 3] == [None] * (n - 3)
    assert got.prompt_logprobs[n - 3:] == pytest.approx(full.prompt_logprobs[n - 3:], abs=1e-6)
    assert got.topk_prompt_logprobs[:n - 3] == [None] * (n - 3)
    _assert_rows_equal(got.topk_prompt_logprobs[n - 3:], full.topk_prompt_logprobs[n - 3:])
    whole = _sample(sc, include_prompt_logprobs=True, prompt_logprobs_last_n=n - 1).result()
    assert whole.prompt_logprobs[0] is None and None not in whole.prompt_logprobs[1:]
    with pytest.raises(tinker.BadRequestError, match="prompt_logprobs_last_n must be 1..len"):
        _sample(sc, include_prompt_logprobs=True, prompt_logprobs_last_n=n).result()


def test_target_prompt_logprobs_dense_and_sparse(client, base_model):
    sc = client.create_sampling_client(base_model="tiny").result()
    want = _logprobs(base_model, PROMPT)
    ids = torch.full((len(PROMPT) - 1, 3), -1, dtype=torch.int64)
    ids[0, :2] = torch.tensor([7, 11])
    ids[4, 0], ids[6, 2] = 40, 2
    cells = (ids != -1)
    expect = torch.where(cells, want.gather(1, ids.clamp(min=0)), torch.zeros(()))
    dense = _sample(sc, target_prompt_logprobs=types.TensorData.from_torch(ids)).result()
    assert dense.prompt_logprobs is None and dense.topk_prompt_logprobs is None
    out = dense.target_prompt_logprobs.to_torch()
    assert out.shape == ids.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=0)
    assert (out[~cells] == 0).all()
    sparse_in = types.TensorData.from_torch_sparse(ids, pad_value=-1)
    assert sparse_in.sparse_crow_indices is not None  # the sparse layout is what travels
    sparse = _sample(sc, target_prompt_logprobs=sparse_in).result().target_prompt_logprobs
    assert sparse.sparse_crow_indices == sparse_in.sparse_crow_indices
    assert sparse.sparse_col_indices == sparse_in.sparse_col_indices
    torch.testing.assert_close(sparse.to_torch(), expect, atol=1e-5, rtol=0)

    short = types.TensorData.from_torch(ids[:-1])
    with pytest.raises(tinker.BadRequestError, match="target_prompt_logprobs has 6 rows"):
        _sample(sc, target_prompt_logprobs=short).result()
    with pytest.raises(tinker.BadRequestError, match="names no token id"):
        _sample(sc, target_prompt_logprobs=types.TensorData.from_torch(torch.full_like(ids, -1))).result()
    many = torch.arange(3 * (len(PROMPT) - 1), dtype=torch.int64).reshape(-1, 3)
    with pytest.raises(tinker.BadRequestError, match="distinct token ids"):
        _sample(sc, target_prompt_logprobs=types.TensorData.from_torch(many)).result()


@pytest.mark.parametrize("field,k", [("topk_prompt_logprobs", MAX_TOPK_LOGPROBS + 1), ("topk_prompt_logprobs", -1),
                                     ("topk_sample_logprobs", MAX_TOPK_LOGPROBS + 1), ("topk_sample_logprobs", -2)])
def test_a_top_k_out_of_bounds_is_a_400_the_sdk_does_not_retry(client, field, k):
    sc = client.create_sampling_client(base_model="tiny").result()
    t0 = time.monotonic()
    with pytest.raises(tinker.BadRequestError, match=f"{field} must be an integer 0..{MAX_TOPK_LOGPROBS}") as e:
        _sample(sc, **{field: k}).result()
    assert time.monotonic() - t0 < 3.0  # no retries with backoff
    assert e.value.status_code == 400
    assert _sample(sc).result().sequences  # the sampler still serves


def test_a_merged_batch_gives_each_call_what_it_asked(client, service, base_model):
    """Three concurrent calls of one sampler with the same settings go to the worker as one
    call (`num_samples` is part of a merge's key): one asks top-k of its prompt and of its
    samples, one top-2 of its (shorter) prompt and top-1 of its samples, one nothing."""
    svc = service._uvicorn.config.app.state.tinker
    sc = client.create_sampling_client(base_model="tiny").result()
    long, short, other = PROMPT, [4, 7, 12, 30], [6, 16, 26]
    before = svc.batcher.calls
    futures: list[Future] = [
        _sample(sc, short, n=2, include_prompt_logprobs=True, topk_prompt_logprobs=4, topk_sample_logprobs=3),
        _sample(sc, long, n=2),
        _sample(sc, other, n=2, topk_prompt_logprobs=2, topk_sample_logprobs=1)]
    a, b, c = [f.result() for f in futures]
    assert svc.batcher.calls - before == 1  # merged: one worker call

    _assert_rows_equal(a.topk_prompt_logprobs[1:], _topk(_logprobs(base_model, short), 4))
    assert len(a.sequences) == 2 and all(len(r) == 3 for s in a.sequences for r in s.topk_logprobs)
    assert b.prompt_logprobs is None and b.topk_prompt_logprobs is None and b.target_prompt_logprobs is None
    assert len(b.sequences) == 2 and all(s.topk_logprobs is None for s in b.sequences)
    assert c.prompt_logprobs is None and len(c.sequences) == 2
    _assert_rows_equal(c.topk_prompt_logprobs[1:], _topk(_logprobs(base_model, other), 2))
    for s in c.sequences:
        assert [len(r) for r in s.topk_logprobs] == [1] * len(s.tokens)
        for token, lp, (top,) in zip(s.tokens, s.logprobs, s.topk_logprobs):
            assert top[1] >= lp - 1e-6 and (top[0] != token or top[1] == pytest.approx(lp, abs=1e-6))


def test_prompts_scored_in_groups_and_chunks_equal_each_alone(base_model, monkeypatch):
    """The worker's scoring (`rollout.prompt_scores`) over prompts of several lengths, left-padded
    into groups and log-softmaxed a few positions at a time, equals each prompt's own forward."""
    from tinker_pipelines.rollout import prompt_scores as P

    V = base_model.get_input_embeddings().num_embeddings
    monkeypatch.setattr(P, "FORWARD_LOGITS", 12 * V)  # 12 positions of logits per forward: some prompts share one
    monkeypatch.setattr(P, "CHUNK_ELEMENTS", 2 * V)  # 2 positions per log-softmax
    prompts = [PROMPT, [4, 7, 12, 30], [6], [3, 5, 7, 9, 11, 13], [8, 9]]
    scoring = [P.PromptScoring(logprobs=True, topk=3), P.PromptScoring(topk=2, last_n=2),
               P.PromptScoring(logprobs=True, topk=3), P.PromptScoring(logprobs=True, last_n=1,
                                                                        target_positions=(1, 4), target_ids=(2, 50)),
               P.PromptScoring()]
    got = P.score_prompts(base_model, prompts, scoring, pad_token_id=0)
    for p, s, g in zip(prompts, scoring, got):
        first = s.first(len(p))
        assert g.first == first
        if len(p) < 2 or s == P.PromptScoring():
            assert g.logprobs == () and g.topk == () and g.targets == ()
            continue
        want = _logprobs(base_model, p)
        own = want.gather(1, torch.tensor(p[1:])[:, None]).squeeze(1)[first - 1:].tolist()
        assert list(g.logprobs) == (pytest.approx(own, abs=1e-5) if s.logprobs else [])
        if s.topk:
            _assert_rows_equal([list(r) for r in g.topk], _topk(want[first - 1:], s.topk))
        assert list(g.targets) == pytest.approx([want[q - 1, t].item() for q, t in zip(s.target_positions,
                                                                                         s.target_ids)], abs=1e-5)
