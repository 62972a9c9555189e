"""The sandbox's seccomp filter: which system calls a sandboxed program may not make, compiled
to classic BPF with libseccomp (``libseccomp.so.2``, Debian's ``libseccomp2``) for bubblewrap's
``--seccomp FD``.

The binding is a handful of ctypes calls written here rather than a package: five functions of
a stable C API (``seccomp_init``, ``seccomp_rule_add_array``, ``seccomp_export_bpf``, ...), so a
dependency would add nothing but a second way to fail, and here a missing library is reported
as :class:`LibseccompUnavailable` when a run needs it, never at import time.
"""

from __future__ import annotations

import ctypes
import functools
import os
import tempfile

__all__ = ["DENIED_SYSCALLS", "LibseccompUnavailable", "filter_bpf"]

LIBSECCOMP = "libseccomp.so.2"
"""The shared library the filter is compiled with (a module attribute so a test can name a missing one)."""

DENIED_SYSCALLS = (
    "ptrace", "process_vm_readv", "process_vm_writev",  # reading or steering another process
    "mount", "umount2", "pivot_root", "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount",
    "fspick", "mount_setattr",  # changing the filesystem view (old and new mount APIs)
    "unshare", "setns",  # new or other namespaces (clone with namespace flags: see below)
    "keyctl", "add_key", "request_key",  # the kernel keyring
    "bpf", "perf_event_open", "userfaultfd",  # frequent sources of kernel privilege escalations
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
    "open_by_handle_at", "reboot", "swapon", "swapoff", "acct", "syslog", "quotactl",
)
"""Each fails with EPERM inside the sandbox. So does ``clone`` with any namespace flag, and
``personality`` with anything but 0 (the default) or 0xffffffff (a query). ``clone3`` fails with
ENOSYS: its flags sit behind a pointer a filter cannot read, and ENOSYS makes libc fall back to
``clone``, which is filtered."""

_CLONE_NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000,
                          0x40000000)  # NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
_ACT_ALLOW = 0x7FFF0000
_EPERM, _ENOSYS = 1, 38
_CMP_MASKED_EQ = 7


def _act_errno(errno: int) -> int:
    return 0x00050000 | (errno & 0xFFFF)  # SCMP_ACT_ERRNO(errno)


class LibseccompUnavailable(RuntimeError):
    """libseccomp could not be loaded or could not compile the filter."""


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]


def _load() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL(LIBSECCOMP, use_errno=True)
    except OSError as exc:
        raise LibseccompUnavailable(f"cannot load {LIBSECCOMP}: {exc}") from None
    lib.seccomp_init.argtypes, lib.seccomp_init.restype = [ctypes.c_uint32], ctypes.c_void_p
    lib.seccomp_release.argtypes, lib.seccomp_release.restype = [ctypes.c_void_p], None
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_syscall_resolve_name.restype = ctypes.c_int
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_ArgCmp)]
    lib.seccomp_rule_add_array.restype = ctypes.c_int
    lib.seccomp_export_bpf.argtypes, lib.seccomp_export_bpf.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_int
    return lib


def _rules() -> list[tuple[str, int, list[tuple[int, int]]]]:
    """(syscall, action, [(mask, value) on argument 0, all must hold]) for every rule."""
    rules = [(name, _act_errno(_EPERM), []) for name in DENIED_SYSCALLS]
    rules += [("clone", _act_errno(_EPERM), [(flag, flag)]) for flag in _CLONE_NAMESPACE_FLAGS]
    rules.append(("clone3", _act_errno(_ENOSYS), []))
    # personality(p) for p not in {0, 0xffffffff}: some bit is set and another clear, so some
    # cyclically adjacent pair of bits reads "1 then 0". One masked compare per pair, because
    # a rule may test an argument only once.
    for bit in range(32):
        pair = (1 << bit) | (1 << ((bit + 1) % 32))
        rules.append(("personality", _act_errno(_EPERM), [(pair, 1 << bit)]))
    return rules


@functools.cache
def filter_bpf() -> bytes:
    """The compiled filter (classic BPF for this machine's architecture), built once per process."""
    lib = _load()
    ctx = lib.seccomp_init(_ACT_ALLOW)
    if not ctx:
        raise LibseccompUnavailable("seccomp_init failed")
    try:
        for name, action, arg0 in _rules():
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:
                raise LibseccompUnavailable(f"{LIBSECCOMP} does not know the system call {name!r}")
            cmps = (_ArgCmp * max(len(arg0), 1))(*[_ArgCmp(0, _CMP_MASKED_EQ, m, v) for m, v in arg0])
            if (rc := lib.seccomp_rule_add_array(ctx, action, nr, len(arg0), cmps)) != 0:
                raise LibseccompUnavailable(f"seccomp_rule_add({name}): {os.strerror(-rc)}")
        with tempfile.TemporaryFile() as out:
            if (rc := lib.seccomp_export_bpf(ctx, out.fileno())) != 0:
                raise LibseccompUnavailable(f"seccomp_export_bpf: {os.strerror(-rc)}")
            out.seek(0)
            return out.read()
    finally:
        lib.seccomp_release(ctx)
