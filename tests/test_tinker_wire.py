"""The service's protobuf codec and its call ordering, against the SDK's own encoders."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import zstandard
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_proto_response

from tinker_pipelines.serving.tinker import wire
from tinker_pipelines.serving.tinker.futures import Failed, Futures, SeqQueue


def _request(data, loss="cross_entropy", config=None) -> bytes:
    req = types.ForwardBackwardRequest(model_id="s:train:0", seq_id=1, forward_backward_input=types.ForwardBackwardInput(
        data=data, loss_fn=loss, loss_fn_config=config))
    return forward_backward_request_to_proto(req).SerializeToString()


def _datum(n=4, **inputs):
    tokens = list(range(5, 5 + n))
    base = {"target_tokens": np.arange(6, 6 + n, dtype=np.int64), "weights": np.ones(n, np.float32)}
    base.update(inputs)
    return types.Datum(model_input=types.ModelInput.from_ints(tokens),
                       loss_fn_inputs={k: types.TensorData.from_numpy(v) for k, v in base.items() if v is not None})


def test_decodes_what_the_sdk_encodes_with_zstd():
    body = _request([_datum(4), _datum(2)])
    packed = zstandard.ZstdCompressor().compress(body)
    call = wire.decode_forward_backward(wire.decompress(packed, "zstd", 1 << 20))
    assert (call.model_id, call.seq_id, call.loss.name, call.forward_only) == ("s:train:0", 1, "cross_entropy", False)
    assert [d.tokens for d in call.data] == [[5, 6, 7, 8], [5, 6]]
    assert call.data[0].inputs["target_tokens"].tolist() == [6, 7, 8, 9]


@pytest.mark.parametrize("datum,loss,config,field", [
    (_datum(4, weights=None), "cross_entropy", None, "data[0].loss_fn_inputs.weights"),
    (_datum(4, weights=np.ones(3, np.float32)), "cross_entropy", None, "data[0].loss_fn_inputs.weights"),
    (_datum(4, weights=np.ones(4, np.int64)), "cross_entropy", None, "data[0].loss_fn_inputs.weights"),
    (_datum(4), "importance_sampling", None, "data[0].loss_fn_inputs.logprobs"),
    (_datum(4), "stable_reinforce", None, "loss_fn"),
    (_datum(4, weights=None, logprobs=np.zeros(4, np.float32), advantages=np.zeros(4, np.float32)), "dro", None,
     "loss_fn_config.beta"),
    (_datum(4), "cross_entropy", {"beta": 1.0}, "loss_fn_config.beta"),
])
def test_bad_datums_name_their_field(datum, loss, config, field):
    with pytest.raises(wire.WireError) as e:
        wire.decode_forward_backward(_request([datum], loss, config))
    assert e.value.field == field, str(e.value)


def test_bodies_that_are_not_requests_or_too_large_are_refused():
    with pytest.raises(wire.WireError, match="not a ForwardBackwardRequest"):
        wire.decode_forward_backward(b"\xff\xff\xff")
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (1 << 20))
    with pytest.raises(wire.BodyTooLarge, match="more than this service's bound of 1000 bytes") as e:
        wire.decompress(bomb, "zstd", 1000)
    assert e.value.status == 413
    # the SDK's frames declare their content size, which `decompress(max_output_size=)` then ignores:
    # a 1 GiB frame must be refused after reading past the bound, not inflated first
    big = zstandard.ZstdCompressor(level=1).compress(b"\0" * (1 << 30))
    assert zstandard.get_frame_parameters(big).content_size == 1 << 30
    started = time.perf_counter()
    with pytest.raises(wire.BodyTooLarge):
        wire.decompress(big, "zstd", 1 << 20)
    assert time.perf_counter() - started < 2.0
    assert wire.decompress(zstandard.ZstdCompressor().compress(b"abc" * 300), "zstd", 1000) == b"abc" * 300
    with pytest.raises(wire.WireError, match="Content-Encoding 'br'"):
        wire.decompress(b"x", "br", 1000)


def test_results_decode_in_the_sdk():
    body = wire.encode_forward_backward([[-0.5, -1.0], [-2.0]], {"loss:sum": 3.5})
    out = deserialize_proto_response(body, types.ForwardBackwardOutput)
    assert out.metrics == {"loss:sum": 3.5}
    assert [o["logprobs"].to_numpy().tolist() for o in out.loss_fn_outputs] == [[-0.5, -1.0], [-2.0]]
    with pytest.raises(ValueError, match="one ':'"):
        wire.encode_forward_backward([[0.0]], {"loss": 1.0})
    body = wire.encode_sample([wire.Sequence([4, 2], [-0.1, -0.2], True), wire.Sequence([9], [-1.0], False)],
                              [None, -1.5])
    sr = deserialize_proto_response(body, types.SampleResponse)
    assert [s.stop_reason for s in sr.sequences] == ["stop", "length"]
    assert sr.sequences[0].tokens == [4, 2] and sr.prompt_logprobs == [None, -1.5]


def test_calls_run_in_seq_id_order_and_a_gap_that_never_fills_fails_them():
    async def scenario():
        futures = Futures()
        q = SeqQueue(futures, first=1, gap_timeout_s=0.3)
        ran: list[int] = []

        def job(n):
            async def work():
                ran.append(n)
                return {"n": n}
            return work
        r3, r2 = q.submit(3, job(3)), q.submit(2, job(2))
        await asyncio.sleep(0.05)
        assert ran == []  # 1 has not arrived
        assert q.submit(2, job(2)) == r2  # a re-sent call gets the same future
        r1 = q.submit(1, job(1))
        results = [await futures.get(r) for r in (r1, r2, r3)]
        assert ran == [1, 2, 3] and [r["n"] for r in results] == [1, 2, 3]
        late = q.submit(2, job(99))
        assert late == r2
        r6 = q.submit(6, job(6))  # 4 and 5 never come
        failed = await asyncio.wait_for(futures.get(r6), 2)
        assert isinstance(failed, Failed) and "seq_id 4 never arrived" in failed.error
        r7 = q.submit(7, job(7))  # the queue goes on after the gap
        assert (await futures.get(r7)) == {"n": 7}
        stale = await futures.get(q.submit(5, job(5)))
        assert isinstance(stale, Failed) and "already ran" in stale.error
    asyncio.run(scenario())


def test_a_long_run_remembers_only_its_latest_seq_ids():
    from tinker_pipelines.serving.tinker.futures import REMEMBERED_SEQ_IDS

    async def scenario():
        futures = Futures()
        q = SeqQueue(futures, first=1)

        async def ok():
            return {}
        rids = [q.submit(i, ok) for i in range(1, 3 * REMEMBERED_SEQ_IDS)]
        while q.next < 3 * REMEMBERED_SEQ_IDS:
            await asyncio.sleep(0.01)
        assert len(q._ids) <= 2 * REMEMBERED_SEQ_IDS + 1
        assert q.submit(3 * REMEMBERED_SEQ_IDS - 1, ok) == rids[-1]  # a recent re-send: the same future
        return len(set(rids))
    assert asyncio.run(scenario()) == 3 * REMEMBERED_SEQ_IDS - 1
