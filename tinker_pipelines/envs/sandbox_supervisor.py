"""The sandbox's supervisor side: what runs in the process `sandbox.run_python` starts as
``python -I -S sandbox_supervisor.py CONFIG`` (namespaces, the init process, the chroot, limits and
the privilege drop before the program is exec'd). Standard library only: under ``-I -S`` neither
this package nor site-packages is on the path.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import signal
import sys
from typing import Any, NoReturn

_CLONE_NEWNS, _CLONE_NEWPID, _CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_PR_SET_DUMPABLE, _PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 4, 36, 38

_WORKDIR, _PROGRAM = "/sandbox", "/program.py"  # as seen from inside the chroot


def _report(fd: int, **fields: Any) -> None:
    # One short write per line: atomic on a pipe, so forked writers never interleave.
    os.write(fd, (json.dumps(fields) + "\n").encode())


def _supervisor_main(config: dict[str, Any]) -> NoReturn:
    """Enter namespaces, fork init, then reap every descendant until none is left."""
    fd, uid = config["status_fd"], config["uid"]
    os.set_inheritable(fd, False)  # the program must never hold the status pipe
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4  # variadic: pass full words
    libc.mount.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_ulong, ctypes.c_char_p]
    # Not dumpable: a same-uid program cannot open our fds via /proc or ptrace us.
    libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    # Subreaper: orphans are reparented to us, so we reap them and leave no zombies.
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    why: dict[str, str] = {}  # missing layer -> reason, checked before the program starts
    active = {}
    for flag, name, layer in ((_CLONE_NEWNET, "NEWNET", "network_isolated"),
                              (_CLONE_NEWNS, "NEWNS", "filesystem_isolated"),
                              (_CLONE_NEWPID, "NEWPID", "pid_isolated")):  # PID: for children
        active[layer] = libc.unshare(flag) == 0
        if not active[layer]:
            why[layer] = f"unshare(CLONE_{name}): {os.strerror(ctypes.get_errno())}"
    net, mnt, pidns = active["network_isolated"], active.pop("filesystem_isolated"), active["pid_isolated"]
    config["why"], config["active"] = why, active
    init_pid = os.fork()
    if init_pid == 0:
        _init_main(config, libc, mnt, pidns)
    init_alive = True

    def stop(_signum: int, _frame: object) -> None:
        if init_alive:  # killing it tears down the PID namespace, if any
            with contextlib.suppress(ProcessLookupError):
                os.kill(init_pid, signal.SIGKILL)
        _sweep_uid(uid)

    signal.signal(signal.SIGTERM, stop)
    _report(fd, net=net, pidns=pidns)
    while True:
        try:
            pid, _ = os.wait()
        except ChildProcessError:
            os._exit(0)
        if pid == init_pid:
            init_alive = False
            _sweep_uid(uid)  # the program is done: its background processes go too


def _sweep_uid(uid: int) -> None:
    """SIGKILL every process of ``uid``: kill(-1) holds the task list lock, so forks can't race it."""
    if os.geteuid() != 0:
        return
    try:
        pid = os.fork()
    except OSError:  # inside a dead PID namespace: everything there is already gone
        return
    if pid == 0:
        if _become(uid):  # never kill(-1) as root
            os.kill(-1, signal.SIGKILL)
        os._exit(0)


def _become(uid: int) -> bool:
    """Switch to ``uid`` (and gid ``uid``, no supplementary groups); False if not allowed."""
    try:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    except PermissionError:
        return False
    return os.getuid() == uid != 0


def _init_main(config: dict[str, Any], libc: ctypes.CDLL, mnt: bool, pidns: bool) -> NoReturn:
    """Build the filesystem view, start the program, report how it ended."""
    try:
        fs = mnt and _build_root(config, libc, pidns)
    except OSError as exc:
        fs = False  # a half-built root stays unused; its mounts die with our namespace
        config["why"]["filesystem_isolated"] = f"building the chroot: {exc.strerror or exc}"
    config["active"]["filesystem_isolated"] = fs
    program_pid = os.fork()
    if program_pid == 0:
        _exec_program(config, libc, fs)
    while True:
        pid, wait_status = os.wait()  # as PID 1 we also reap the program's orphans
        if pid == program_pid:
            _report(config["status_fd"], wait_status=wait_status)
            os._exit(0)


def _mount(libc: ctypes.CDLL, src: str | None, target: str, fstype: str | None,
           flags: int, data: str | None = None) -> None:
    args = [None if a is None else a.encode() for a in (src, target, fstype, data)]
    if libc.mount(*args[:3], flags, args[3]) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount {target}: {os.strerror(err)}")


def _build_root(config: dict[str, Any], libc: ctypes.CDLL, pidns: bool) -> bool:
    """Assemble the chroot under config["root"]; mounts live only in our mount namespace."""
    root, uid = config["root"], config["uid"]
    # Must come first: with shared propagation the binds below would show up on the host.
    _mount(libc, None, "/", None, _MS_REC | _MS_PRIVATE)
    # Parent dirs we create (e.g. /root for /root/.pyenv/...) are traversable, not listable.
    old_umask = os.umask(0o066)
    try:
        for path in config["binds"]:
            target = root + path
            os.makedirs(os.path.dirname(target), exist_ok=True)
            if os.path.islink(path):  # e.g. /lib -> usr/lib on merged-/usr systems
                os.symlink(os.readlink(path), target)
                continue
            if os.path.isdir(path):
                os.makedirs(target, exist_ok=True)
            else:
                open(target, "a").close()
            _mount(libc, path, target, None, _MS_BIND | _MS_REC)
            if not path.startswith("/dev/"):
                _mount(libc, None, target, None,
                       _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    finally:
        os.umask(old_umask)
    _mount(libc, "tmpfs", root + _WORKDIR, "tmpfs", _MS_NOSUID | _MS_NODEV,
           f"size={config['disk_mb']}m,mode=700,uid={uid},gid={uid}")
    if pidns:  # a fresh /proc shows only this namespace; the host's would show everything
        os.makedirs(root + "/proc", exist_ok=True)
        _mount(libc, "proc", root + "/proc", "proc", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC)
    return True


def _exec_program(config: dict[str, Any], libc: ctypes.CDLL, fs: bool) -> NoReturn:
    """Apply limits and drop privileges, then exec the interpreter on the program."""
    try:
        root, uid = config["root"], config["uid"]
        if fs:
            os.chroot(root)
            workdir, program = _WORKDIR, _PROGRAM
        else:
            workdir, program = root + _WORKDIR, root + _PROGRAM
        for name, wanted in config["rlimits"].items():
            ceiling = resource.getrlimit(limit := getattr(resource, name))[1]
            if ceiling != resource.RLIM_INFINITY:  # only root may raise a hard limit
                wanted = [min(value, ceiling) for value in wanted]
            resource.setrlimit(limit, wanted)
        euid = os.geteuid()
        dropped = uid != euid and _become(uid)
        active, why = {**config["active"], "uid_dropped": dropped}, config["why"]
        if not dropped:
            why["uid_dropped"] = (f"not root (uid {euid}): no other uid to switch to" if uid == euid
                                  else "setresuid/setresgid refused: no CAP_SETUID/CAP_SETGID")
        # The last point before the program's code runs: a missing layer stops it here.
        if refused := {layer: why.get(layer, "not set up") for layer in config["require"]
                       if not active[layer]}:
            _report(config["status_fd"], refused=refused)
            os._exit(125)
        libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
        os.chdir(workdir)
        _report(config["status_fd"], fs=fs, uid_dropped=dropped)
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir,
               "LANG": "C.UTF-8"}
        os.execve(config["python"], [config["python"], "-I", "-S", program], env)
    except BaseException as exc:  # noqa: BLE001 - any failure here must not run the program
        os.write(2, f"sandbox: could not run {config['python']} as uid {os.getuid()}: {exc!r}\n"
                 .encode())
    os._exit(126)


if __name__ == "__main__":
    _supervisor_main(json.loads(sys.argv[1]))
