"""One client process of the Tinker soak (`benchmarks/tinker_soak.py` starts these; run one alone
only to debug it). It drives the service through the official `tinker` SDK, unmodified, in a loop
of operations drawn from a seeded RNG until a deadline, and writes every call as one JSON line:

    {"ev": "begin", "op": ..., "t": ...}                       before the call (a SIGKILL finds it open)
    {"ev": "call", "op", "start", "end", "outcome", "why", "hung", "error", ...}   after it

`outcome` is `ok`, `expected` (a bad request answered with a 4xx that names its field, or a call
the service failed because its worker was SIGKILLed, which the service's message says) or
`unexpected` (anything else). `hung`: the call's future took more than `HUNG_S` to resolve.

Resuming: the client keeps its last acknowledged `save_state` without a TTL as its resume point
(path, its count of acknowledged optimizer steps, and the logprobs of a fixed probe datum just
before the save). A training client lost with the worker, one ended by `finish`, or one whose
process the soak killed (its successor gets `--resume`) comes back from that point: the loaded
weights must give the same probe logprobs, and the next save's step count (the checkpoint's
`record.json`, read from the service's home on this machine: no API returns a checkpoint's
step count) must equal the client's own. A difference is a lost step.

Imports only the SDK, numpy, httpx and the standard library.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx
import numpy as np

import tinker
from tinker import types

HUNG_S = 60.0
"""A future not resolved this long after its request is hung."""
GIVE_UP_S = 600.0
"""A future still unresolved this long after its request is abandoned with its ServiceClient."""
PROBE = [5, 9, 13, 21, 34, 55, 89, 144]
"""The fixed datum whose forward logprobs fingerprint a training client's weights."""
PROBE_TOLERANCE = 1e-4
"""Largest logprob difference between a save and its reload that is not a lost step (a lost
Adam step at these learning rates moves them by orders of magnitude more)."""
ADAM = types.AdamParams(learning_rate=5e-3)
WORKER_KILLED = "died (signal 9, SIGKILL)"
"""What the service says in every failure it owes to the worker's SIGKILL (`supervisor.WorkerLoss`)."""
WEIGHTS = {"forward_backward": 25, "optim_step": 15, "forward": 8, "save_state": 8, "sampler": 5, "sample": 20,
           "snapshot": 3, "load": 3, "create": 2, "delete": 4, "finish": 2}
"""Relative frequency of each operation."""
MAX_SAMPLERS = 3
"""Path samplers a session keeps using (each holds an adapter until its session ends)."""
KEEP = 4
"""Older saves of each kind (states, sampler weights) a client keeps before deleting the oldest."""


@dataclass(frozen=True)
class Bad:
    """A bad request the service must refuse with a 4xx (or, for work that fails while it runs,
    a failed future of category `user`) whose message names `field`."""

    kind: str
    field: str


@dataclass
class SavePoint:
    path: str
    steps: int | None
    probe: list[float] | None = None
    expires: float | None = None


def one_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:400] if text else ''}"


def classify(err: BaseException | None, bad: Bad | None) -> tuple[str, str | None]:
    """(outcome, why) of a call that raised `err` (None: it succeeded)."""
    if err is None:
        return ("unexpected", f"bad request {bad.kind} succeeded") if bad else ("ok", None)
    text = str(err)
    if WORKER_KILLED in text:
        return "expected", "worker_kill"
    if bad is None:
        return "unexpected", type(err).__name__
    status = getattr(err, "status_code", None)
    user = isinstance(err, tinker.RequestFailedError) and str(err.category).lower().endswith("user")
    if not (user or (isinstance(status, int) and 400 <= status < 500 and status not in (408, 409, 429))):
        return "unexpected", f"bad request {bad.kind}: {type(err).__name__} (status {status}), not a 4xx"
    if bad.field not in text:
        return "unexpected", f"bad request {bad.kind}: the error does not name {bad.field!r}"
    return "expected", f"bad:{bad.kind}"


class Log:
    """JSON lines, each written whole and flushed (a SIGKILL loses none already written)."""

    def __init__(self, path: Path, label: str):
        self.f = open(path, "a", buffering=1)
        self.label = label

    def write(self, **record: Any) -> None:
        self.f.write(json.dumps({"c": self.label, **record}) + "\n")


class Client:
    """The loop of one SDK client (see the module's doc)."""

    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.rng = random.Random(f"{a.seed}/{a.slot}/{a.incarnation}")
        self.log = Log(Path(a.log), f"{a.slot}.{a.incarnation}")
        self.sc: tinker.ServiceClient | None = None
        self.tc: Any = None
        self.steps: int | None = None
        """Acknowledged optimizer steps of `tc` (None: unknown after an unexpected failure)."""
        self.lost = False
        self.resume: SavePoint | None = None
        self.ttl_saves: list[SavePoint] = []
        self.old_saves: list[str] = []
        self.deleted: list[str] = []
        self.sampler_paths: list[str] = []
        self.samplers: list[tuple[str, Any]] = []
        self.base_sampler: Any = None
        self.n = 0
        self.hung = False
        self.extra: dict[str, Any] = {}
        self.inherited = bool(a.resume)
        """Its resume point is the killed predecessor's: its first training client loads it."""
        if a.resume:
            r = json.loads(a.resume)
            self.resume = SavePoint(r["path"], r["steps"], r["probe"])

    # -- calls ----------------------------------------------------------------------------
    def call(self, op: str, fn: Callable[[], Any], bad: Bad | None = None, start: float | None = None,
             ended: Callable[[], float | None] = lambda: None) -> Any:
        """Run `fn` (which resolves its futures with `wait`), log it, and return its value (None
        when it failed). `start`: when its request went out, if before now; `ended`: when its
        future resolved, if known (several in flight are waited for one after another)."""
        start = time.time() if start is None else start
        self.log.write(ev="begin", op=op, t=start)
        self.hung, self.extra = False, {}
        try:
            value, err = fn(), None
        except Exception as e:  # noqa: BLE001 - every failure is classified and logged
            value, err = None, e
        end = ended() or time.time()
        outcome, why = classify(err, bad)
        record = {"ev": "call", "op": op, "start": start, "end": end, "outcome": outcome, "why": why,
                  "hung": self.hung or end - start > HUNG_S, **self.extra}
        if err is not None:
            record["error"] = one_line(err)
        self.log.write(**record)
        if why == "worker_kill":
            self.lost = True
        if outcome == "unexpected" and op == "optim_step":
            self.steps = None  # whether the step was applied is not known
        return value if err is None else None

    def wait(self, fut: Any) -> Any:
        try:
            return fut.result(timeout=HUNG_S)
        except TimeoutError:
            self.hung = True
        try:
            return fut.result(timeout=GIVE_UP_S - HUNG_S)
        except TimeoutError:
            self.sc = None  # abandoned with its session: start a new one
            raise TimeoutError(f"the future was not resolved within {GIVE_UP_S:g} s") from None

    # -- data -----------------------------------------------------------------------------
    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(3, self.a.vocab) for _ in range(n)]

    def datum(self, tokens: list[int]) -> types.Datum:
        return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(np.asarray(tokens[1:], np.int64)),
            "weights": types.TensorData.from_numpy(np.ones(len(tokens) - 1, np.float32))})

    def batch(self) -> list[types.Datum]:
        return [self.datum(self.tokens(self.rng.randint(6, self.a.max_len))) for _ in range(self.rng.randint(1, 4))]

    def name(self, what: str) -> str:
        self.n += 1
        return f"c{self.a.slot}-{self.a.incarnation}-{what}{self.n}"

    # -- the loop ---------------------------------------------------------------------------
    def run(self) -> None:
        self.log.write(ev="start", pid=__import__("os").getpid(), resume=self.resume.path if self.resume else None)
        while time.time() < self.a.until:
            if self.sc is None:
                self.new_session()
            elif self.lost or self.tc is None:
                self.recover()
            elif self.rng.random() < 1.0 / self.a.bad_every:
                self.bad_request()
            else:
                ops = [op for op in WEIGHTS if self.can(op)]
                op = self.rng.choices(ops, [WEIGHTS[o] for o in ops])[0]
                getattr(self, f"op_{op}")()
            time.sleep(self.rng.uniform(0, 2 * self.a.think_s))
        if self.sc is not None:
            self.call("finish", lambda: self.wait(self.sc.close("success")))
        self.log.write(ev="exit")

    def can(self, op: str) -> bool:
        if op == "load":
            return self.resume is not None
        if op == "delete":
            return bool(self.deletable())
        return True

    def new_session(self) -> None:
        def make() -> str:
            sc = tinker.ServiceClient(base_url=self.a.url, api_key=self.a.key)
            session_id = sc.holder.get_session_id()
            self.sc = sc
            return session_id
        session_id = self.call("create_session", make)
        if session_id is not None:
            self.log.write(ev="session", session_id=session_id)
            self.tc, self.samplers, self.base_sampler, self.lost = None, [], None, False
        else:
            time.sleep(1.0)

    # -- training -----------------------------------------------------------------------------
    def op_create(self) -> None:
        seed = self.rng.randrange(1000)
        tc = self.call("create", lambda: self.wait(self.sc.create_lora_training_client(self.a.base, rank=self.a.rank,
                                                                                      seed=seed)))
        if tc is not None:
            self.tc, self.steps, self.lost = tc, 0, False

    def op_forward_backward(self) -> None:
        data = self.batch()
        self.call("forward_backward", lambda: self.wait(self.tc.forward_backward(data, "cross_entropy")))

    def op_optim_step(self) -> None:
        if self.call("optim_step", lambda: self.wait(self.tc.optim_step(ADAM))) is not None and self.steps is not None:
            self.steps += 1

    def op_forward(self) -> None:
        data = self.batch()
        self.call("forward", lambda: self.wait(self.tc.forward(data, "cross_entropy")))

    def probe(self) -> list[float] | None:
        out = self.call("forward", lambda: self.wait(self.tc.forward([self.datum(PROBE)], "cross_entropy")))
        return None if out is None else [float(x) for x in out.loss_fn_outputs[0]["logprobs"].data]

    def record_steps(self, path: str) -> int | None:
        """The step count the service wrote into checkpoint `path`'s record (see the module's doc)."""
        run, _, rest = path.removeprefix("tinker://").partition("/")
        record = Path(self.a.home) / "checkpoints" / run / rest / "record.json"
        try:
            return int(json.loads(record.read_text())["tinker"]["steps"])
        except (OSError, ValueError, KeyError):
            return None

    def save(self, ttl: int | None = None) -> SavePoint | None:
        """A save_state: with `ttl`, a short-lived one; without, the new resume point (probed first)."""
        probe = None if ttl is not None else self.probe()
        if ttl is None and probe is None:
            return None
        name, steps = self.name("state"), self.steps

        def do() -> str:
            path = self.wait(self.tc.save_state(name, ttl_seconds=ttl)).path
            got = self.record_steps(path)
            self.extra = {"path": path, "ttl": ttl, "steps": steps, "record_steps": got, "probe": probe,
                          "lost_steps": abs(steps - got) if steps is not None and got is not None else 0}
            return path
        path = self.call("save_state", do)
        if path is None:
            return None
        point = SavePoint(path, steps, probe, None if ttl is None else time.time() + ttl)
        if ttl is not None:
            self.ttl_saves.append(point)
        else:
            if self.resume is not None:
                self.old_saves.append(self.resume.path)
            self.resume = point
            self.prune()
        return point

    def prune(self) -> None:
        """Delete the oldest saves beyond `KEEP` of each kind, as a user's rolling checkpoints do
        (a 30-minute soak on SmolLM2 would otherwise write ~15 GB)."""
        for attr in ("old_saves", "sampler_paths"):
            extra = getattr(self, attr)[:-KEEP]
            for path in extra:
                self.delete(path)
            setattr(self, attr, [p for p in getattr(self, attr) if p not in extra])  # tried once, failed or not

    def op_save_state(self) -> None:
        self.save(self.rng.choice([5, 8, 15, 30]) if self.rng.random() < 0.3 else None)

    def load(self, point: SavePoint, optimizer: bool, why: str) -> bool:
        """A new training client from `point`; with its probe, the weights are checked against it."""
        make = (self.sc.create_training_client_from_state_with_optimizer if optimizer
                else self.sc.create_training_client_from_state)
        tc = self.call("load", lambda: self.wait(make(point.path)))
        if tc is None:
            return False
        self.tc, self.steps, self.lost = tc, point.steps, False
        self.log.write(ev="loaded", path=point.path, why=why, steps=point.steps)
        if point.probe is not None:
            got = self.probe()
            if got is not None:
                diff = max(abs(a - b) for a, b in zip(got, point.probe))
                self.log.write(ev="probe_check", path=point.path, diff=diff, lost=diff > PROBE_TOLERANCE)
        return True

    def op_load(self) -> None:
        live = [p for p in self.ttl_saves if p.expires - time.time() > 3]
        point = self.rng.choice(live) if live and self.rng.random() < 0.3 else self.resume
        self.load(point, self.rng.random() < 0.7, "load")

    def recover(self) -> None:
        """A training client again: from the resume point (then saved at once, so its step count is
        checked), or a new one."""
        if self.resume is not None and (self.lost or self.inherited or self.rng.random() < 0.6):
            why = "worker_kill" if self.lost else "predecessor" if self.inherited else "new_session"
            self.inherited = False
            if self.load(self.resume, True, why) and self.tc is not None and not self.lost:
                self.save()
        else:
            self.op_create()

    # -- sampling -------------------------------------------------------------------------
    def prompt(self) -> types.ModelInput:
        return types.ModelInput.from_ints(self.tokens(self.rng.randint(2, 16)))

    def params(self) -> types.SamplingParams:
        return types.SamplingParams(max_tokens=self.rng.randint(2, 12), temperature=1.0,
                                    top_k=self.rng.choice([-1, 20]))

    def pick_sampler(self) -> Any:
        """One of the session's samplers: the base's (made on first use) or a checkpoint's."""
        if self.base_sampler is None:
            self.base_sampler = self.call("create_sampling_client", lambda: self.wait(
                self.sc.create_sampling_client(base_model=self.a.base)))
        # A deleted checkpoint's sampler fails once the worker is restarted (tests/test_tinker_soak.py's
        # xfail): the soak stops sampling those from just before its worker kill.
        dropped = set(self.deleted) if 0 < self.a.worker_kill_at - 2 < time.time() else set()
        choices = [s for s in [self.base_sampler, *(s for p, s in self.samplers if p not in dropped)] if s is not None]
        return self.rng.choice(choices) if choices else None

    def op_sampler(self) -> None:
        name = self.name("sampler")
        path = self.call("save_weights_for_sampler", lambda: self.wait(self.tc.save_weights_for_sampler(name)).path)
        if path is None:
            return
        self.sampler_paths.append(path)
        self.prune()
        sampler = self.call("create_sampling_client", lambda: self.wait(self.sc.create_sampling_client(model_path=path)))
        if sampler is not None:
            self.samplers = [*self.samplers, (path, sampler)][-MAX_SAMPLERS:]

    def op_sample(self) -> None:
        """One call, or several in flight at once with the same settings (the service decodes
        them as one batch), one of them sometimes with a token outside the vocabulary."""
        sampler = self.pick_sampler()
        if sampler is None:
            return
        params = self.params()
        if self.rng.random() < 0.5:
            prompt, n = self.prompt(), self.rng.randint(1, 4)
            topk = self.rng.choice([0, 0, 3])
            self.call("sample", lambda: self.wait(sampler.sample(prompt, n, params, topk_sample_logprobs=topk)))
            return
        k = self.rng.randint(2, 4)
        bad_at = self.rng.randrange(k) if self.rng.random() < 0.3 else None
        issued, futures, resolved = time.time(), [], [None] * k
        for i in range(k):
            tokens = self.tokens(self.rng.randint(2, 16))
            if i == bad_at:
                tokens[self.rng.randrange(len(tokens))] = self.a.vocab + self.rng.randrange(1000)
            fut = sampler.sample(types.ModelInput.from_ints(tokens), 1, params)
            fut.future().add_done_callback(lambda _, i=i: resolved.__setitem__(i, time.time()))
            futures.append(fut)
        for i, fut in enumerate(futures):
            self.call("sample_merged", lambda fut=fut: self.wait(fut), bad=Bad("bad_row", "prompt") if i == bad_at
                      else None, start=issued, ended=lambda i=i: resolved[i])

    def op_snapshot(self) -> None:
        sampler = self.call("save_weights_and_get_sampling_client",
                            lambda: self.wait(self.tc.save_weights_and_get_sampling_client()))
        if sampler is not None:
            prompt, params = self.prompt(), self.params()
            self.call("sample", lambda: self.wait(sampler.sample(prompt, 1, params)))

    # -- checkpoints and sessions -----------------------------------------------------------
    def deletable(self) -> list[str]:
        now = time.time()
        self.ttl_saves = [p for p in self.ttl_saves if p.expires > now - 60]
        return [*self.old_saves, *(p.path for p in self.ttl_saves if p.expires - now > 3), *self.sampler_paths]

    def op_delete(self) -> None:
        self.delete(self.rng.choice(self.deletable()))

    def delete(self, path: str) -> None:
        rest = self.sc.create_rest_client()
        if self.call("delete", lambda: self.wait(rest.delete_checkpoint_from_tinker_path(path)) or True):
            self.deleted.append(path)
            self.old_saves = [p for p in self.old_saves if p != path]
            self.ttl_saves = [p for p in self.ttl_saves if p.path != path]
            self.sampler_paths = [p for p in self.sampler_paths if p != path]

    def op_finish(self) -> None:
        """End the session (its adapters go with it); the next step starts a new one."""
        sc, self.sc = self.sc, None
        self.call("finish", lambda: self.wait(sc.close("success")) or True)

    # -- bad requests ---------------------------------------------------------------------
    def bad_request(self) -> None:
        """One request the service must refuse (see `Bad`)."""
        now = time.time()
        expired = [p for p in self.ttl_saves if p.expires < now - 2]
        kinds = ["ttl", "name", "adam", "fb_token", "sample_token", "topk", "max_tokens", "unknown_path", "raw_field",
                 *(["expired"] if expired else []), *(["deleted"] if self.deleted else [])]
        kind = self.rng.choice(kinds)
        tc, sc, vocab = self.tc, self.sc, self.a.vocab
        if kind == "ttl":
            ttl = self.rng.choice([1, 2, 4, 10 ** 10])
            self.call("save_state", lambda: self.wait(tc.save_state(self.name("bad"), ttl_seconds=ttl)),
                      Bad(kind, "ttl_seconds"))
        elif kind == "name":
            name = self.rng.choice(["a/b", "..", "bad name", "x" * 200])
            self.call("save_state", lambda: self.wait(tc.save_state(name)), Bad(kind, "path"))
        elif kind == "adam":
            adam = self.rng.choice([types.AdamParams(learning_rate=-1.0), types.AdamParams(beta1=1.5)])
            self.call("optim_step", lambda: self.wait(tc.optim_step(adam)), Bad(kind, "adam_params"))
        elif kind == "fb_token":
            tokens = self.tokens(8)
            tokens[3] = vocab + self.rng.randrange(1000)
            data = [self.datum(self.tokens(8)), self.datum(tokens)]
            self.call("forward_backward", lambda: self.wait(tc.forward_backward(data, "cross_entropy")),
                      Bad(kind, "data[1]"))
        elif kind in ("sample_token", "topk", "max_tokens"):
            self.bad_sample(kind)
        elif kind == "unknown_path":
            path = f"tinker://s{self.rng.randrange(16 ** 12):012x}:train:0/sampler_weights/nope"
            self.call("create_sampling_client", lambda: self.wait(sc.create_sampling_client(model_path=path)),
                      Bad(kind, "model_path"))
        elif kind == "raw_field":
            self.bad_raw()
        elif kind == "expired":
            path = self.rng.choice(expired).path
            self.call("load", lambda: self.wait(sc.create_training_client_from_state(path)), Bad(kind, "path"))
        else:
            path = self.rng.choice(self.deleted)
            self.call("create_sampling_client", lambda: self.wait(sc.create_sampling_client(model_path=path)),
                      Bad(kind, "path"))

    def bad_sample(self, kind: str) -> None:
        sampler = self.pick_sampler()
        if sampler is None:
            return
        tokens, params, topk, field = self.tokens(6), self.params(), 0, "prompt"
        if kind == "sample_token":
            tokens[-1] = self.a.vocab + self.rng.randrange(1000)
        elif kind == "topk":
            topk, field = self.rng.randint(21, 200), "topk_sample_logprobs"
        else:
            params, field = types.SamplingParams(max_tokens=10 ** 6), "sampling_params.max_tokens"
        self.call("sample", lambda: self.wait(sampler.sample(types.ModelInput.from_ints(tokens), 1, params,
                                                             topk_sample_logprobs=topk)), Bad(kind, field))

    def bad_raw(self) -> None:
        """A body with a field of the wrong type, as a hand-written client sends it."""
        route, body, field = self.rng.choice([("weights_info", {"tinker_path": 5}, "tinker_path"),
                                              ("create_session", {"tags": 5, "sdk_version": "0.38.0"}, "tags")])

        def post() -> Any:
            r = httpx.post(f"{self.a.url}/api/v1/{route}", json=body, headers={"X-API-Key": self.a.key}, timeout=60)
            if r.status_code >= 400:
                raise RawStatusError(r.status_code, r.text)
            return r.json()
        self.call(route, post, Bad("raw_field", field))

    # -- the probe ----------------------------------------------------------------------------
    def run_probe(self) -> None:
        """A 1-datum `forward` every `probe_every` seconds, timed, while the others train."""
        self.log.write(ev="start", pid=__import__("os").getpid(), probe=True)
        while time.time() < self.a.until:
            if self.sc is None:
                self.new_session()
            elif self.lost or self.tc is None:
                self.op_create()
            else:
                data = [self.datum(PROBE)]
                self.call("probe_forward", lambda: self.wait(self.tc.forward(data, "cross_entropy")))
            time.sleep(self.a.probe_every)
        if self.sc is not None:
            self.call("finish", lambda: self.wait(self.sc.close("success")) or True)
        self.log.write(ev="exit")


class RawStatusError(Exception):
    """An HTTP error answer to a request sent without the SDK."""

    def __init__(self, status_code: int, body: str):
        super().__init__(f"HTTP {status_code}: {body[:300]}")
        self.status_code = status_code


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--key", required=True)
    p.add_argument("--base", required=True, help="the base model's name, as the service was started")
    p.add_argument("--home", required=True, help="the service's home (for the checkpoints' records)")
    p.add_argument("--log", required=True)
    p.add_argument("--until", type=float, required=True, help="the time (epoch seconds) to finish at")
    p.add_argument("--vocab", type=int, required=True)
    p.add_argument("--slot", default="0")
    p.add_argument("--incarnation", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rank", type=int, default=4)
    p.add_argument("--max-len", type=int, default=24, help="longest datum, in tokens")
    p.add_argument("--think-s", type=float, default=0.3, help="mean pause between operations")
    p.add_argument("--bad-every", type=float, default=20.0, help="one bad request in this many operations")
    p.add_argument("--worker-kill-at", type=float, default=0.0, help="when (epoch seconds) the soak kills the worker")
    p.add_argument("--resume", help="JSON {path, steps, probe}: the save point of the client this one replaces")
    p.add_argument("--probe-every", type=float, default=0.0, help="> 0: be the probe client, a forward this often")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    client = Client(a)
    client.run_probe() if a.probe_every > 0 else client.run()


if __name__ == "__main__":
    main()
