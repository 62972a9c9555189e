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


RELEASE = """
import torch
from tinker_pipelines.training.allocator import HeapGrowth, retain_freed_memory
def rss_mb():
    return next(int(l.split()[1]) // 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))
assert retain_freed_memory()
growth = HeapGrowth(grow_by=256 << 20)
kept = [torch.ones(1 << 20) for _ in range(256)]  # 1 GiB in 4 MiB buffers: from the heap
del kept
before = rss_mb()
first = growth.release_if_grown()  # the heap grew by 1 GiB: given back
after = rss_mb()
again = [torch.ones(1 << 20) for _ in range(256)]  # the same buffers again fit the same heap
del again
refilled = rss_mb()
second = growth.release_if_grown()  # no growth since: left as it is
print(before, int(first), after, refilled, int(second), rss_mb())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim exists on Linux only")
def test_free_heap_goes_back_only_after_the_heap_grew():
    """Freed buffers the kept heap holds are resident until `HeapGrowth` gives them back, which it
    does when the heap has grown past its threshold, not when a heap it gave back is reused."""
    env = {k: v for k, v in os.environ.items() if k != "TINKER_MALLOC"}
    out = subprocess.run([sys.executable, "-c", RELEASE], env=env, capture_output=True, text=True, check=True).stdout
    before, first, after, refilled, second, last = (int(x) for x in out.split())
    assert first == 1 and after < before - 900, out  # the kernel got the freed GiB back
    assert refilled > after + 900, out  # reused, the pages are faulted in again
    assert second == 0 and last > refilled - 64, out  # no growth: kept


WORKER_CYCLE = """
from dataclasses import asdict
import torch
from tinker_pipelines.models import load_model, stop_token_ids
from tinker_pipelines.training.allocator import retain_freed_memory
from tinker_pipelines.training.learner import LearnerConfig
from tinker_pipelines.types import Datum
from tinker_pipelines.worker.engine import Engine, EngineConfig
def rss_mb():
    return next(int(l.split()[1]) // 1024 for l in open("/proc/self/status") if l.startswith("VmRSS"))
assert retain_freed_memory()
model, tok = load_model("tiny", seed=0)
model.requires_grad_(False)
e = Engine(model, tok.pad_token_id, stop_token_ids(tok), "tiny(seed=0)", EngineConfig(), tokenizer=tok)
e.create(1, "one", asdict(LearnerConfig(mode="lora")), seed=0, base_name="")
datums = [Datum((5, 6, 7, 8), (6, 7, 8, 9), (0.0, 1.0, 1.0, 1.0), (-1.0,) * 4, (0.0, 0.5, 0.5, 0.5))]
call = {"adapter": "one", "datums": datums, "algorithm": "grpo", "loss_cfg": {}}
assert "error" not in e.forward_backward([call])[0]
left = [torch.ones(1 << 20) for _ in range(256)]  # what another client's call freed: 1 GiB
del left
before = rss_mb()
assert "error" not in e.forward_backward([call])[0]
print(before, rss_mb())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim exists on Linux only")
def test_a_worker_training_cycle_starts_from_the_live_heap():
    """The heap other clients' calls left free is given back before a training cycle, so the
    cycle's buffers do not sit on top of it (the worker's memory under several Tinker clients)."""
    env = {k: v for k, v in os.environ.items() if k != "TINKER_MALLOC"}
    out = subprocess.run([sys.executable, "-c", WORKER_CYCLE], env=env, capture_output=True, text=True,
                         check=True).stdout
    before, after = (int(x) for x in out.split()[-2:])
    assert after < before - 900, out


def test_a_heap_the_trim_shrank_is_not_growing_when_refilled(monkeypatch):
    """glibc's trim shrinks the heap itself when its top is free (it does or not depending on what
    else is live up there): refilling it to its old size is reuse and is not given back again."""
    from tinker_pipelines.training import allocator

    heap = {"size": 1300 << 20}
    trims = []

    def trim():
        trims.append(heap["size"])
        heap["size"] = 280 << 20  # the free top went back to the kernel
        return True

    monkeypatch.setattr(allocator, "heap_bytes", lambda: heap["size"])
    monkeypatch.setattr(allocator, "release_free_memory", trim)
    growth = allocator.HeapGrowth(grow_by=256 << 20)
    assert growth.release_if_grown() and len(trims) == 1
    heap["size"] = 1300 << 20  # the same cycle again
    assert not growth.release_if_grown() and len(trims) == 1
    heap["size"] = (1300 + 300) << 20  # grew past the last peak by more than grow_by
    assert growth.release_if_grown() and len(trims) == 2
