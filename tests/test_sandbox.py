"""Tests for tinker_pipelines.envs.sandbox: normal runs, limits, escape attempts, denied system calls.

Every run goes through ``run()``, which also checks that the run's process group and every
process of the run (any process of its uid outside our PID namespace) is gone within 1.5x the
time limit, and requires every isolation layer this machine gives. Tests for a layer the machine
cannot provide are skipped, never passed vacuously: see ``layers``. Refusal tests take the
pieces away for real: no bwrap on PATH, a seccomp filter that forbids user namespaces, a
libseccomp that cannot be loaded. As root, ``test_the_suite_passes_as_an_unprivileged_user``
runs this whole file again as uid 65534, from a world-readable copy.
"""

from __future__ import annotations

import hashlib
import ctypes
import functools
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import shutil
import textwrap
import time
from pathlib import Path

import pytest

from tinker_pipelines.envs import sandbox_seccomp
from tinker_pipelines.envs.sandbox import LAYERS, SANDBOX_UID, SandboxResult, missing_layers, run_python, userns_blockers

REPO = Path(__file__).resolve().parents[1]


def _leftovers(uid: int) -> list[int]:
    """Processes of ``uid`` in another PID namespace than ours: what a run would leave behind."""
    ours, pids = os.readlink("/proc/self/ns/pid"), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
            uids = next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1:]
            if str(uid) in uids and os.readlink(f"/proc/{entry}/ns/pid") != ours:
                pids.append(int(entry))
        except OSError:
            continue  # exited while we looked
    return pids


@functools.cache
def machine_missing() -> dict[str, str]:
    return missing_layers()


def run(code: str, timeout_s: float = 5.0, **kwargs: object) -> SandboxResult:
    """run_python, plus the check that nothing of the run survives it."""
    kwargs.setdefault("require", [layer for layer in LAYERS if layer not in machine_missing()])
    start = time.monotonic()
    result = run_python(textwrap.dedent(code), timeout_s=timeout_s, **kwargs)  # type: ignore[arg-type]
    elapsed = time.monotonic() - start
    assert elapsed < 1.5 * timeout_s, f"run took {elapsed:.2f}s for a {timeout_s}s limit"
    with pytest.raises(ProcessLookupError):
        os.killpg(result.pgid, 0)
    assert _leftovers(result.uid) == []
    return result


@pytest.fixture(scope="module")
def layers() -> SandboxResult:
    """One probe run: which isolation layers this machine gives."""
    return run("pass")


def need(layers: SandboxResult, *any_of: str) -> None:
    if not any(getattr(layers, name) for name in any_of):
        pytest.skip(f"no {' / '.join(any_of)} on this machine")


def test_normal_code_returns_stdout_and_exit_code_0() -> None:
    r = run("print(sum(range(10)))")
    assert (r.stdout, r.stderr, r.exit_code, r.timed_out) == ("45\n", "", 0, False)
    assert r.killed_signal is None and not r.output_truncated


def test_standard_library_and_subprocesses_work() -> None:
    r = run("""
        import collections, decimal, fractions, hashlib, json, math, re, sqlite3, statistics
        import subprocess, sys
        child = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True)
        db = sqlite3.connect(":memory:")
        print(json.dumps([math.comb(5, 2), statistics.mean([1, 2, 3]), str(fractions.Fraction(1, 3)),
                          hashlib.sha256(b"").hexdigest()[:8], db.execute("select 1").fetchone()[0],
                          child.stdout.strip()]))
    """)
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout) == [10, 2, "1/3", "e3b0c442", 1, "42"]


def test_stdin_and_exit_status_are_passed_through() -> None:
    r = run("import sys\nprint(input()[::-1])\nsys.exit(3)", stdin="abc\n")
    assert (r.stdout, r.exit_code) == ("cba\n", 3)


def test_layer_flags_match_what_the_program_sees(layers: SandboxResult) -> None:
    r = run("""
        import json, os, socket
        print(json.dumps({"uid": os.getuid(), "pid": os.getpid(), "root": sorted(os.listdir("/")),
                          "nics": [name for _, name in socket.if_nameindex()]}))
    """)
    seen = json.loads(r.stdout)
    if r.uid_dropped:
        assert seen["uid"] == SANDBOX_UID and r.uid != 0
    else:
        assert seen["uid"] == os.geteuid()
    if r.pid_isolated:
        assert seen["pid"] == 2  # init is 1
    if r.network_isolated:
        assert seen["nics"] == ["lo"]
    if r.filesystem_isolated:
        assert not {"home", "tmp", "work", "opt", "mnt"} & set(seen["root"])
        assert "sandbox" in seen["root"]


def test_environment_is_clean_and_workdir_private_and_removed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINKER_SANDBOX_TEST_SECRET", "hunter2-do-not-leak")
    before = set(Path(tempfile.gettempdir()).glob("tinker-sandbox-*"))
    r = run("""
        import json, os
        open("marker.txt", "w").write("x")
        print(json.dumps({"env": dict(os.environ), "cwd": os.getcwd(), "files": os.listdir(".")}))
    """)
    seen = json.loads(r.stdout)
    assert "hunter2" not in r.stdout
    assert set(seen["env"]) == {"PATH", "HOME", "TMPDIR", "LANG"}
    assert seen["env"]["HOME"] == seen["cwd"] == seen["env"]["TMPDIR"]
    assert seen["files"] == ["marker.txt"]  # nothing of anyone else's in there
    assert set(Path(tempfile.gettempdir()).glob("tinker-sandbox-*")) - before == set()


def test_cannot_read_the_users_home(layers: SandboxResult) -> None:
    need(layers, "uid_dropped", "filesystem_isolated")
    home = Path.home() if Path.home().is_dir() else Path("/root")
    try:
        secrets = [p for p in home.iterdir() if p.is_file() and 0 < p.stat().st_size < 1 << 20]
    except OSError:  # an unprivileged user cannot list /root either
        secrets = []
    target = secrets[0] if secrets else home / "nonexistent"
    r = run(f"""
        import os
        for attempt in (lambda: os.listdir({str(home)!r}), lambda: open({str(target)!r}, "rb").read()):
            try:
                print("LEAK", attempt())
            except OSError as exc:
                print("DENIED", type(exc).__name__)
    """)
    assert r.stdout.count("DENIED") == 2 and "LEAK" not in r.stdout


def test_cannot_read_project_files(layers: SandboxResult) -> None:
    need(layers, "filesystem_isolated")  # pyproject.toml is world-readable: a uid drop alone won't do
    pyproject = REPO / "pyproject.toml"
    r = run(f"""
        try:
            print(open({str(pyproject)!r}).read())
        except OSError as exc:
            print("DENIED", type(exc).__name__)
    """)
    assert r.stdout.startswith("DENIED")
    assert pyproject.read_text().splitlines()[0] not in r.stdout


def test_cannot_write_outside_its_directory(layers: SandboxResult, tmp_path: Path) -> None:
    need(layers, "uid_dropped", "filesystem_isolated")
    world_writable = Path(tempfile.mkdtemp(prefix="sandbox-escape-"))
    world_writable.chmod(0o1777)  # like /tmp: only filesystem isolation keeps it out
    targets = [tmp_path / "escaped.txt", REPO / "sandbox-escaped.txt"]
    if layers.filesystem_isolated:
        targets.append(world_writable / "escaped.txt")
    try:
        r = run(f"""
            for path in {[str(t) for t in targets]!r}:
                try:
                    open(path, "w").write("pwned")
                    print("WROTE", path)
                except OSError as exc:
                    print("DENIED", type(exc).__name__)
        """)
        assert r.stdout.count("DENIED") == len(targets), r.stdout
        assert [t for t in targets if t.exists()] == []
    finally:
        for t in targets:
            t.unlink(missing_ok=True)
        world_writable.rmdir()


def test_cannot_connect_to_a_local_listener(layers: SandboxResult) -> None:
    need(layers, "network_isolated")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        r = run(f"""
            import socket
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=1).send(b"hello")
                print("CONNECTED")
            except OSError as exc:
                print("BLOCKED", type(exc).__name__)
        """)
        assert r.stdout.startswith("BLOCKED")
        with pytest.raises(BlockingIOError):
            listener.accept()  # no connection ever arrived


def test_cannot_reach_the_internet(layers: SandboxResult) -> None:
    need(layers, "network_isolated")
    r = run("""
        import socket
        for attempt in (lambda: socket.create_connection(("1.1.1.1", 53), timeout=1),
                        lambda: socket.getaddrinfo("example.com", 443)):
            try:
                attempt()
                print("REACHED")
            except OSError as exc:
                print("BLOCKED", type(exc).__name__)
    """)
    assert r.stdout.count("BLOCKED") == 2 and "REACHED" not in r.stdout


def test_fork_bomb_is_contained() -> None:
    r = run("""
        import os, time
        while True:
            try:
                os.fork()
            except OSError:
                time.sleep(0.01)  # keep every process alive and trying
    """, timeout_s=2.0, max_processes=16)
    assert r.timed_out and r.exit_code is None
    assert subprocess.run(["true"]).returncode == 0  # we can still start processes


def test_memory_bomb_is_contained() -> None:
    r = run("""
        hog = []
        while True:
            hog.append(bytearray(16 << 20))
    """, memory_mb=128)
    assert r.exit_code == 1 and not r.timed_out
    assert "MemoryError" in r.stderr


def test_a_huge_allocation_and_300_forks_are_refused_and_the_program_goes_on() -> None:
    r = run("""
        import os, time
        try:
            bytearray(8 << 30)
            print("ALLOCATED")
        except MemoryError:
            print("NO 8 GiB")
        children, refused = [], 0
        for _ in range(300):
            try:
                pid = os.fork()
            except BlockingIOError:
                refused += 1
                continue
            if pid == 0:
                time.sleep(0.5)
                os._exit(0)
            children.append(pid)
        for pid in children:
            os.waitpid(pid, 0)
        print(len(children) < 32, refused > 268)
    """)
    assert r.stdout == "NO 8 GiB\nTrue True\n" and r.exit_code == 0, (r.stdout, r.stderr)


def test_infinite_loop_is_killed_at_the_time_limit() -> None:
    r = run("while True:\n    pass", timeout_s=1.0)
    assert r.timed_out and r.exit_code is None and r.killed_signal is None
    assert 1.0 <= r.wall_s < 1.5


def test_cannot_kill_the_parent(layers: SandboxResult) -> None:
    need(layers, "pid_isolated")  # without it the program, as the caller's uid, could
    r = run(f"""
        import os, time
        for attempt in (lambda: os.kill({os.getpid()}, 9), lambda: os.killpg({os.getpgid(0)}, 9)):
            try:
                attempt()
                print("SENT", flush=True)
            except OSError as exc:
                print("DENIED", type(exc).__name__, flush=True)
        os.kill(os.getppid(), 9)  # the run's PID 1: the kernel drops it, as for any namespace's init
        os.kill(1, 9)
        child = os.fork()
        if child == 0:
            time.sleep(30)
            os._exit(0)
        os.kill(-1, 9)  # everything it may signal except itself: only its own child
        print("CHILD", os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
    """)
    assert "SENT" not in r.stdout and r.stdout.count("DENIED") == 2, r.stdout
    assert f"CHILD {-signal.SIGKILL}" in r.stdout and r.exit_code == 0  # its init survived and reported


def test_background_processes_do_not_outlive_the_run(layers: SandboxResult) -> None:
    need(layers, "pid_isolated")
    r = run("""
        import os, time
        if os.fork() == 0:  # a plain background sleeper
            time.sleep(60)
            os._exit(0)
        if os.fork() == 0:
            os.setsid()  # leave the process group killpg() would hit
            if os.fork() == 0:
                time.sleep(60)
            os._exit(0)
        print("main done")
    """, timeout_s=3.0)
    assert r.stdout == "main done\n" and not r.timed_out and r.exit_code == 0
    assert r.wall_s < 1.0  # ended with the main process, not at the time limit; run() saw no leftover


def reward(result: SandboxResult, expected_file: Path) -> float:
    """A reward checker: 1.0 iff the program exited cleanly and printed the expected answer."""
    expected = expected_file.read_text().strip()
    return float(result.exit_code == 0 and result.stdout.strip() == expected)


def test_exiting_early_cannot_fake_success(tmp_path: Path) -> None:
    expected = tmp_path / "expected.txt"
    expected.write_text("42\n")
    for code in ("import os\nos._exit(0)\nprint(42)", "raise SystemExit(0)\nprint(42)"):
        r = run(code)
        assert r.exit_code == 0 and r.stdout == ""
        assert reward(r, expected) == 0.0


def test_cannot_tamper_with_the_reward_checker(layers: SandboxResult, tmp_path: Path) -> None:
    need(layers, "uid_dropped", "filesystem_isolated")
    expected = tmp_path / "expected.txt"
    expected.write_text("42\n")
    checker = tmp_path / "checker.py"
    checker.write_text("def reward(stdout, expected):\n    return float(stdout.strip() == expected.strip())\n")
    expected.chmod(0o644)
    checker.chmod(0o644)
    targets = [expected, checker, Path(__file__).resolve(), REPO / "tinker_pipelines" / "envs" / "sandbox.py",
               REPO / "tinker_pipelines" / "envs" / "sandbox_init.py", REPO / "tinker_pipelines" / "envs" / "sandbox_seccomp.py"]
    before = {t: hashlib.sha256(t.read_bytes()).hexdigest() for t in targets}
    r = run(f"""
        for path in {[str(t) for t in targets]!r}:
            try:
                with open(path, "w") as f:
                    f.write("def reward(*a):\\n    return 1.0\\n" if path.endswith(".py") else "HACKED")
            except OSError:
                pass
        print("HACKED")
    """)
    assert {t: hashlib.sha256(t.read_bytes()).hexdigest() for t in targets} == before
    spec = importlib.util.spec_from_file_location("checker", checker)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    assert r.stdout == "HACKED\n" and module.reward(r.stdout, expected.read_text()) == 0.0


def test_output_is_capped() -> None:
    r = run("import sys\nsys.stdout.write('x' * 5_000_000)\nsys.stderr.write('y' * 5000)",
            max_output_bytes=1000)
    assert r.exit_code == 0 and r.output_truncated
    assert r.stdout == "x" * 1000 and r.stderr == "y" * 1000


def test_file_size_and_disk_limits(layers: SandboxResult) -> None:
    r = run("open('big', 'wb').write(b'0' * (2 << 20))", max_file_mb=1)
    assert r.exit_code == 1 and "File too large" in r.stderr
    if layers.filesystem_isolated:
        r = run("""
            for i in range(4):
                open(f"part{i}", "wb").write(b"0" * (1 << 20))
        """, max_file_mb=1, disk_mb=2)
        assert r.exit_code == 1 and "No space left on device" in r.stderr


def test_rejects_non_positive_timeout() -> None:
    with pytest.raises(ValueError):
        run_python("pass", timeout_s=0)


# --- the seccomp filter: each denied call fails with EPERM, and the program goes on ---

_CALL_EACH = """
    import ctypes, errno, json, os
    seccomp = ctypes.CDLL("libseccomp.so.2")  # only for the numbers of this architecture
    seccomp.seccomp_syscall_resolve_name.restype = ctypes.c_int
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long

    def call(name, *args):
        nr = seccomp.seccomp_syscall_resolve_name(name.encode())
        ctypes.set_errno(0)
        rc = libc.syscall(ctypes.c_long(nr), *[ctypes.c_ulong(a) for a in (*args, 0, 0, 0, 0, 0, 0)[:6]])
        if rc == 0 and name == "clone":
            os._exit(0)  # a child: only if the filter failed
        return errno.errorcode.get(ctypes.get_errno(), "?") if rc == -1 else "ok"

    out = {name: call(name) for name in NAMES}
    for flag in FLAGS:
        out[f"clone({flag:#x})"] = call("clone", flag | 17)  # | SIGCHLD
    out["personality(PER_LINUX32)"] = call("personality", 8)
    out["personality(query)"] = call("personality", 0xFFFFFFFF)
    out["clone3"] = call("clone3")
    print(json.dumps(out))
"""


def test_each_denied_call_fails_with_eperm_and_the_program_finishes(layers: SandboxResult) -> None:
    need(layers, "syscalls_filtered")
    code = (f"NAMES, FLAGS = {list(sandbox_seccomp.DENIED_SYSCALLS)!r}, {list(sandbox_seccomp._CLONE_NAMESPACE_FLAGS)!r}\n"
            + textwrap.dedent(_CALL_EACH) + "print('finished')\n")
    r = run(code)
    assert r.exit_code == 0 and r.stdout.endswith("finished\n"), r.stderr
    seen = json.loads(r.stdout.splitlines()[0])
    required = ["ptrace", "mount", "umount2", "pivot_root", "unshare", "setns", "keyctl", "add_key", "request_key",
                "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
                "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
                "process_vm_readv", "process_vm_writev"]
    assert set(required) <= set(sandbox_seccomp.DENIED_SYSCALLS)
    denied = {name: errno for name, errno in seen.items() if name not in ("personality(query)", "clone3")}
    assert denied == {name: "EPERM" for name in denied}, denied
    assert len(denied) == len(sandbox_seccomp.DENIED_SYSCALLS) + len(sandbox_seccomp._CLONE_NAMESPACE_FLAGS) + 1
    assert seen["personality(query)"] == "ok" and seen["clone3"] == "ENOSYS"  # libc falls back to clone


def test_nested_sandboxes_are_refused(layers: SandboxResult) -> None:
    need(layers, "syscalls_filtered")
    r = run("""
        import subprocess
        done = subprocess.run(["/usr/bin/unshare", "--user", "true"], capture_output=True, text=True)
        print(done.returncode != 0, "Operation not permitted" in done.stderr)
    """)
    assert r.stdout == "True True\n", (r.stdout, r.stderr)


# --- refusal: a missing piece stops the program before any of its code runs ---

def run_in_child(code: str, *, setup: str = "", env: dict[str, str] | None = None,
                 preexec=None, **kwargs: object) -> dict:
    """run_python(code, **kwargs) in a fresh interpreter: its result, or its refusal."""
    script = textwrap.dedent(f"""
        import dataclasses, json
        {setup}
        from tinker_pipelines.envs.sandbox import SandboxUnavailable, run_python
        try:
            r = run_python({code!r}, **{kwargs!r})
            print(json.dumps({{"result": dataclasses.asdict(r)}}))
        except SandboxUnavailable as exc:
            print(json.dumps({{"kind": type(exc).__name__, "missing": exc.missing, "message": str(exc)}}))
    """)
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                           cwd=REPO, env=env, preexec_fn=preexec)
    assert child.returncode == 0, child.stderr
    return json.loads(child.stdout.splitlines()[-1])


@pytest.fixture
def drop_box() -> Path:  # type: ignore[misc]
    box = Path(tempfile.mkdtemp(prefix="sandbox-refusal-"))
    box.chmod(0o1777)  # writable by any uid the program might run as
    yield box
    for child in box.iterdir():
        child.unlink()
    box.rmdir()


def _marker_code(box: Path) -> tuple[Path, str]:
    marker = box / "ran"
    return marker, f"open({str(marker)!r}, 'w').write('ran')\nprint('RAN')"


def test_without_bubblewrap_every_layer_is_refused(drop_box: Path, tmp_path: Path) -> None:
    marker, code = _marker_code(drop_box)
    no_bwrap = {"PATH": str(tmp_path)}  # an empty directory: no bwrap on PATH
    out = run_in_child(code, env=no_bwrap)
    assert out["kind"] == "BubblewrapMissing" and set(out["missing"]) == set(LAYERS), out
    assert "apt-get install bubblewrap" in out["message"] and not marker.exists()
    ran = run_in_child(code, env=no_bwrap, require=())["result"]  # opted out: it runs, so the check can fail
    assert (ran["stdout"], ran["exit_code"]) == ("RAN\n", 0) and marker.read_text() == "ran"
    assert not any(ran[layer] for layer in LAYERS)


def _forbid_user_namespaces() -> None:
    """preexec_fn: a filter like a container's that forbids new user namespaces (inherited by bwrap)."""
    lib = sandbox_seccomp._load()
    lib.seccomp_load.argtypes, lib.seccomp_load.restype = [ctypes.c_void_p], ctypes.c_int
    ctx = lib.seccomp_init(sandbox_seccomp._ACT_ALLOW)
    eperm, newuser = sandbox_seccomp._act_errno(1), 0x10000000
    for name, action, cmps in (("unshare", eperm, []), ("clone", eperm, [(newuser, newuser)]),
                               ("clone3", sandbox_seccomp._act_errno(38), [])):
        arr = (sandbox_seccomp._ArgCmp * 1)(*[sandbox_seccomp._ArgCmp(0, 7, m, v) for m, v in cmps])
        assert lib.seccomp_rule_add_array(ctx, action, lib.seccomp_syscall_resolve_name(name.encode()),
                                          len(cmps), arr) == 0
    assert lib.seccomp_load(ctx) == 0


def test_forbidden_user_namespaces_are_named(drop_box: Path) -> None:
    marker, code = _marker_code(drop_box)
    out = run_in_child(code, preexec=_forbid_user_namespaces)
    assert out["kind"] == "UserNamespacesForbidden" and set(out["missing"]) == set(LAYERS), out
    assert "may not create user namespaces" in out["message"] and "user.max_user_namespaces" in out["message"]
    assert not marker.exists()


def test_missing_libseccomp_refuses_only_the_filter(drop_box: Path) -> None:
    marker, code = _marker_code(drop_box)
    setup = "from tinker_pipelines.envs import sandbox_seccomp; sandbox_seccomp.LIBSECCOMP = 'libseccomp-absent.so.0'"
    out = run_in_child(code, setup=setup)
    assert out["kind"] == "LibseccompMissing" and list(out["missing"]) == ["syscalls_filtered"], out
    assert "libseccomp-absent.so.0" in out["message"] and not marker.exists()
    others = [layer for layer in LAYERS if layer != "syscalls_filtered"]
    ran = run_in_child("print('RAN')", setup=setup, require=others)["result"]  # the marker is outside its view
    assert (ran["stdout"], ran["exit_code"]) == ("RAN\n", 0)
    assert {layer: ran[layer] for layer in LAYERS} == {**{layer: True for layer in others}, "syscalls_filtered": False}


def test_userns_blockers_name_each_forbidding_setting() -> None:
    values = {"user.max_user_namespaces": "0", "kernel.unprivileged_userns_clone": "0",
              "kernel.apparmor_restrict_unprivileged_userns": "1"}

    def read(name: str) -> str:
        if name not in values:
            raise FileNotFoundError(name)
        return values[name]

    assert [b.split(" = ")[0] for b in userns_blockers(read)] == list(values)
    values.update({"user.max_user_namespaces": "15000", "kernel.apparmor_restrict_unprivileged_userns": "0"})
    assert userns_blockers(read) == ["kernel.unprivileged_userns_clone = 0 (allow: sysctl -w "
                                     "kernel.unprivileged_userns_clone=1)"]
    del values["kernel.unprivileged_userns_clone"]  # a kernel without Debian's patch
    assert userns_blockers(read) == []


def test_require_names_only_known_layers() -> None:
    with pytest.raises(ValueError, match="unknown layer"):
        run_python("pass", require=["seccomp"])
    assert run("print(1)", require=()).stdout == "1\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="this file is running unprivileged already")
def test_the_suite_passes_as_an_unprivileged_user() -> None:
    from tests.unprivileged import run_as_unprivileged, world_readable_copy

    copy = world_readable_copy(["test_sandbox.py"])
    try:
        done = run_as_unprivileged(["python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                                    "tests/test_sandbox.py"], copy)
    finally:
        shutil.rmtree(copy)
    summary = done.stdout.strip().splitlines()[-1]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    # Every test ran as the user, with every layer: only this one, which needs root, is skipped.
    assert "1 skipped" in summary and "failed" not in summary and "error" not in summary, done.stdout[-3000:]
    assert "running unprivileged already" in done.stdout, done.stdout[-3000:]  # the skip says why: euid != 0
