"""Tests for tinker_pipelines.envs.sandbox: normal runs, limits, and escape attempts.

Every run goes through ``run()``, which also checks that the run's whole process
group (and, with a private uid, every process of that uid) is gone within 1.5x
the time limit, and requires every isolation layer this machine gives. Tests for a
layer the machine cannot provide are skipped, never passed vacuously: see ``layers``.
Refusal tests take layers away for real: a child process whose capability bounding
set lacks what a layer needs.
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
import textwrap
import time
from pathlib import Path

import pytest

from tinker_pipelines.envs.sandbox import LAYERS, SandboxResult, SandboxUnavailable, missing_layers, run_python

REPO = Path(__file__).resolve().parents[1]


def _pids_of_uid(uid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue  # exited while we looked
        uids = next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1:]
        if str(uid) in uids:
            pids.append(int(entry))
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
    if result.uid_dropped:
        assert _pids_of_uid(result.uid) == []
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
        assert seen["uid"] == r.uid != 0
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
    home = Path.home()
    secrets = [p for p in home.iterdir() if p.is_file() and 0 < p.stat().st_size < 1 << 20]
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


def test_infinite_loop_is_killed_at_the_time_limit() -> None:
    r = run("while True:\n    pass", timeout_s=1.0)
    assert r.timed_out and r.exit_code is None and r.killed_signal is None
    assert 1.0 <= r.wall_s < 1.5


def test_cannot_kill_the_parent(layers: SandboxResult) -> None:
    need(layers, "uid_dropped")  # as the caller's own uid it could, and this test would die
    r = run(f"""
        import os, time
        attempts = [lambda: os.kill(os.getppid(), 9), lambda: os.kill({os.getpid()}, 9),
                    lambda: os.killpg({os.getpgid(0)}, 9), lambda: os.kill(1, 9)]
        for attempt in attempts:
            try:
                attempt()
                print("SENT", flush=True)
            except OSError as exc:
                print("DENIED", type(exc).__name__, flush=True)
        child = os.fork()
        if child == 0:
            time.sleep(30)
            os._exit(0)
        os.kill(-1, 9)  # everything this uid may signal except itself: only its own child
        print("CHILD", os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]))
    """)
    assert "SENT" not in r.stdout and r.stdout.count("DENIED") == 4, r.stdout
    assert f"CHILD {-signal.SIGKILL}" in r.stdout and r.exit_code == 0


def test_setsid_daemon_does_not_outlive_the_run(layers: SandboxResult) -> None:
    need(layers, "uid_dropped", "pid_isolated")
    r = run("""
        import os, time
        if os.fork() == 0:
            os.setsid()  # leave the process group killpg() would hit
            if os.fork() == 0:
                time.sleep(60)
            os._exit(0)
        print("main done")
    """, timeout_s=3.0)
    assert r.stdout == "main done\n" and not r.timed_out
    assert r.wall_s < 1.0  # ended with the main process, not at the time limit


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
    targets = [expected, checker, Path(__file__).resolve(), REPO / "tinker_pipelines" / "sandbox.py",
               REPO / "tinker_pipelines" / "sandbox_supervisor.py"]  # the supervisor runs as root
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


# --- refusal: a missing layer stops the program before any of its code runs ---

_CAP_SETGID, _CAP_SETUID, _CAP_SYS_ADMIN, _PR_CAPBSET_DROP = 6, 7, 21, 24
_CAPS_OF = {"uid_dropped": (_CAP_SETGID, _CAP_SETUID), "network_isolated": (_CAP_SYS_ADMIN,),
            "filesystem_isolated": (_CAP_SYS_ADMIN,), "pid_isolated": (_CAP_SYS_ADMIN,)}


def _without_caps(caps: tuple[int, ...]) -> None:
    """preexec_fn: the child (and so its sandbox supervisor) can never hold these capabilities."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in caps:
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), f"PR_CAPBSET_DROP {cap}")


def run_without(caps: tuple[int, ...], code: str, **kwargs: object) -> dict:
    """run_python(code, **kwargs) in a child without ``caps``: its result or its refusal."""
    script = textwrap.dedent(f"""
        import dataclasses, json
        from tinker_pipelines.envs.sandbox import SandboxUnavailable, run_python
        try:
            r = run_python({code!r}, **{kwargs!r})
            print(json.dumps({{"result": dataclasses.asdict(r)}}))
        except SandboxUnavailable as exc:
            print(json.dumps({{"missing": exc.missing, "message": str(exc)}}))
    """)
    preexec = functools.partial(_without_caps, caps) if os.geteuid() == 0 else None  # else: all missing
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                           cwd=REPO, preexec_fn=preexec)
    assert child.returncode == 0, child.stderr
    return json.loads(child.stdout)


@pytest.fixture
def drop_box() -> Path:  # type: ignore[misc]
    box = Path(tempfile.mkdtemp(prefix="sandbox-refusal-"))
    box.chmod(0o1777)  # writable by any uid the program might run as
    yield box
    for child in box.iterdir():
        child.unlink()
    box.rmdir()


@pytest.mark.parametrize("taken", [("uid_dropped",), ("network_isolated", "filesystem_isolated", "pid_isolated"),
                                   LAYERS], ids=["setuid", "sys_admin", "all"])
def test_a_missing_layer_is_refused_before_any_code_runs(taken: tuple[str, ...], drop_box: Path) -> None:
    caps = tuple(sorted({cap for layer in taken for cap in _CAPS_OF[layer]}))
    marker = drop_box / "ran"
    code = f"open({str(marker)!r}, 'w').write('ran')\nprint('RAN')"
    out = run_without(caps, code)
    assert "result" not in out, out
    assert set(out["missing"]) == set(taken) | set(machine_missing())
    for layer in out["missing"]:
        assert layer in out["message"] and out["missing"][layer] in out["message"]
    assert not marker.exists()
    if taken == LAYERS:  # the same program, opted out: it does run, so the marker check can fail
        ran = run_without(caps, code, require=())["result"]
        assert (ran["stdout"], ran["exit_code"]) == ("RAN\n", 0) and marker.read_text() == "ran"
        assert not any(ran[layer] for layer in LAYERS)


def test_require_names_only_known_layers() -> None:
    with pytest.raises(ValueError, match="unknown layer"):
        run_python("pass", require=["seccomp"])
    assert run("print(1)", require=()).stdout == "1\n"
