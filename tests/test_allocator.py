"""The allocator setting every sampling/training process takes (`tinker_pipelines.training.allocator`)."""

import os
import subprocess
import sys

import pytest

CODE = "from tinker_pipelines.training.allocator import retain_freed_memory as r; print(r(), r())"


def _run(env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TINKER_MALLOC"}
    if env_value is not None:
        env["TINKER_MALLOC"] = env_value
    return subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt exists on Linux only")
def test_glibc_takes_the_settings_once_per_process():
    assert _run(None) == "True True"


def test_system_keeps_the_defaults():
    assert _run("system") == "False False"
    assert _run(" System ") == "False False"


ARENAS = """
import ctypes, threading
from tinker_pipelines.training.allocator import retain_freed_memory
retain_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
def allocate():
    libc.malloc(1 << 20)
t = threading.Thread(target=allocate)
t.start(); t.join()
libc.malloc_stats()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt exists on Linux only")
@pytest.mark.parametrize("setting, arenas", [(None, 1), ("system", 2)])
def test_threads_share_the_main_heap(setting, arenas):
    """A thread's allocations come from the main heap (glibc's `malloc_stats` lists one arena),
    where the retained-memory settings apply; glibc's default gives the thread an arena of its own."""
    env = {k: v for k, v in os.environ.items() if k != "TINKER_MALLOC"}
    if setting is not None:
        env["TINKER_MALLOC"] = setting
    err = subprocess.run([sys.executable, "-c", ARENAS], env=env, capture_output=True, text=True, check=True).stderr
    assert sum(line.startswith("Arena ") for line in err.splitlines()) == arenas, err
