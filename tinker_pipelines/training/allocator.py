"""glibc's allocator, tuned for processes that sample and train: freed buffers stay in the heap.

By default glibc serves a large allocation with a fresh `mmap` once it passes an adaptive
threshold, gives it back with `munmap` when it is freed, and trims free memory at the top of the
heap past 128 KiB. A decode loop frees and re-allocates the same large buffers (logits,
activations, KV slices) on every step, so the kernel maps, zeroes and faults those pages in over
and over. Measured on a 2-core CPU (docs/runtime.md, "On the GPU-aware executor"): the same
1024-row rollout of the overhead benchmark's model ran 25-35% faster with freed memory kept
(1.2-1.6 s vs 1.9-2.2 s per call, two runs each way), SmolLM2 decode at 16 and 64 rows the same
within noise. The cost: a process keeps up to its peak footprint instead of shrinking between
steps (peak resident memory is unchanged).

Threads other than the main one get heaps of their own from glibc ("arenas": 64 MiB mappings
that are unmapped again whenever they empty, whatever the trim threshold), so the same rollout
run in a second thread, as a worker's compute thread runs it, paid for fresh pages again: 1.05-1.12
s per call against 0.87-0.99 s in the main thread. With every thread on the main heap
(`ARENA_MAX`) the two took the same time (0.87-0.93 s). Threads then share that heap's lock; in
these processes Python's own lock serialises nearly all allocation anyway.

`retain_freed_memory()` is called where a process starts to sample or train (`Experiment`, the
command line). `TINKER_MALLOC=system` leaves glibc's defaults. Elsewhere (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import sys

MMAP_THRESHOLD = 32 << 20
"""Allocations below this come from the heap, not a fresh mapping (glibc's largest allowed value)."""
TRIM_THRESHOLD = (1 << 31) - 1
"""Free memory at the top of the heap kept before trimming (the largest value mallopt takes)."""

ARENA_MAX = 1
"""Arenas (heaps) the process's threads share: one, the main heap the two settings above apply to."""

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc's <malloc.h>
_applied: bool | None = None


def retain_freed_memory() -> bool:
    """Keep freed buffers in the heap (once per process); whether glibc took the settings."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("TINKER_MALLOC", "").strip().lower() == "system" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = (bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
                and bool(mallopt(_M_ARENA_MAX, ARENA_MAX)))
    return _applied
