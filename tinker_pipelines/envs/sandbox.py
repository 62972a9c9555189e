"""Run untrusted, model-written Python in a throwaway, resource-limited sandbox.

``run_python(code)`` runs ``code`` with ``python -I -S`` (standard library only) and
returns a :class:`SandboxResult`. Process tree: caller -> supervisor
(``sandbox_supervisor.py`` run as a script, in a new session) -> init (PID 1 of a new PID
namespace) -> program.

Always: new session/process group, an environment of only PATH, HOME, TMPDIR and
LANG, a private working directory deleted afterwards, rlimits, a wall-clock limit
after which every process of the run is SIGKILLed, capped stdout/stderr,
no_new_privs. The isolation layers of :data:`LAYERS` (a fresh uid, network, mount +
chroot and PID namespaces) need root and a kernel that allows them; by default every
one is required, and when one cannot be set up the program is never started:
:class:`SandboxUnavailable` names the missing layer and why. ``require=`` narrows
that for trusted code (``require=()`` runs with whatever the machine gives).

Never protected against: kernel exploits (shared kernel, no seccomp filter); side
channels; reading the bound system paths; denial of service within the limits.
Treat the program's output as written by an adversary. Details in docs/sandbox.md.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Iterable

from tinker_pipelines.envs import sandbox_supervisor
from tinker_pipelines.envs.sandbox_supervisor import _PROGRAM, _WORKDIR

__all__ = ["LAYERS", "SandboxResult", "SandboxUnavailable", "missing_layers", "run_python"]

# Above systemd's container ranges (524288-1879048191) and below 2**31, where
# some tools treat uids as negative: nothing else should own files or processes here.
_UID_RANGE = (1_900_000_000, 2_100_000_000)
_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
                 "/etc/ld.so.cache", "/etc/localtime")
_DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")

LAYERS = ("uid_dropped", "network_isolated", "filesystem_isolated", "pid_isolated")
"""The isolation layers, named as the :class:`SandboxResult` flags; all required by default."""


class SandboxUnavailable(RuntimeError):
    """A required isolation layer is missing (a fault of the machine, not of the code), so
    the program was never started."""

    def __init__(self, missing: dict[str, str]):
        self.missing = dict(missing)
        """Each missing layer and why it is missing."""
        super().__init__(
            "sandbox refused to run the program: required isolation layer(s) missing: "
            + "; ".join(f"{layer} ({why})" for layer, why in self.missing.items())
            + ". docs/sandbox.md says what each layer needs, and how trusted code opts out")


@dataclass(frozen=True)
class SandboxResult:
    """Outcome of one :func:`run_python` call; all its processes are gone by then."""

    stdout: str
    """Program's standard output (UTF-8, bad bytes replaced), cut at ``max_output_bytes``."""
    stderr: str
    """Program's standard error, or the sandbox's own start-up error, cut likewise."""
    exit_code: int | None
    """Exit status; ``-N`` if signal N ended it; None if it timed out or never started."""
    timed_out: bool
    """True if the wall-clock limit expired and the run was killed."""
    killed_signal: int | None
    """Signal that ended the program before the wall-clock limit (SIGKILL, SIGXCPU, ...)."""
    wall_s: float
    """Seconds from launch until every process of the run was gone."""
    output_truncated: bool
    """True if stdout or stderr exceeded ``max_output_bytes`` and the rest was dropped."""
    network_isolated: bool
    """True if the program ran in its own network namespace with no interface up."""
    filesystem_isolated: bool
    """True if the program was chrooted into read-only system paths plus a private tmpfs."""
    pid_isolated: bool
    """True if the program ran in its own PID namespace."""
    uid_dropped: bool
    """True if the program ran as a fresh unprivileged uid/gid rather than the caller's."""
    uid: int
    """Uid the program ran as (or was meant to run as, if ``uid_dropped`` is False)."""
    pgid: int
    """Process group and session id of the run (the supervisor's pid)."""


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 256, stdin: str = "",
               max_output_bytes: int = 1 << 20, max_file_mb: int = 8, disk_mb: int = 64,
               max_processes: int = 32, python: str | None = None,
               require: Iterable[str] = LAYERS) -> SandboxResult:
    """Run ``code`` as a Python program in a sandbox and return what happened.

    ``timeout_s`` is wall-clock time from launch (sandbox start-up, about 0.1 s,
    included); CPU time is capped a little above it. ``memory_mb`` is the address
    space per process, ``max_file_mb`` the largest file it may write, ``disk_mb`` the
    size of its tmpfs working directory (with filesystem isolation), ``max_processes``
    the most processes its uid may have, ``python`` the interpreter (default: ours),
    ``require`` the layers without which the program must not start (default: all of
    :data:`LAYERS`; raises :class:`SandboxUnavailable` naming the missing ones).
    Returns once every process of the run is gone and its directory is deleted.
    """
    if timeout_s <= 0:
        raise ValueError("timeout_s must be positive")
    required = list(dict.fromkeys(require))
    if unknown := [layer for layer in required if layer not in LAYERS]:
        raise ValueError(f"require: unknown layer(s) {unknown}; known: {', '.join(LAYERS)}")
    interpreter = os.path.realpath(python or sys.executable)
    uid = _fresh_uid() if os.geteuid() == 0 else os.geteuid()
    base = tempfile.mkdtemp(prefix="tinker-sandbox-")
    try:
        os.chmod(base, 0o711)  # a dropped uid must reach root/ but not list base/
        root = os.path.join(base, "root")
        os.mkdir(root, 0o755)
        os.mkdir(root + _WORKDIR, 0o700)
        os.chown(root + _WORKDIR, uid, uid)
        with open(os.open(root + _PROGRAM, os.O_WRONLY | os.O_CREAT, 0o644), "w", encoding="utf-8") as f:
            f.write(code)
        cpu_s = math.ceil(timeout_s) + 1
        limits = {  # (soft, hard); CPU: SIGXCPU first, SIGKILL a second later
            "RLIMIT_CPU": (cpu_s, cpu_s + 1), "RLIMIT_AS": (memory_mb << 20,) * 2,
            "RLIMIT_FSIZE": (max_file_mb << 20,) * 2, "RLIMIT_NPROC": (max_processes,) * 2,
            "RLIMIT_NOFILE": (64, 64), "RLIMIT_CORE": (0, 0),
        }
        config = {"root": root, "python": interpreter, "uid": uid, "disk_mb": disk_mb,
                  "binds": _bind_paths(interpreter), "rlimits": limits, "require": required}
        return _supervise(config, stdin, timeout_s, max_output_bytes)
    finally:
        _remove_tree(base)


def missing_layers(require: Iterable[str] = LAYERS) -> dict[str, str]:
    """Which of ``require`` this machine cannot give right now, and why (one empty run)."""
    try:
        run_python("pass", require=require)
    except SandboxUnavailable as exc:
        return exc.missing
    return {}


def _fresh_uid() -> int:
    """Draw a uid no running process uses, so that kill(-1) from it hits only this run."""
    in_use: set[int] = set()
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError):  # not a pid, or exited meanwhile
            with open(f"/proc/{entry}/status") as f:
                for line in f:
                    if line.startswith(("Uid:", "Gid:")):
                        in_use.update(int(x) for x in line.split()[1:])
    while (uid := _UID_RANGE[0] + secrets.randbelow(_UID_RANGE[1] - _UID_RANGE[0])) in in_use:
        pass
    return uid


def _bind_paths(interpreter: str) -> list[str]:
    """Paths to show read-only in the chroot: system libraries plus the interpreter's prefix."""
    paths = [p for p in _SYSTEM_PATHS if os.path.lexists(p)]
    prefix = os.path.dirname(os.path.dirname(interpreter))
    covered = [p for p in paths if not os.path.islink(p)] + ["/"]  # never bind all of /
    if not any(prefix == p or prefix.startswith(p + "/") for p in covered):
        paths.append(prefix)
    return paths + [d for d in _DEVICES if os.path.exists(d)]


def _supervise(config: dict[str, Any], stdin: str, timeout_s: float, cap: int) -> SandboxResult:
    """Start the supervisor; collect output and status until the program ends or time is up."""
    status_r, status_w = os.pipe()
    config["status_fd"] = status_w
    with open(status_r, "rb"), tempfile.TemporaryFile() as stdin_file:
        stdin_file.write(stdin.encode())
        stdin_file.seek(0)
        start = time.monotonic()
        try:
            proc = subprocess.Popen(
                [os.path.realpath(sys.executable), "-I", "-S", os.path.abspath(sandbox_supervisor.__file__),
                 json.dumps(config)],
                stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={},
                pass_fds=(status_w,), start_new_session=True, cwd=os.path.dirname(config["root"]))
        finally:
            os.close(status_w)  # else we would never see EOF on the status pipe
        assert proc.stdout is not None and proc.stderr is not None
        stdout, stderr = proc.stdout.fileno(), proc.stderr.fileno()
        buffers = {stdout: bytearray(), stderr: bytearray(), status_r: bytearray()}
        status: dict[str, Any] = {}
        truncated = False

        def pump(sel: selectors.BaseSelector, until: float) -> None:
            """Read whatever arrives before ``until``."""
            nonlocal truncated
            for key, _ in sel.select(max(until - time.monotonic(), 0)):
                data = os.read(key.fd, 65536)
                if not data:
                    sel.unregister(key.fd)
                elif key.fd == status_r:
                    *lines, buffers[status_r] = (buffers[status_r] + data).split(b"\n")
                    for line in lines:
                        status.update(json.loads(line))
                else:  # past the cap, keep reading: a full pipe must not stall the program
                    room = max(cap - len(buffers[key.fd]), 0)
                    truncated |= len(data) > room
                    buffers[key.fd] += data[:room]

        with selectors.DefaultSelector() as sel, proc.stdout, proc.stderr:
            for fd in buffers:
                sel.register(fd, selectors.EVENT_READ)
            deadline = start + timeout_s
            while "wait_status" not in status and status_r in sel.get_map() and (
                    time.monotonic() < deadline):
                pump(sel, deadline)
            timed_out = "wait_status" not in status and status_r in sel.get_map()
            _shut_down(proc, finished=not timed_out, sweep=bool(status.get("uid_dropped")))
            drain_until = time.monotonic() + 1.0  # all dead by now: only buffered output left
            while sel.get_map() and time.monotonic() < drain_until:
                pump(sel, drain_until)
    if status.get("refused"):
        raise SandboxUnavailable(status["refused"])
    done = not timed_out and "wait_status" in status
    exit_code = os.waitstatus_to_exitcode(status["wait_status"]) if done else None
    return SandboxResult(
        stdout=buffers[stdout].decode("utf-8", "replace"),
        stderr=buffers[stderr].decode("utf-8", "replace"),
        exit_code=exit_code, timed_out=timed_out,
        killed_signal=-exit_code if exit_code is not None and exit_code < 0 else None,
        wall_s=time.monotonic() - start, output_truncated=truncated,
        network_isolated=bool(status.get("net")), filesystem_isolated=bool(status.get("fs")),
        pid_isolated=bool(status.get("pidns")), uid_dropped=bool(status.get("uid_dropped")),
        uid=config["uid"], pgid=proc.pid,
    )


def _shut_down(proc: subprocess.Popen[bytes], *, finished: bool, sweep: bool) -> None:
    """Kill whatever is left of the run and reap the supervisor."""
    if sweep:
        if not finished:
            proc.send_signal(signal.SIGTERM)  # the supervisor kills init and sweeps the uid
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=1.0)  # it reaps every orphan: no zombies left behind
    # Backstop; without a private uid, the group is all we can reach (and orphans of the
    # killed supervisor go to the system's init).
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _remove_tree(path: str) -> None:
    """Delete the run's directory, even parts the program made unreadable."""
    if os.geteuid() != 0:  # root ignores modes; anyone else must restore them first
        for dirpath, dirnames, _ in os.walk(path):
            for name in dirnames:
                if not os.path.islink(full := os.path.join(dirpath, name)):
                    os.chmod(full, 0o700)
    shutil.rmtree(path, ignore_errors=True)
