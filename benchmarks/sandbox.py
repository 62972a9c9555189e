"""The tool sandbox's cost and coverage, as root and as an unprivileged user (CPU).

    python -m benchmarks.sandbox [--runs 50]

`overhead_ms_root` / `overhead_ms_user`: the median wall time of `--runs` calls of
`run_python("print(1)")` (every layer required), as root and as uid 65534 (the latter only when
run as root: it drops to that uid from a world-readable copy, as `tests/unprivileged.py` does;
null otherwise). Goal: <= 25 ms each. `layers_user`: the layers the sandbox set up as that
user (all of `LAYERS` is the goal). `denied_calls_blocked`: how many of the denied system calls
failed with EPERM inside the sandbox, out of how many were tried (each denied name, clone with
each namespace flag, personality(PER_LINUX32)).

Last line: {"overhead_ms_root": ..., "overhead_ms_user": ..., "layers_user": [...],
"denied_calls_blocked": {"blocked": k, "tried": n}, "runs": ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import textwrap
import time

from tinker_pipelines.envs import sandbox_seccomp
from tinker_pipelines.envs.sandbox import LAYERS, run_python

_DENIED_PROGRAM = """
import ctypes, errno, json
seccomp = ctypes.CDLL("libseccomp.so.2")
seccomp.seccomp_syscall_resolve_name.restype = ctypes.c_int
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

def call(name, arg0=0):
    ctypes.set_errno(0)
    rc = libc.syscall(ctypes.c_long(seccomp.seccomp_syscall_resolve_name(name.encode())), ctypes.c_ulong(arg0),
                      *[ctypes.c_ulong(0)] * 5)
    if rc == 0 and name == "clone":
        import os; os._exit(0)
    return rc == -1 and ctypes.get_errno() == errno.EPERM

tried = [call(name) for name in NAMES] + [call("clone", flag | 17) for flag in FLAGS] + [call("personality", 8)]
print(json.dumps({"blocked": sum(tried), "tried": len(tried)}))
"""


def measure(runs: int) -> dict:
    """This process's side: the median overhead, the layers, the denied calls."""
    run_python("print(1)")  # the filter is compiled once per process: not part of a call's cost
    times_ms, layers = [], []
    for _ in range(runs):
        start = time.perf_counter()
        r = run_python("print(1)")
        times_ms.append((time.perf_counter() - start) * 1000)
        assert r.stdout == "1\n", r
        layers = [layer for layer in LAYERS if getattr(r, layer)]
    code = (f"NAMES, FLAGS = {list(sandbox_seccomp.DENIED_SYSCALLS)!r}, {list(sandbox_seccomp._CLONE_NAMESPACE_FLAGS)!r}\n"
            + textwrap.dedent(_DENIED_PROGRAM))
    denied = run_python(code)
    assert denied.exit_code == 0, denied.stderr
    return {"overhead_ms": round(statistics.median(times_ms), 2), "layers": layers,
            "denied": json.loads(denied.stdout), "uid": os.geteuid()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    mine = measure(args.runs)
    if args.measure_only:
        print(json.dumps(mine))
        return 0
    user = None
    if os.geteuid() == 0:
        from tests.unprivileged import run_as_unprivileged, world_readable_copy

        copy = world_readable_copy([])
        shutil.copytree(os.path.dirname(__file__), copy / "benchmarks", ignore=shutil.ignore_patterns("__pycache__"))
        os.chmod(copy / "benchmarks", 0o755)
        try:
            done = run_as_unprivileged(["python", "-m", "benchmarks.sandbox", "--measure-only", "--runs",
                                        str(args.runs)], copy)
        finally:
            shutil.rmtree(copy)
        if done.returncode != 0:
            print(done.stderr[-2000:], file=sys.stderr)
            return 1
        user = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"as uid {mine['uid']}: {mine['overhead_ms']} ms median, layers {mine['layers']}")
    if user:
        print(f"as uid {user['uid']}: {user['overhead_ms']} ms median, layers {user['layers']}")
    print(json.dumps({"overhead_ms_root": mine["overhead_ms"] if mine["uid"] == 0 else None,
                      "overhead_ms_user": (user or mine)["overhead_ms"] if user or mine["uid"] != 0 else None,
                      "layers_user": (user or mine)["layers"] if user or mine["uid"] != 0 else None,
                      "denied_calls_blocked": mine["denied"], "runs": args.runs}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
