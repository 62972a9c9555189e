"""Futures and per-model ordering: what `retrieve_future` answers and when work may run.

Every Tinker call that does model work answers at once with a `request_id`; its result is
fetched with `retrieve_future`, a long-poll the service holds until the result is ready or
`poll_s` passes (then 408 with a try-again body, which the SDK re-sends at once). A training
client's calls carry one `seq_id` counter, and the SDK sends the chunks of a split
`forward_backward` concurrently, the first one last, so each model runs its calls strictly in
`seq_id` order and holds a later one until the gap fills; a gap that does not fill within
`gap_timeout_s` fails the calls waiting behind it with a message naming the missing `seq_id`.
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from tinker_pipelines.serving.tinker import tenancy


@dataclass(frozen=True)
class Proto:
    """A result the SDK reads as protobuf (forward_backward, sample)."""

    body: bytes


@dataclass(frozen=True)
class Failed:
    """A request that failed: the SDK raises `RequestFailedError(error, category)`."""

    error: str
    category: str = "user"
    """'user' (the request was wrong) or 'server' (we failed it)."""


Result = Proto | Failed | dict[str, Any]
"""A finished request: protobuf bytes, a failure, or a JSON result (the SDK's response class, dumped)."""


@dataclass
class _Entry:
    future: asyncio.Future
    owner: str
    created: float = field(default_factory=time.monotonic)


class Futures:
    """Request ids and their results. Ids are random (uuid4), so an id from before a restart
    never names another request. Results are kept `keep_s` after they finish (a client that
    retries its poll gets the same answer), then dropped. A tenant sees only its own."""

    def __init__(self, keep_s: float = 3600.0):
        self._entries: dict[str, _Entry] = {}
        self._finished: collections.deque[tuple[float, str]] = collections.deque()
        """(when, request id) of finished requests, oldest first: expiry pops from the left."""
        self.keep_s = keep_s
        self._tasks: set[asyncio.Task] = set()
        """Running work; held here because the event loop keeps only weak references to tasks."""

    def spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def new(self) -> tuple[str, asyncio.Future]:
        self._expire()
        rid = f"req-{uuid.uuid4().hex}"
        fut = asyncio.get_running_loop().create_future()
        self._entries[rid] = _Entry(fut, tenancy.current())
        fut.add_done_callback(lambda _: self._finished.append((time.monotonic(), rid)))
        return rid, fut

    def run(self, work: Callable[[], Awaitable[Result]]) -> str:
        """A request id for `work`, started now (sampling: no ordering)."""
        rid, fut = self.new()
        self.spawn(_settle(fut, work))
        return rid

    def get(self, request_id: str) -> asyncio.Future | None:
        """The future of `request_id` if the current tenant made it (O(1))."""
        e = self._entries.get(request_id)
        return None if e is None or e.owner != tenancy.current() else e.future

    def own(self, request_id: str) -> asyncio.Future | None:
        """The future of `request_id`, whoever made it (the service's own bookkeeping)."""
        e = self._entries.get(request_id)
        return None if e is None else e.future

    def _expire(self) -> None:
        now = time.monotonic()
        while self._finished and now - self._finished[0][0] > self.keep_s:
            self._entries.pop(self._finished.popleft()[1], None)

    def __len__(self) -> int:
        return len(self._entries)


async def _settle(fut: asyncio.Future, work: Callable[[], Awaitable[Result]]) -> None:
    try:
        result = await work()
    except Exception as e:  # noqa: BLE001 - reported to the client as this request's failure
        result = failure(e)
    if not fut.done():
        fut.set_result(result)


def failure(e: BaseException) -> Failed:
    """An exception as a request failure: a bad request is the user's (`ValueError`), the rest ours."""
    user = isinstance(e, (ValueError, KeyError, LookupError))
    message = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
    return Failed(message.splitlines()[0] if message else type(e).__name__, "user" if user else "server")


REMEMBERED_SEQ_IDS = 1024
"""How many of a model's latest calls a re-send is recognised for (a long run makes millions)."""


class SeqQueue:
    """One model's calls, run one at a time in `seq_id` order (from `first`)."""

    def __init__(self, futures: Futures, first: int = 1, gap_timeout_s: float = 60.0):
        self.futures = futures
        self.next = first
        """The seq_id that runs next."""
        self.gap_timeout_s = gap_timeout_s
        self._waiting: dict[int, tuple[str, Callable[[], Awaitable[Result]]]] = {}
        self._ids: dict[int, str] = {}
        """seq_id -> request id, so a re-sent call gets the future of the first."""
        self._running = False
        self._gap_timer: asyncio.TimerHandle | None = None

    def submit(self, seq_id: int, work: Callable[[], Awaitable[Result]]) -> str:
        if seq_id in self._ids:  # the SDK re-sends a call whose answer it did not get: same future
            return self._ids[seq_id]
        rid, fut = self.futures.new()
        self._ids[seq_id] = rid
        if seq_id < self.next:
            fut.set_result(Failed(f"seq_id {seq_id} comes after {self.next - 1}, which already ran: each call of a "
                                  f"training client needs a new seq_id", "user"))
            return rid
        self._waiting[seq_id] = (rid, work)
        self._kick()
        return rid

    def _kick(self) -> None:
        if self._running:
            return
        if self.next in self._waiting:
            self._running = True
            self.futures.spawn(self._drain())
        elif self._waiting and self._gap_timer is None:
            self._gap_timer = asyncio.get_running_loop().call_later(self.gap_timeout_s, self._gap_expired, self.next)

    async def _drain(self) -> None:
        if self._gap_timer is not None:
            self._gap_timer.cancel()
            self._gap_timer = None
        try:
            while self.next in self._waiting:
                rid, work = self._waiting.pop(self.next)
                fut = self.futures.own(rid)
                await _settle(fut, work)
                self.next += 1
                if len(self._ids) > 2 * REMEMBERED_SEQ_IDS:
                    self._ids = {k: v for k, v in self._ids.items() if k >= self.next - REMEMBERED_SEQ_IDS}
        finally:
            self._running = False
        self._kick()

    def _gap_expired(self, missing: int) -> None:
        self._gap_timer = None
        if self.next != missing or self._running or not self._waiting:
            self._kick()
            return
        waiting = sorted(self._waiting)
        for seq in waiting:
            rid, _ = self._waiting.pop(seq)
            fut = self.futures.own(rid)
            if fut is not None and not fut.done():
                fut.set_result(Failed(f"seq_id {missing} never arrived within {self.gap_timeout_s:g} s, so seq_id "
                                      f"{seq} (which must run after it) was not run", "user"))
        self.next = waiting[-1] + 1
