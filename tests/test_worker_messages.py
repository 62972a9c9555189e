"""The worker's typed messages: exact round trips, a schema-derived version, and bad input
(an unknown op, a message off the schema, another schema, a pickle) refused in one line while
the worker keeps serving everyone else. No pickle crosses the socket on either side."""

import math
import multiprocessing.connection as mpc
import pickle
import struct
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from tinker_pipelines.types import CriticDatum
from tinker_pipelines.training.learner import LearnerConfig
from tinker_pipelines.models import load_model, stop_token_ids
from tinker_pipelines.rollout.samples import Sample
from tinker_pipelines.types import Datum
from tinker_pipelines.worker import WorkerError, messages as M
from tinker_pipelines.worker.client import WorkerClient, sample_call
from tinker_pipelines.worker.engine import Engine, EngineConfig
from tinker_pipelines.worker.server import WorkerServer, key_path

ODD_FLOATS = (0.1, -0.0, 5e-324, 1e308, float("inf"), -float("inf"), float("nan"), 1 / 3)


def _bits(xs) -> list[bytes]:
    return [struct.pack("<d", x) for x in xs]


def test_datums_and_samples_round_trip_exactly():
    d = Datum((0, 2**31 - 1, 7), (1, 2, 3), ODD_FLOATS[:3], ODD_FLOATS[3:6], ODD_FLOATS[5:8], (0, 3, 1),
              (-1.5, 0.0, -2.25))
    c = CriticDatum(*(getattr(d, f.name) for f in fields(Datum)), rewards=ODD_FLOATS[:3],
                    old_values=ODD_FLOATS[2:5], returns=ODD_FLOATS[4:7])
    wire = M.decode_request(M.encode(M.ForwardBackward("a", M.wire_datums([d, c]), "grpo", {"kl_coef": 0.05})))
    back, critic = M.datums_of(wire.datums)
    assert type(back) is Datum and type(critic) is CriticDatum  # PPO's fields cross too
    for name in ("rewards", "old_values", "returns"):
        assert _bits(getattr(critic, name)) == _bits(getattr(c, name)), name
    assert back.input_tokens == d.input_tokens and back.support_sizes == d.support_sizes
    for name in ("weights", "behaviour_logprobs", "advantages", "reference_logprobs"):
        assert _bits(getattr(back, name)) == _bits(getattr(d, name)), name  # bit for bit, NaN and -0.0 too
    s = Sample((5, 6, 2), ODD_FLOATS[:3], "stop", "ab", (3, 1, 40))
    reply = M.decode_reply(M.Op.SAMPLE, M.encode(M.SampleReply([s], b"\x00\xffstate")))
    assert reply.samples == [s] and _bits(reply.samples[0].logprobs) == _bits(s.logprobs)
    assert reply.generator_state == b"\x00\xffstate"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.uint8])
@pytest.mark.parametrize("shape", [(3, 5), (), (0, 4)])
def test_tensors_round_trip_bit_exactly(dtype, shape):
    t = (torch.randn(shape) * 1e3).to(dtype)
    if t.numel() and dtype.is_floating_point:
        t.view(-1)[0] = float("nan")
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(M.Tensor.from_torch(t)), type=M.Tensor).to_torch()
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def test_a_datum_subclass_the_wire_does_not_know_is_refused_not_truncated():
    @dataclass(frozen=True)
    class Tagged(Datum):
        tag: str = "x"

    with pytest.raises(TypeError, match="a worker takes Datum or CriticDatum, not Tagged"):
        M.wire_datums([Tagged((1,), (2,), (1.0,))])


def test_a_tensor_whose_bytes_do_not_fit_its_shape_is_refused():
    bad = msgspec.msgpack.encode({"dtype": "bfloat16", "shape": [3], "data": b"\x00" * 5})
    with pytest.raises(msgspec.ValidationError, match="has 5 bytes, shape \\[3\\] of bfloat16 needs 6"):
        msgspec.msgpack.decode(bad, type=M.Tensor)
    with pytest.raises(msgspec.ValidationError, match="not a torch dtype"):
        msgspec.msgpack.decode(msgspec.msgpack.encode({"dtype": "Tensor", "shape": [], "data": b""}), type=M.Tensor)


def test_every_op_has_one_request_and_one_reply_and_the_schema_names_its_version():
    assert set(M.REQUESTS) == set(M.REPLIES) == set(M.Op)
    assert all(cls.__struct_config__.tag == op.value for t in (M.REQUESTS, M.REPLIES) for op, cls in t.items())
    assert msgspec.msgpack.decode(M.encode(M.OptimStep("a"))) == {"op": "optim_step", "adapter": "a"}
    assert len(M.SCHEMA) == 12 and int(M.SCHEMA, 16) >= 0
    assert M.schema_version([*M.REQUESTS.values(), *M.REPLIES.values(), M.Error]) == M.SCHEMA

    def create(seed_type: type, doc: str = "") -> type:
        class Create(M.Request, frozen=True, tag="create"):  # as `messages.Create`, but for `seed`'s type
            name: str
            learner: dict[str, Any]
            seed: seed_type  # type: ignore[valid-type]
            base_name: str = ""
            algorithm: str = ""
            claim: str | None = None

        Create.__doc__ = doc
        return Create

    def version(create):
        return M.schema_version([create if op == M.Op.CREATE else cls for op, cls in M.REQUESTS.items()])

    assert version(create(int)) == version(M.Create)
    assert version(create(int, "a reworded docstring is not a new protocol")) == version(M.Create)
    assert version(create(str)) != version(M.Create)


def test_bad_messages_get_one_line_naming_the_op_and_the_field():
    def refused(payload: dict) -> str:
        with pytest.raises(M.BadMessage) as err:
            M.decode_request(msgspec.msgpack.encode(payload))
        assert "\n" not in str(err.value)
        return str(err.value)

    assert refused({"op": "train_everything"}).startswith("unknown op 'train_everything' (this worker serves hello,")
    msg = refused({"op": "create", "name": "x", "learner": {}, "seed": "one"})
    assert msg.startswith("op 'create'") and "`$.seed`" in msg
    msg = refused({"op": "forward_backward", "adapter": "a", "algorithm": "grpo",
                   "datums": [{"input_tokens": [1, 2], "target_tokens": [2], "weights": [1.0, 1.0]}]})
    assert "Datum.target_tokens has length 1, expected 2" in msg and "`$.datums[0]`" in msg
    assert "missing required field `adapter`" in refused({"op": "optim_step"})


class _Marker:
    """Unpickling this writes a file: a payload that would run code under pickle."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (self.path, "code ran"))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model, tok = load_model("tiny", seed=0)
    model.requires_grad_(False)
    engine = Engine(model, tok.pad_token_id, stop_token_ids(tok), "tiny(seed=0)", EngineConfig(), tokenizer=tok)
    s = WorkerServer(engine, tmp_path_factory.mktemp("w") / "w.sock")
    s.start()
    yield s
    s.stop()


def _raw(server):
    return mpc.Client(server.address, family="AF_UNIX", authkey=key_path(server.address).read_bytes())


def _say(conn, message: bytes, op: M.Op) -> M.Reply:
    conn.send_bytes(message)
    return M.decode_reply(op, conn.recv_bytes())


def test_bad_input_is_refused_in_one_line_and_everyone_else_is_served(server):
    good = WorkerClient(server.address)
    good.create("good", asdict(LearnerConfig(mode="lora")), seed=1)
    before = good.sample(sample_call("good", [[5, 6, 7]], 4, 1.0, torch.Generator().manual_seed(3))).samples
    bad = _raw(server)
    assert isinstance(_say(bad, M.encode(M.Hello(M.SCHEMA)), M.Op.HELLO), M.HelloReply)
    for payload, text in ((msgspec.msgpack.encode({"op": "explode"}), "unknown op 'explode'"),
                          (msgspec.msgpack.encode({"op": "create", "name": "x", "learner": {}, "seed": [1]}),
                           "op 'create': Expected `int`, got `array` - at `$.seed`"),
                          (msgspec.msgpack.encode({"op": "optim_step", "adapter": 7}), "op 'optim_step'")):
        reply = _say(bad, payload, M.Op.STATS)
        assert isinstance(reply, M.Error) and reply.error == "ProtocolError" and text in reply.message, reply
        assert "\n" not in reply.message
    # the bad client may go on, and the good one gets exactly what it got before
    assert isinstance(_say(bad, M.encode(M.Stats()), M.Op.STATS), M.StatsReply)
    again = good.sample(sample_call("good", [[5, 6, 7]], 4, 1.0, torch.Generator().manual_seed(3))).samples
    assert again == before and "good" in good.stats()["adapters"]
    bad.close(), good.close()


def test_a_client_of_another_schema_is_told_both_versions(server):
    conn = _raw(server)
    reply = _say(conn, M.encode(M.Hello("abcdef012345")), M.Op.HELLO)
    assert isinstance(reply, M.Error) and reply.message == (
        f"client speaks worker protocol schema 'abcdef012345', this worker speaks {M.SCHEMA!r} "
        "(run client and worker from the same tinker-pipelines version)")
    conn.close()
    WorkerClient(server.address).close()  # and the worker still greets its own


def test_a_pickle_that_would_run_code_runs_nothing(server, tmp_path):
    marker = tmp_path / "ran"
    payload = pickle.dumps(_Marker(marker))
    pickle.loads(payload)  # the payload does run code under pickle...
    assert marker.read_text() == "code ran"
    marker.unlink()
    first = _raw(server)  # ...as a first message
    reply = _say(first, payload, M.Op.HELLO)
    assert isinstance(reply, M.Error) and "first message must be a hello" in reply.message
    later = _raw(server)  # ...and as a request after a good hello
    assert isinstance(_say(later, M.encode(M.Hello(M.SCHEMA)), M.Op.HELLO), M.HelloReply)
    reply = _say(later, payload, M.Op.STATS)
    assert isinstance(reply, M.Error) and reply.error == "ProtocolError"
    assert not marker.exists()
    assert isinstance(_say(later, M.encode(M.Stats()), M.Op.STATS), M.StatsReply)  # still serving
    later.close()


def test_no_pickle_crosses_the_socket_in_a_full_session(server, tmp_path, monkeypatch):
    """Both ends live in this process: with `Connection.send` / `recv` (the pickling calls)
    made to fail, a whole session still runs, tensors included."""

    def pickling(*_a, **_k):
        raise AssertionError("a pickle crossed the socket")

    monkeypatch.setattr(mpc.Connection, "send", pickling)
    monkeypatch.setattr(mpc.Connection, "recv", pickling)
    c = WorkerClient(server.address)
    assert c.hello.schema == M.SCHEMA and c.info["device"] == "cpu"
    c.create("p", asdict(LearnerConfig(mode="lora", learning_rate=1e-2)), seed=2)
    gen = torch.Generator().manual_seed(5)
    out = c.sample(sample_call("p", [[5, 6, 7], [8, 9]], 5, 1.0, gen))
    ids = [5, 6, 7, *out.samples[0].tokens]
    d = Datum(tuple(ids[:-1]), tuple(ids[1:]), (0.0, 0.0) + (1.0,) * (len(ids) - 3),
              (0.0, 0.0, *out.samples[0].logprobs), (1.0,) * (len(ids) - 1))
    metrics = c.forward_backward("p", [d], "grpo", {})
    assert math.isfinite(metrics["loss"]) and c.optim_step("p")["grad_norm"] > 0
    assert len(c.compute_logprobs("p", [d])[0]) == len(d.input_tokens)
    rng = torch.Generator().manual_seed(9).get_state()
    record = c.save_state("p", str(tmp_path / "ck"), {"note": "x"}, extra_rng={"mine": rng})
    assert record["note"] == "x" and record["learner_steps"] == 1
    assert torch.equal(torch.load(tmp_path / "ck/rng.pt", weights_only=True)["mine"], rng)
    assert c.verify_checkpoint("p", str(tmp_path / "ck"), ids)["differing"] == []
    assert c.load_state("p", str(tmp_path / "ck"))["content_hash"] == record["content_hash"]
    with pytest.raises(WorkerError, match="unknown adapter 'nope'"):
        c.optim_step("nope")
    c.close()
