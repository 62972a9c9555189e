"""Run untrusted, model-written Python in a throwaway, resource-limited sandbox.

``run_python(code)`` runs ``code`` with ``python -I -S`` (standard library only) and returns a
:class:`SandboxResult`. The isolation is bubblewrap's (``bwrap``, Debian's ``bubblewrap``), which
gets its namespaces through a user namespace and so works for root and for any other user alike:
new user, PID, network, mount, IPC and UTS namespaces; read-only system paths and the
interpreter's prefix; a private tmpfs working directory; no nested user namespaces; and a
libseccomp filter (``sandbox_seccomp``) that makes the kernel's riskiest calls fail with EPERM.
Process tree: caller -> bwrap (new session) -> init (``sandbox_init.py``, PID 1 of the run's PID
namespace) -> program.

Hand-written here, each because bubblewrap has no such option: the wall-clock limit (SIGKILL to
the run's PID 1, which ends the namespace), the stdout/stderr caps (we read the pipes), and a
fresh host uid per run when the caller is root (so that no run is root outside its namespace and
``RLIMIT_NPROC`` is enforced). The rlimits and the exact wait status are ``sandbox_init``'s.

Every layer of :data:`LAYERS` is required by default; when one cannot be set up the program is
never started, and a :class:`SandboxUnavailable` subclass names the missing piece and its fix.
``require=()`` runs trusted code with whatever the machine gives (without bubblewrap: no layer).

Never protected against: kernel bugs reachable through the allowed system calls; side channels;
reading the bound system paths; denial of service within the limits. Treat the program's output
as written by an adversary. Details in docs/sandbox.md.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
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
from pathlib import Path
from typing import Iterable

from tinker_pipelines.envs.sandbox_seccomp import LibseccompUnavailable, filter_bpf

__all__ = ["LAYERS", "BubblewrapMissing", "LibseccompMissing", "SandboxResult", "SandboxUnavailable",
           "UserNamespacesForbidden", "missing_layers", "run_python", "userns_blockers"]

_log = logging.getLogger(__name__)

LAYERS = ("uid_dropped", "network_isolated", "filesystem_isolated", "pid_isolated", "syscalls_filtered")
"""The isolation layers, named as the :class:`SandboxResult` flags; all required by default."""

FALLBACKS: collections.Counter[str] = collections.Counter()
"""How often a run with ``require`` narrowed went ahead without a piece, by piece (each also logged)."""

SANDBOX_UID = 1000
"""The uid (and gid) the program has inside its user namespace."""
# Above systemd's container ranges (524288-1879048191) and below 2**31, where some tools
# treat uids as negative: nothing else should own files or processes here.
_UID_RANGE = (1_900_000_000, 2_100_000_000)
_WORKDIR, _PROGRAM = "/sandbox", "/program.py"
_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache",
                 "/etc/localtime")
_DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
_INIT_SOURCE = (Path(__file__).parent / "sandbox_init.py").read_text()  # run with -c: never imported here
_USERNS_SETTINGS = (  # (sysctl, value that forbids unprivileged user namespaces, how to allow them)
    ("user.max_user_namespaces", "0", "sysctl -w user.max_user_namespaces=15000"),
    ("kernel.unprivileged_userns_clone", "0", "sysctl -w kernel.unprivileged_userns_clone=1"),
    ("kernel.apparmor_restrict_unprivileged_userns", "1",
     "sysctl -w kernel.apparmor_restrict_unprivileged_userns=0, or an AppArmor profile for bwrap"),
)
_FIX_BWRAP = ("install bubblewrap: `sudo apt-get install bubblewrap` (Debian/Ubuntu), `dnf install bubblewrap` "
              "(Fedora/RHEL); without root, ask the administrator, or build it from source and put `bwrap` on PATH "
              "(it needs no setuid bit where unprivileged user namespaces are allowed)")
_FIX_LIBSECCOMP = "install libseccomp: `sudo apt-get install libseccomp2` (Debian/Ubuntu), `dnf install libseccomp`"


class SandboxUnavailable(RuntimeError):
    """A required isolation layer is missing (a fault of the machine, not of the code), so the
    program was never started. Subclasses name the missing piece."""

    def __init__(self, missing: dict[str, str], fix: str = ""):
        self.missing = dict(missing)
        """Each missing layer and why it is missing."""
        self.fix = fix
        """What would give the missing layers (empty when not known)."""
        super().__init__(
            "sandbox refused to run the program: required isolation layer(s) missing: "
            + "; ".join(f"{layer} ({why})" for layer, why in self.missing.items())
            + (f". Fix: {fix}" if fix else "") + ". docs/sandbox.md says what each layer needs")


class BubblewrapMissing(SandboxUnavailable):
    """``bwrap`` is not on PATH: no layer can be set up."""


class UserNamespacesForbidden(SandboxUnavailable):
    """The kernel (a sysctl), an LSM or a container's seccomp profile forbids this user a user namespace."""


class LibseccompMissing(SandboxUnavailable):
    """libseccomp cannot be loaded, so no syscall filter can be compiled."""


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
    """True if the program ran in its own network namespace (only its own loopback)."""
    filesystem_isolated: bool
    """True if the program saw only read-only system paths, the interpreter's prefix and its own tmpfs."""
    pid_isolated: bool
    """True if the program ran in its own PID namespace, which ends with the run."""
    uid_dropped: bool
    """True if the program ran as uid :data:`SANDBOX_UID` of its own user namespace, without
    capabilities, and as an unprivileged host uid (a fresh one per run when the caller is root)."""
    syscalls_filtered: bool
    """True if the seccomp filter of ``sandbox_seccomp`` was loaded before the program started."""
    uid: int
    """Host uid that owned the run's processes (with ``uid_dropped``: a fresh one if the caller is root)."""
    pgid: int
    """Process group and session id of the run (bwrap's pid, or the init's without bubblewrap)."""


@dataclass
class _Run:
    """What one launch needs, and the fds that must be closed after it."""

    argv: list[str]
    cwd: str
    uid: int
    fds: list[int]
    layers: tuple[str, ...]
    bubblewrap: bool
    scratch: str | None = None


def run_python(code: str, *, timeout_s: float = 5.0, memory_mb: int = 256, stdin: str = "",
               max_output_bytes: int = 1 << 20, max_file_mb: int = 8, disk_mb: int = 64,
               max_processes: int = 32, python: str | None = None,
               require: Iterable[str] = LAYERS) -> SandboxResult:
    """Run ``code`` as a Python program in a sandbox and return what happened.

    ``timeout_s`` is wall-clock time from launch (sandbox start-up, about 0.01 s, included); CPU
    time is capped a little above it. ``memory_mb`` is the address space per process,
    ``max_file_mb`` the largest file it may write, ``disk_mb`` the size of its tmpfs working
    directory, ``max_processes`` the most processes of the run, ``python`` the interpreter
    (default: ours), ``require`` the layers without which the program must not start (default:
    all of :data:`LAYERS`; raises a :class:`SandboxUnavailable` naming the missing piece).
    Returns once every process of the run is gone.
    """
    if timeout_s <= 0:
        raise ValueError("timeout_s must be positive")
    required = tuple(dict.fromkeys(require))
    if unknown := [layer for layer in required if layer not in LAYERS]:
        raise ValueError(f"require: unknown layer(s) {unknown}; known: {', '.join(LAYERS)}")
    interpreter = _interpreter(python)
    cpu_s = math.ceil(timeout_s) + 1
    limits = ",".join(f"{name}:{soft}:{hard}" for name, (soft, hard) in {
        "CPU": (cpu_s, cpu_s + 1),  # SIGXCPU first, SIGKILL a second later
        "AS": (memory_mb << 20,) * 2, "FSIZE": (max_file_mb << 20,) * 2,
        "NPROC": (max_processes,) * 2, "NOFILE": (64, 64), "CORE": (0, 0)}.items())
    launch = _plan(code, interpreter, limits, disk_mb, required)
    try:
        result = _supervise(launch, stdin, timeout_s, max_output_bytes)
    finally:
        for fd in launch.fds:
            os.close(fd)
        if launch.scratch:
            shutil.rmtree(launch.scratch, ignore_errors=True)
    if isinstance(result, SandboxResult):
        return result
    refusal = _setup_failure(result, required or LAYERS)
    if required:
        raise refusal
    _fall_back("bubblewrap could not start", str(refusal))
    launch = _direct(code, interpreter, limits)
    try:
        result = _supervise(launch, stdin, timeout_s, max_output_bytes)
    finally:
        shutil.rmtree(launch.scratch or "", ignore_errors=True)
    assert isinstance(result, SandboxResult), "the init never started without bubblewrap either"
    return result


def _interpreter(python: str | None) -> str:
    """The interpreter to run the program with. As root, bubblewrap runs as a fresh uid, which
    must be able to reach it: ours under /root (pyenv) is not, and then the system's runs the
    program instead (standard library only either way; logged and counted)."""
    chosen = os.path.realpath(python or sys.executable)
    if os.geteuid() != 0 or _reachable_by_anyone(chosen):
        return chosen
    system = os.path.realpath("/usr/bin/python3")
    if python is None and os.path.exists(system):
        if FALLBACKS["system interpreter"] == 0:
            _log.warning("sandbox: %s is not reachable by an unprivileged uid; programs run with %s", chosen, system)
        FALLBACKS["system interpreter"] += 1
        return system
    raise ValueError(f"python: {chosen} is not reachable by an unprivileged uid (a directory above it lacks o+x); "
                     "pass an interpreter every user can run, e.g. python='/usr/bin/python3'")


def _reachable_by_anyone(path: str) -> bool:
    parts = Path(path).parents
    return all(os.stat(d).st_mode & 0o001 for d in parts) and bool(os.stat(path).st_mode & 0o005)


def missing_layers(require: Iterable[str] = LAYERS) -> dict[str, str]:
    """Which of ``require`` this machine cannot give right now, and why (one empty run)."""
    try:
        run_python("pass", require=require)
    except SandboxUnavailable as exc:
        return exc.missing
    return {}


def userns_blockers(read=lambda name: Path("/proc/sys", *name.split(".")).read_text().strip()) -> list[str]:
    """The kernel settings that forbid unprivileged user namespaces here, each with how to allow them.

    ``read(sysctl_name)`` gives a setting's value and raises OSError where the kernel lacks it.
    """
    blockers = []
    for name, forbidding, fix in _USERNS_SETTINGS:
        with contextlib.suppress(OSError):
            if read(name) == forbidding:
                blockers.append(f"{name} = {forbidding} (allow: {fix})")
    return blockers


def _fall_back(piece: str, why: str) -> None:
    FALLBACKS[piece] += 1
    _log.warning("sandbox: running without %s (require= allows it): %s", piece, why)


def _plan(code: str, interpreter: str, limits: str, disk_mb: int, required: tuple[str, ...]) -> _Run:
    """Check the pieces the required layers need, then build the launch (bubblewrap when we have it)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        if required:
            raise BubblewrapMissing({layer: "bubblewrap (bwrap) is not installed or not on PATH"
                                     for layer in required}, _FIX_BWRAP)
        _fall_back("bubblewrap", "bwrap is not on PATH")
        return _direct(code, interpreter, limits)
    try:
        bpf: bytes | None = filter_bpf()
    except LibseccompUnavailable as exc:
        if "syscalls_filtered" in required:
            raise LibseccompMissing({"syscalls_filtered": str(exc)}, _FIX_LIBSECCOMP) from None
        _fall_back("the seccomp filter", str(exc))
        bpf = None
    return _bubblewrap(bwrap, code, interpreter, limits, disk_mb, bpf)


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, 0)  # not inheritable; pass_fds hands it to bwrap only
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _bubblewrap(bwrap: str, code: str, interpreter: str, limits: str, disk_mb: int, bpf: bytes | None) -> _Run:
    """bwrap's command line; the program, the filter and the interpreter's prefix travel as fds."""
    uid = _fresh_uid() if os.geteuid() == 0 else os.geteuid()
    fds = [_memfd("program", code.encode())]
    argv = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--as-pid-1", "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox"]
    for path in _SYSTEM_PATHS:
        if os.path.islink(path):  # e.g. /lib -> usr/lib on merged-/usr systems
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.exists(path):
            argv += ["--ro-bind", path, path]
    prefix = os.path.dirname(os.path.dirname(interpreter))
    if not (prefix == "/usr" or prefix.startswith("/usr/")):
        argv += ["--ro-bind", prefix, prefix]
    for device in _DEVICES:
        argv += ["--dev-bind", device, device]
    argv += ["--proc", "/proc", "--size", str(disk_mb << 20), "--perms", "0700", "--tmpfs", _WORKDIR,
             "--ro-bind-data", str(fds[0]), _PROGRAM]
    if bpf is not None:
        fds.append(_memfd("seccomp", bpf))
        argv += ["--seccomp", str(fds[-1])]
    argv += ["--remount-ro", "/", "--chdir", _WORKDIR, "--clearenv"]
    for name, value in _environment(_WORKDIR).items():
        argv += ["--setenv", name, value]
    argv += ["--", interpreter, "-I", "-S", "-c", _INIT_SOURCE, "{status_fd}", limits, _PROGRAM]
    layers = LAYERS if bpf is not None else tuple(layer for layer in LAYERS if layer != "syscalls_filtered")
    return _Run(argv=argv, cwd="/", uid=uid, fds=fds, layers=layers, bubblewrap=True)


def _direct(code: str, interpreter: str, limits: str) -> _Run:
    """No bubblewrap (``require=()`` only): the init and program run as the caller, in a temp dir."""
    scratch = tempfile.mkdtemp(prefix="tinker-sandbox-")
    workdir, program = os.path.join(scratch, "work"), os.path.join(scratch, "program.py")
    os.mkdir(workdir, 0o700)
    Path(program).write_text(code, encoding="utf-8")
    argv = [interpreter, "-I", "-S", "-c", _INIT_SOURCE, "{status_fd}", limits, program]
    return _Run(argv=argv, cwd=workdir, uid=os.geteuid(), fds=[], layers=(), bubblewrap=False, scratch=scratch)


def _environment(workdir: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}


def _fresh_uid() -> int:
    """A uid for one run, drawn at random from a range no system allocates. It need not be
    checked against running processes: the run sees only its own PID namespace, and its
    RLIMIT_NPROC counts only its own user namespace's processes."""
    return _UID_RANGE[0] + secrets.randbelow(_UID_RANGE[1] - _UID_RANGE[0])


class _Streams:
    """The run's pipes: capped output, the init's status lines, bwrap's JSON status."""

    def __init__(self, stdout: int, stderr: int, status: int, bwrap_json: int, cap: int):
        self.out, self.err, self.status, self.json, self.cap = stdout, stderr, status, bwrap_json, cap
        self.data = {stdout: bytearray(), stderr: bytearray()}
        self.pending = {status: bytearray(), bwrap_json: bytearray()}
        self.truncated = self.started = False
        self.wait_status: int | None = None
        self.child_pid: int | None = None
        self.sel = selectors.DefaultSelector()
        for fd in (stdout, stderr, status, bwrap_json):
            self.sel.register(fd, selectors.EVENT_READ)

    def open(self, fd: int) -> bool:
        return fd in self.sel.get_map()

    def pump(self, until: float) -> None:
        """Read whatever arrives before ``until``."""
        for key, _ in self.sel.select(max(until - time.monotonic(), 0)):
            data = os.read(key.fd, 65536)
            if not data:
                self.sel.unregister(key.fd)
            elif key.fd in self.pending:
                *lines, self.pending[key.fd] = (self.pending[key.fd] + data).split(b"\n")
                for line in lines:
                    self._line(key.fd, line)
            else:  # past the cap, keep reading: a full pipe must not stall the program
                room = max(self.cap - len(self.data[key.fd]), 0)
                self.truncated |= len(data) > room
                self.data[key.fd] += data[:room]

    def _line(self, fd: int, line: bytes) -> None:
        if fd == self.json:  # bwrap's own pipe: it reports the run's PID 1 before the program exists
            with contextlib.suppress(ValueError, AttributeError):
                if self.child_pid is None and "child-pid" in (doc := json.loads(line)):
                    self.child_pid = int(doc["child-pid"])
        elif line == b"started":
            self.started = True
        elif line.isdigit():  # the last one wins; only the init writes here before the program exists
            self.wait_status = int(line)

    def text(self, fd: int) -> str:
        return self.data[fd].decode("utf-8", "replace")


def _supervise(launch: _Run, stdin: str, timeout_s: float, cap: int) -> SandboxResult | str:
    """Launch; collect output and status until the run ends or time is up. Returns bwrap's
    stderr instead of a result when the sandbox could not be set up (no line of the program ran)."""
    status_r, status_w = os.pipe()
    json_r, json_w = os.pipe()
    argv = [str(status_w) if a == "{status_fd}" else a for a in launch.argv]
    if launch.bubblewrap:
        argv[1:1] = ["--json-status-fd", str(json_w)]
    drop = {"user": launch.uid, "group": launch.uid, "extra_groups": []} if launch.uid != os.geteuid() else {}
    with tempfile.TemporaryFile() as stdin_file, open(status_r, "rb"), open(json_r, "rb"):
        stdin_file.write(stdin.encode())
        stdin_file.seek(0)
        start = time.monotonic()
        try:
            proc = subprocess.Popen(argv, stdin=stdin_file, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={},
                                    pass_fds=(*launch.fds, status_w, json_w), start_new_session=True,
                                    cwd=launch.cwd, **drop)
        finally:
            os.close(status_w)  # else we would never see EOF on the status pipes
            os.close(json_w)
        assert proc.stdout is not None and proc.stderr is not None
        with proc.stdout, proc.stderr:
            io = _Streams(proc.stdout.fileno(), proc.stderr.fileno(), status_r, json_r, cap)
            pidfd, deadline = None, start + timeout_s
            while io.open(status_r) and time.monotonic() < deadline:  # EOF: the init and bwrap are gone
                io.pump(deadline)
                if pidfd is None and io.child_pid is not None:
                    pidfd = _pidfd_of_child(io.child_pid, proc.pid)
            timed_out = io.open(status_r)
            _shut_down(proc, pidfd, kill=timed_out, bubblewrap=launch.bubblewrap)
            drain_until = time.monotonic() + 1.0  # all dead by now: only buffered output left
            while (io.open(io.out) or io.open(io.err)) and time.monotonic() < drain_until:
                io.pump(drain_until)
            io.sel.close()
    if not io.started and not timed_out:
        return io.text(io.err) or f"bwrap exited with status {proc.returncode} and said nothing"
    exit_code = None if timed_out or io.wait_status is None else os.waitstatus_to_exitcode(io.wait_status)
    return SandboxResult(
        stdout=io.text(io.out), stderr=io.text(io.err), exit_code=exit_code, timed_out=timed_out,
        killed_signal=-exit_code if exit_code is not None and exit_code < 0 else None,
        wall_s=time.monotonic() - start, output_truncated=io.truncated,
        **{layer: layer in launch.layers for layer in LAYERS}, uid=launch.uid, pgid=proc.pid)


def _pidfd_of_child(pid: int, parent: int) -> int | None:
    """A pidfd of the run's PID 1, once it is certain that ``pid`` is bwrap's child (not reaped yet)."""
    try:
        fd = os.pidfd_open(pid)
        with open(f"/proc/{pid}/stat") as f:
            ppid = int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None  # already gone: then so is the whole namespace
    if ppid != parent:
        os.close(fd)
        return None
    return fd


def _shut_down(proc: subprocess.Popen[bytes], pidfd: int | None, *, kill: bool, bubblewrap: bool) -> None:
    """Kill whatever is left of the run and wait until its PID namespace is gone."""
    if kill and pidfd is not None:  # the namespace's PID 1: the kernel kills every process in it
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    if bubblewrap and (pidfd is not None or not kill):
        # bwrap reaps its child, then exits: killing it first would leave that child a zombie.
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5.0)
    with contextlib.suppress(ProcessLookupError):  # a backstop; without bubblewrap, the init's group
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if pidfd is not None:
        # Readable once PID 1 has exited, and its exit waits until every other process of its
        # namespace has been reaped: after this, nothing of the run is left.
        with selectors.DefaultSelector() as sel:
            sel.register(pidfd, selectors.EVENT_READ)
            if not sel.select(5.0):
                _log.error("sandbox: the run's PID 1 (pidfd %d) outlived bwrap by 5 s", pidfd)
        os.close(pidfd)


def _setup_failure(bwrap_said: str, required: tuple[str, ...]) -> SandboxUnavailable:
    """Name the piece that stopped bubblewrap from setting up the sandbox, and its fix."""
    said = " ".join(bwrap_said.split())[:500]
    if "namespace" in said or "uid map" in said or "uid_map" in said:
        blockers = userns_blockers()
        by = "; ".join(blockers) or "no kernel setting forbids them here, so an LSM or a container seccomp profile does"
        why = f"this user may not create user namespaces ({by}); bwrap said: {said}"
        fix = ("allow unprivileged user namespaces (" + "; ".join(fix for _, _, fix in _USERNS_SETTINGS)
               + "), or in a container, a seccomp profile that allows unshare and clone of user namespaces")
        return UserNamespacesForbidden({layer: why for layer in required}, fix)
    return SandboxUnavailable({layer: f"bubblewrap could not set up the sandbox: {said}" for layer in required})
