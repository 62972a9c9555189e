"""The worker process: a Unix socket, one thread per client, one compute thread.

Clients authenticate with the HMAC challenge of `multiprocessing.connection` (an auth key kept
in a 0600 file beside the 0600 socket); the handshake runs in the client's own thread with a
deadline, so a silent or unauthenticated client never blocks the others. The compute thread
takes the first pending request, then waits up to `window_s` for every other connected client
to have one pending too (Tinker's clock cycle): the `sample` calls of that cycle decode as one
mixed-adapter batch and its `forward_backward` calls share base passes (`Engine`). With
`TINKER_WORKER_TRACE=1` in its environment the worker logs each cycle's duration and requests.

Experiments drift out of step: once one trains while another samples, every later cycle mixes a
few samples with other clients' training calls, and the mixed batches stay small (`benchmarks.
multi_lora`'s trace: two samples per cycle of four clients). So a cycle that has both `sample`
calls and other clients' other calls runs the others and holds its samples (`hold_s`): the next
cycle waits up to `hold_s` for those clients' next calls, and their samples join the held ones
in one batch. A sample is held only in a cycle that has other work to run, and at most
`MAX_HOLDS` cycles; each wait after such a cycle leaves the device idle for `hold_s` at most. The
numbers are the same either way (each row's samples do not depend on its batch).
"""

from __future__ import annotations

import collections
import errno
import gc
import os
import queue
import secrets
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import AuthenticationError, Listener, answer_challenge, deliver_challenge
from pathlib import Path
from typing import Any

from tinker_pipelines.worker import PROTOCOL_VERSION
from tinker_pipelines.worker.engine import Engine, RequestError, _error

HANDSHAKE_TIMEOUT_S = 10.0


def key_path(address: str | Path) -> Path:
    """Where the auth key of the worker at `address` is kept."""
    return Path(f"{address}.key")


MAX_HOLDS = 4
"""Most cycles a `sample` call is held for other clients' samples to join it."""
_NOT_WORK = ("_disconnected", "shutdown", "stats")
"""Requests that do not mean their client will sample soon: they never hold samples."""


@dataclass
class _Item:
    client: int
    request: dict[str, Any]
    reply: dict[str, Any] | None = None
    done: threading.Event = field(default_factory=threading.Event)
    holds: int = 0


class WorkerServer:
    """Serves one `Engine` on a Unix socket until `stop()` (or SIGTERM / SIGINT)."""

    def __init__(self, engine: Engine, address: str | Path, authkey: bytes | None = None, window_s: float = 0.02,
                 log=sys.stderr, hold_s: float = 0.25):
        self.engine, self.address, self.window_s, self.log = engine, str(address), window_s, log
        self.hold_s = hold_s
        self.cycles: collections.deque[tuple[str, ...]] = collections.deque(maxlen=1000)
        """The ops of the latest cycles, in order (what `TINKER_WORKER_TRACE` prints)."""
        self.authkey = authkey or secrets.token_bytes(32)
        self._queue: queue.Queue[_Item] = queue.Queue()
        self._clients: set[int] = set()
        self._next_client = 0
        self._stopping = threading.Event()
        self._listener: Listener | None = None

    # -- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        path, key = Path(self.address), key_path(self.address)
        problem = socket_path_problem(path)
        if problem:
            raise OSError(errno.EADDRINUSE if "listens" in problem else errno.EEXIST, problem)
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # an existing directory keeps its mode
        for stale in (path, key):  # of a dead worker (a live one accepted above)
            if stale.is_symlink() or stale.exists():
                stale.unlink()
        old_umask = os.umask(0o077)  # bind() creates the socket owner-only: no moment where others may connect
        try:
            self._listener = Listener(self.address, family="AF_UNIX")
            os.chmod(path, 0o600)
            # O_EXCL | O_NOFOLLOW: never write through a link planted at the key's path (a shared directory)
            # after the unlink above; starting fails instead.
            fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with open(fd, "wb") as f:
                f.write(self.authkey)
        finally:
            os.umask(old_umask)
        threading.Thread(target=self._compute_loop, name="worker-compute", daemon=True).start()
        threading.Thread(target=self._accept_loop, name="worker-accept", daemon=True).start()

    def serve_forever(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())
        # The base model and the libraries live as long as the worker: out of the collector's full
        # passes, which otherwise walk their ~0.4M objects again and again (~0.1 s each, mid-request)
        gc.collect()
        gc.freeze()
        self.start()
        print(f"worker ready: socket={self.address} base={self.engine.base} device={self.engine.device} "
              f"batching={'on' if self.engine.cfg.batching else 'off'}", flush=True)
        try:
            while not self._stopping.wait(0.5):
                pass
        finally:
            self.stop()

    def stop(self) -> None:
        if self._stopping.is_set() and self._listener is None:
            return
        self._stopping.set()
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()  # unlinks the socket
        for p in (Path(self.address), key_path(self.address)):
            try:
                p.unlink()
            except FileNotFoundError:
                pass

    # -- clients ----------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                conn = self._listener.accept()  # type: ignore[union-attr]
            except (OSError, AttributeError):
                return
            self._next_client += 1
            threading.Thread(target=self._serve_client, args=(conn, self._next_client), daemon=True).start()

    def _serve_client(self, conn, client: int) -> None:
        # Closing a connection does not wake a thread blocked reading it; shutting its socket down does.
        deadline = threading.Timer(HANDSHAKE_TIMEOUT_S, _cut, args=(conn,))
        deadline.start()
        try:
            try:
                deliver_challenge(conn, self.authkey)
                answer_challenge(conn, self.authkey)
            except (AuthenticationError, OSError, EOFError, ValueError) as e:
                print(f"worker: refused a client ({type(e).__name__}: {e})", file=self.log, flush=True)
                conn.close()
                return
            try:
                hello = conn.recv()
            except (OSError, EOFError, TypeError):  # gone, or cut off by the deadline
                conn.close()
                return
            except Exception as exc:  # noqa: BLE001 - an authenticated client sent something unreadable
                hello = f"unreadable ({type(exc).__name__}: {exc})"
        finally:
            deadline.cancel()
        problem = _hello_problem(hello)
        if problem:
            _send(conn, {"ok": False, "error": "ProtocolError", "message": problem})
            conn.close()
            return
        e = self.engine
        _send(conn, {"ok": True, "result": {"protocol": PROTOCOL_VERSION, "base": e.base, "device": str(e.device),
                                            "dtype": str(e.dtype).removeprefix("torch."),
                                            "batching": e.cfg.batching, "stop_token_ids": e.stop_token_ids,
                                            "pad_token_id": e.pad_token_id, "pid": os.getpid(),
                                            "max_context": e.sampler.max_context}})
        self._clients.add(client)
        try:
            while True:
                try:
                    request = conn.recv()
                except (EOFError, OSError):
                    break
                except Exception as exc:  # a message that does not unpickle here
                    request = f"unreadable request ({type(exc).__name__}: {exc})"
                if not isinstance(request, dict):
                    message = request if isinstance(request, str) else "a request is a dict"
                    if not _send(conn, {"ok": False, "error": "ProtocolError", "message": message}):
                        break
                    continue
                item = _Item(client, request)
                self._queue.put(item)
                item.done.wait()
                if not _send(conn, item.reply):
                    break  # the client went away mid-call; the others are untouched
        finally:
            self._clients.discard(client)
            conn.close()
            self._queue.put(_Item(client, {"op": "_disconnected"}))

    # -- compute ----------------------------------------------------------------------------
    def _compute_loop(self) -> None:
        held: list[_Item] = []
        expected: set[int] = set()
        while True:
            if held:  # wait for the clients that were busy with other calls, up to hold_s
                batch, window = held, self.hold_s
            else:  # wait for every connected client, up to window_s
                batch, window, expected = [self._queue.get()], self.window_s, set()
            if self.engine.cfg.batching:
                deadline = time.monotonic() + window
                # (a client that went away meanwhile is not waited for)
                while not ((expected or self._clients) & self._clients) <= {i.client for i in batch}:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        break
                    try:
                        batch.append(self._queue.get(timeout=remaining))
                    except queue.Empty:
                        break
            held, expected = self._hold(batch)
            batch = [i for i in batch if all(i is not h for h in held)]
            try:
                t0 = time.perf_counter()
                with self.engine.lock:
                    self._run(batch)
                ops = tuple(f"{i.request.get('op')}:{i.request.get('adapter', i.request.get('what', ''))}"
                            for i in batch)
                self.cycles.append(ops)
                if os.environ.get("TINKER_WORKER_TRACE"):
                    print(f"worker: {time.perf_counter() - t0:.3f}s {','.join(ops)}"
                          + (f" (holding {len(held)} samples)" if held else ""), file=self.log, flush=True)
            except Exception as e:  # a bug must not kill the worker: report it to the callers
                traceback.print_exc(file=self.log)
                for item in batch:
                    if item.reply is None:
                        item.reply = {"ok": False, **_error(e)}
            for item in batch:
                if item.reply is None:
                    item.reply = {"ok": True, "result": None}
                item.done.set()

    def _hold(self, batch: list[_Item]) -> tuple[list[_Item], set[int]]:
        """The `sample` calls of `batch` to hold for a later cycle, and the clients whose next
        calls the hold waits for: those with other work in this cycle (none when batching is off,
        `hold_s` is 0, or the cycle has no other work)."""
        if not (self.engine.cfg.batching and self.hold_s > 0):
            return [], set()
        others = {i.client for i in batch if i.request.get("op") not in ("sample", *_NOT_WORK)}
        held = [i for i in batch if i.request.get("op") == "sample" and i.holds < MAX_HOLDS and i.client not in others]
        if not (held and others):
            return [], set()
        for i in held:
            i.holds += 1
        return held, others

    def _run(self, batch: list[_Item]) -> None:
        e = self.engine
        expired = e.expire_parked()
        if expired:
            print(f"worker: dropped parked adapters nobody claimed in {e.cfg.park_ttl_s:g} s: {', '.join(expired)}",
                  file=self.log, flush=True)
        for item in batch:
            if item.request.get("op") in ("sample", "forward_backward"):
                try:
                    self._check_owner(item.client, item.request.get("adapter"))
                except RequestError as exc:
                    item.reply = {"ok": False, **_error(exc)}
        for kind, run in (("sample", e.sample), ("forward_backward", e.forward_backward)):
            items = [i for i in batch if i.request.get("op") == kind and i.reply is None]
            if items:
                for item, reply in zip(items, run([i.request for i in items])):
                    item.reply = ({"ok": False, **reply} if "error" in reply else {"ok": True, "result": reply})
        for item in batch:
            if item.reply is not None:
                continue
            r = item.request
            try:
                op = r.get("op")
                if op == "create":
                    result = e.create(item.client, r["name"], r["learner"], int(r["seed"]), r.get("base_name", ""),
                                      r.get("algorithm", ""), r.get("claim"))
                elif op == "park":
                    self._check_owner(item.client, r["name"])
                    result = e.park(r["name"], r["tag"])
                elif op == "drop":
                    self._check_owner(item.client, r["name"])
                    result = e.drop(r["name"])
                elif op == "call":
                    self._check_owner(item.client, r["adapter"])
                    result = e.call(r["adapter"], r["what"], **r.get("kwargs", {}))
                elif op == "stats":
                    result = e.stats()
                elif op == "_disconnected":
                    dropped = e.drop_owned(item.client)
                    if dropped:
                        print(f"worker: client {item.client} went away; dropped {', '.join(dropped)}",
                              file=self.log, flush=True)
                    result = None
                elif op == "shutdown":
                    threading.Thread(target=self.stop, daemon=True).start()
                    result = None
                else:
                    raise RequestError(f"unknown operation {op!r}")
                item.reply = {"ok": True, "result": result}
            except (RequestError, ValueError, KeyError, TypeError, FloatingPointError, RuntimeError,
                    FileNotFoundError) as exc:
                item.reply = {"ok": False, **_error(exc)}

    def _check_owner(self, client: int, name: str) -> None:
        h = self.engine.get(name)
        if h.parked is not None:
            raise RequestError(f"adapter {name!r} is parked on this worker: create it with its state tag to claim it")
        if h.owner != client:
            raise RequestError(f"adapter {name!r} belongs to another client of this worker")


def _hello_problem(hello: Any) -> str:
    """Why a client's first message is not a hello this worker can serve ('' when it is)."""
    if not (isinstance(hello, dict) and hello.get("op") == "hello"):
        shown = hello if isinstance(hello, str) else f"op {hello.get('op')!r}" if isinstance(hello, dict) else \
            type(hello).__name__
        return f"the first message must be {{'op': 'hello', 'v': {PROTOCOL_VERSION}}}, got {shown}"
    if hello.get("v") != PROTOCOL_VERSION:
        return f"client speaks protocol {hello.get('v')!r}, this worker speaks {PROTOCOL_VERSION}"
    return ""


def _cut(conn) -> None:
    """Shut a connection's socket down, so that a thread blocked reading it gets end-of-file."""
    try:
        s = socket.socket(fileno=os.dup(conn.fileno()))
    except (OSError, ValueError, TypeError):  # closed already
        return
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        s.close()


def socket_path_problem(path: Path) -> str:
    """Why a worker may not listen at `path` ('' when it may): another worker listens there, or
    something that is not a socket is in the way (a dead worker's socket is replaced)."""
    if path.is_symlink() or (path.exists() and not path.is_socket()):
        return "something that is not a worker's socket is there; refusing to replace it"
    if listening(path):
        return "a worker already listens there (stop it, or choose another --socket)"
    return ""


def listening(path: Path) -> bool:
    """Whether something accepts connections on the Unix socket at `path`."""
    if not path.is_socket():
        return False
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(2.0)
        try:
            s.connect(str(path))
            return True
        except OSError:
            return False


def _send(conn, message: Any) -> bool:
    try:
        conn.send(message)
        return True
    except (OSError, ValueError):
        return False
