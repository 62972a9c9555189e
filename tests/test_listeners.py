"""Every server the project starts listens on 127.0.0.1 only, unless told otherwise.

Each is started the way a user starts it (the commands `python -m tinker_pipelines.tracking`
prints, the worker helper), without a host option where the command allows one, so that the
tool's own default is what is checked. Then every listening TCP socket and bound UDP socket of
the whole process tree (dagster dev's webserver, daemon and code server; the worker) is read
with psutil, repeatedly while it starts, and each must be on 127.0.0.1. The worker has no TCP
listener at all: its Unix socket and key file must be open to their owner only.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.e2e  # end to end (pyproject's `e2e` marker)

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tree(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _listeners(pid: int) -> set[tuple[str, str, int, str]]:
    """(process, ip, port, kind) of every TCP listener and bound UDP socket in the tree of ``pid``."""
    found = set()
    for proc in _tree(pid):
        try:
            name, conns = " ".join(proc.cmdline()[:4]), proc.net_connections(kind="inet")
        except psutil.Error:  # exited while we looked
            continue
        for c in conns:
            if c.type == socket.SOCK_STREAM and c.status == psutil.CONN_LISTEN:
                found.add((name, c.laddr.ip, c.laddr.port, "tcp"))
            elif c.type == socket.SOCK_DGRAM and c.laddr:
                found.add((name, c.laddr.ip, c.laddr.port, "udp"))
    return found


def _stop(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):  # dagster dev ignores SIGINT
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait_s)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def _serve_and_watch(cmd: list[str], env: dict, log: Path, ready_url: str, settle_s: float = 5.0,
                     timeout_s: float = 180.0) -> set[tuple[str, str, int, str]]:
    """Start ``cmd``, collect its tree's listeners until ``ready_url`` answers and ``settle_s`` more."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "wb"),
                            start_new_session=True)
    seen: set[tuple[str, str, int, str]] = set()
    try:
        deadline, ready_at = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline and proc.poll() is None:
            seen |= _listeners(proc.pid)
            if ready_at is None:
                try:
                    with urllib.request.urlopen(ready_url, timeout=5) as r:
                        ready_at = time.monotonic() if r.status == 200 else None
                except OSError:
                    pass
            elif time.monotonic() - ready_at > settle_s:
                break
            time.sleep(0.5)
        assert ready_at is not None, f"{cmd[0]} never answered {ready_url}: {log.read_text()[-3000:]}"
    finally:
        _stop(proc)
    return seen


def _ui_commands(tmp_path: Path) -> tuple[dict, dict[str, list[str]]]:
    """The environment and the UI commands `python -m tinker_pipelines.tracking` tells a user to run."""
    env = {**os.environ, "TINKER_HOME": str(tmp_path / "tinker"), "OMP_NUM_THREADS": "1",
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    out = subprocess.run([sys.executable, "-m", "tinker_pipelines.tracking"], cwd=ROOT, env=env, check=True,
                         capture_output=True, text=True).stdout
    commands = {}
    for line in out.splitlines():
        if line.startswith("export DAGSTER_HOME="):
            env["DAGSTER_HOME"] = line.split("=", 1)[1]
        elif line.startswith("# ") and " UI:" in line:
            label, command = line[2:].split(":", 1)
            commands[label] = shlex.split(command.split("(")[0])
    return env, commands


def _without_host(cmd: list[str], port: int) -> list[str]:
    """The command with its own port and no host option: the tool's default is what gets checked."""
    assert cmd[cmd.index("-h") + 1] == "127.0.0.1"  # what users are told to run
    out, args = [], iter(cmd)
    for arg in args:
        if arg in ("-h", "-p"):
            next(args)
        else:
            out.append(arg)
    return [str(BIN / out[0]), *out[1:], "-p", str(port)]


def _assert_loopback(seen: set[tuple[str, str, int, str]], port: int) -> None:
    assert any(p == port and kind == "tcp" for _, _, p, kind in seen), f"no listener on :{port} seen: {seen}"
    elsewhere = {s for s in seen if s[1] != "127.0.0.1"}
    assert not elsewhere, f"listening beyond 127.0.0.1: {sorted(elsewhere)}"


def test_dagster_dev_listens_on_loopback_only(tmp_path):
    env, commands = _ui_commands(tmp_path)
    port = _free_port()
    cmd = _without_host(commands["Dagster UI"], port)
    assert cmd[1:4] == ["dev", "-w", "workspace.yaml"]
    seen = _serve_and_watch(cmd, env, tmp_path / "dagster.log", f"http://127.0.0.1:{port}/server_info")
    _assert_loopback(seen, port)


def test_mlflow_ui_listens_on_loopback_only(tmp_path):
    env, commands = _ui_commands(tmp_path)
    port = _free_port()
    cmd = _without_host(commands["MLflow UI"], port)
    assert cmd[1] == "ui" and "--backend-store-uri" in cmd
    cmd += ["--workers", "1"]  # uvicorn's workers share the parent's socket; fewer only start faster
    seen = _serve_and_watch(cmd, env, tmp_path / "mlflow.log", f"http://127.0.0.1:{port}/health", settle_s=2.0)
    _assert_loopback(seen, port)


def test_worker_has_no_network_listener_and_an_owner_only_socket(tmp_path):
    from tinker_pipelines.worker.client import start_worker
    from tinker_pipelines.worker.server import key_path

    address = tmp_path / "sockets" / "w.sock"
    address.parent.mkdir(mode=0o700)
    planted = tmp_path / "planted"
    key_path(address).symlink_to(planted)  # a link left at the key's path must not be written through
    address.parent.chmod(0o755)  # an existing directory keeps its mode
    proc = start_worker("tiny", address, device="cpu", extra=["--threads", "1"], log=tmp_path / "worker.log")
    try:
        tree = _tree(proc.pid)
        unix = {c.laddr for p in tree for c in p.net_connections(kind="unix")}
        assert str(address) in unix  # the socket is this process's: the checks below look at the right tree
        assert _listeners(proc.pid) == set()
        for path in (address, key_path(address)):
            mode = stat.S_IMODE(path.lstat().st_mode)
            assert mode & 0o077 == 0, f"{path} is {oct(mode)}"
            assert path.lstat().st_uid == os.geteuid()
        assert stat.S_ISSOCK(address.lstat().st_mode) and stat.S_ISREG(key_path(address).lstat().st_mode)
        assert not planted.exists()
        assert stat.S_IMODE(address.parent.stat().st_mode) == 0o755
    finally:
        _stop(proc)


def test_one_process_deepspeed_group_has_no_network_listener(tmp_path):
    """Outside torchrun the learner makes its own one-rank group; its store is a file, so the
    process listens on nothing (gloo's own pair sockets are bound to loopback)."""
    code = ("import json, os, socket, psutil\n"
            "from tinker_pipelines.training.deepspeed_learner import init_process_group\n"
            "import torch.distributed as dist\n"
            "init_process_group()\n"
            "assert dist.is_initialized() and dist.get_world_size() == 1\n"
            "conns = psutil.Process().net_connections(kind='inet')\n"
            "print(json.dumps([[c.laddr.ip, c.laddr.port, c.status] for c in conns"
            " if c.status == psutil.CONN_LISTEN or c.type == socket.SOCK_DGRAM]))\n")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    listening = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(ip.startswith("127.") or ip == "::1" for ip, _, _ in listening), listening
