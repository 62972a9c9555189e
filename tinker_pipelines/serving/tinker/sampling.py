"""Concurrent `asample` calls merged into one worker call.

A recipe samples a whole batch at once: tinker-cookbook's RL loop sends one `asample` per
prompt (each with `num_samples` = the group size) and awaits them together. Sent one by one,
each would be a decode of its own; merged, the batch decodes as one (the decode loop's cost is
per step, nearly whatever the rows). Calls merge when they sample the same adapter with the
same settings and bring no seed of their own (a seeded call's tokens must not depend on its
neighbours, so it is sent alone). What each call asks of its own prompt (`prompt_scoring`) and
its top-k width of sampled tokens (`top_logprobs`) may differ: the merged call carries each
prompt's scoring and the widest k, and each call gets back its own prompts' scores and its own k.
Each connection sends one merged call at a time; the calls
that arrive meanwhile merge into the next.

A batch's requests reach the service over some milliseconds (each is an HTTP request of its own,
parsed in turn), so a merged call is sent once calls stop arriving for `settle_s` (at most
`max_wait_s` after the first, or as soon as it is full). Sent at the first arrival, a recipe's
64-row batch went to the worker as two decodes (0.8 s for the first few rows, then 1.6 s for the
rest) instead of one. The SDK's 64 requests of one step reached the service over 5-200 ms, with
gaps of up to 37 ms between two of them (SmolLM2 math_rl, 2 cores): with 20 ms and 200 ms, one
step in three still decoded its last two rows alone (0.9 s more).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any, Callable

import msgspec

from tinker_pipelines.rollout.prompt_scores import PromptScores, PromptScoring
from tinker_pipelines.worker import WorkerDiedError
from tinker_pipelines.worker import messages as M


@dataclass
class _Pending:
    call: M.SampleCall
    future: asyncio.Future
    key: tuple = ()

    @property
    def rows(self) -> int:
        """Sequences it decodes: prompts x num_samples."""
        return len(self.call.prompts) * self.call.num_samples


@dataclass(frozen=True)
class Answer:
    """One call's share of a merged reply."""

    samples: list
    prompt_logprobs: list | None
    prompt_scores: list[PromptScores] | None = None
    """One per prompt of the call, when it had `prompt_scoring`."""


_unique = itertools.count()


def merge_key(call: M.SampleCall) -> tuple:
    """Calls with equal keys may be sent as one (prompts concatenated)."""
    if call.seed is not None:
        return ("seeded", next(_unique))
    fields = {f: getattr(call, f) for f in call.__struct_fields__ if f not in _PER_CALL}
    return tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(fields.items()))


_PER_CALL = ("prompts", "prompt_scoring", "top_logprobs")
"""SampleCall fields merged calls may differ in (`merge`)."""


def merge(calls: list[M.SampleCall]) -> M.SampleCall:
    """Calls of one `merge_key` as one: their prompts in order, each prompt's scoring (none for
    a call without), and the widest top-k of sampled tokens (`_split` cuts each call's back)."""
    if len(calls) == 1:
        return calls[0]
    scoring = [s for c in calls for s in (c.prompt_scoring or [PromptScoring()] * len(c.prompts))] \
        if any(c.prompt_scoring for c in calls) else []
    return msgspec.structs.replace(calls[0], prompts=[q for c in calls for q in c.prompts], prompt_scoring=scoring,
                                   top_logprobs=max(c.top_logprobs for c in calls))


class SampleBatcher:
    """Merges calls per connection; `send(conn, call)` runs one worker call in a thread."""

    def __init__(self, send: Callable[[Any, M.SampleCall], M.SampleReply], max_rows: int = 256,
                 settle_s: float = 0.05, max_wait_s: float = 0.5):
        self.send = send
        self.max_rows = max_rows
        """Most rows (prompts x num_samples) in one merged call (the worker's --max-rows)."""
        self.settle_s = settle_s
        """A merged call goes once no call has arrived for this long..."""
        self.max_wait_s = max_wait_s
        """...or this long after its first call arrived, or when it is full."""
        self._queues: dict[int, list[_Pending]] = {}
        self._conns: dict[int, Any] = {}
        self._busy: set[int] = set()
        self._tasks: set[asyncio.Task] = set()
        self.calls = 0
        """Worker calls sent (a benchmark compares it with the requests)."""

    async def sample(self, conn: Any, call: M.SampleCall) -> Answer:
        key = id(conn)
        fut = asyncio.get_running_loop().create_future()
        self._queues.setdefault(key, []).append(_Pending(call, fut, merge_key(call)))
        self._conns[key] = conn
        if key not in self._busy:
            self._busy.add(key)
            task = asyncio.ensure_future(self._drain(key))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await fut

    def _take(self, key: int) -> list[_Pending]:
        queue = self._queues[key]
        first = queue[0].key
        group, rest, rows = [], [], 0
        for p in queue:
            if p.key == first and (not group or rows + p.rows <= self.max_rows):
                group.append(p)
                rows += p.rows
            else:
                rest.append(p)
        self._queues[key] = rest
        return group

    async def _drain(self, key: int) -> None:
        try:
            while self._queues.get(key):
                await self._settle(key)
                group = self._take(key)
                merged = merge([p.call for p in group])
                self.calls += 1
                try:
                    reply = await asyncio.to_thread(self.send, self._conns[key], merged)
                except Exception as e:  # noqa: BLE001 - the group's calls get the error, or each its own
                    await self._fail_alone(key, group, e)
                    continue
                self._split(group, reply)
        except BaseException as e:  # a bug here must fail the calls, not leave their clients polling forever
            for p in self._queues.get(key, []):
                if not p.future.done():
                    p.future.set_exception(e)
            raise
        finally:
            self._busy.discard(key)
            self._queues.pop(key, None)
            self._conns.pop(key, None)

    async def _fail_alone(self, key: int, group: list[_Pending], e: Exception) -> None:
        """A merged call failed: if the worker is there, each call runs again alone, so only the
        one that cannot run fails and the others get what they would have got without it. A dead
        worker fails them all at once."""
        if len(group) == 1 or isinstance(e, WorkerDiedError):
            for p in group:
                if not p.future.done():
                    p.future.set_exception(e)
            return
        for p in group:
            self.calls += 1
            try:
                reply = await asyncio.to_thread(self.send, self._conns[key], p.call)
            except Exception as alone:  # noqa: BLE001 - this call's own failure
                if not p.future.done():
                    p.future.set_exception(alone)
                continue
            self._split([p], reply)

    async def _settle(self, key: int) -> None:
        """Wait while calls are still arriving for connection `key` (see the module's doc)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_wait_s
        seen = -1
        while True:
            queue = self._queues.get(key, [])
            if len(queue) == seen or sum(p.rows for p in queue) >= self.max_rows or loop.time() >= deadline:
                return
            seen = len(queue)
            await asyncio.sleep(min(self.settle_s, max(0.0, deadline - loop.time())))

    @staticmethod
    def _split(group: list[_Pending], reply: M.SampleReply) -> None:
        """Samples come prompt by prompt, `num_samples` each; prompt logprobs and scores one per
        prompt. A call gets its sampled tokens' top-k as wide as it asked (none: none)."""
        s, q = 0, 0
        widest = max(p.call.top_logprobs for p in group)
        for p in group:
            n_prompts = len(p.call.prompts)
            n = n_prompts * p.call.num_samples
            plp = reply.prompt_logprobs[q:q + n_prompts] if reply.prompt_logprobs else None
            scores = reply.prompt_scores[q:q + n_prompts] if p.call.prompt_scoring and reply.prompt_scores else None
            samples = list(reply.samples[s:s + n])
            if p.call.top_logprobs < widest:
                k = p.call.top_logprobs
                samples = [dataclasses.replace(x, top_logprobs=tuple(t[:k] for t in x.top_logprobs) if k else ())
                           for x in samples]
            if not p.future.done():
                p.future.set_result(Answer(samples, plp, scores))
            s += n
            q += n_prompts
