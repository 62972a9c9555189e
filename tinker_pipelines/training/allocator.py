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

What a kept heap costs a worker that serves several clients: their calls free buffers of shapes
that the next call's cannot always reuse (one client's 256-row mixed decode, then forward_backward
calls of other lengths, small long-lived tensors allocated between them), so the heap creeps up
past what is ever live at once: under four tinker-cookbook RL runs on SmolLM2, 5.6 -> 6.2 GB
resident over four steps where `malloc_trim` would bring it back to ~1 GB, its live part. So a
worker gives its free heap back before a training cycle once the heap has grown by more than
`RELEASE_AT` since it last did (`HeapGrowth`). A heap that its own cycles keep reusing (one
client training steadily) is left alone: the pages given back would be faulted in again by the
very next cycle.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from dataclasses import dataclass

MMAP_THRESHOLD = 32 << 20
"""Allocations below this come from the heap, not a fresh mapping (glibc's largest allowed value)."""
TRIM_THRESHOLD = (1 << 31) - 1
"""Free memory at the top of the heap kept before trimming (the largest value mallopt takes)."""

ARENA_MAX = 1
"""Arenas (heaps) the process's threads share: one, the main heap the two settings above apply to."""

RELEASE_AT = 512 << 20
"""Heap growth past which `HeapGrowth` gives the free heap back (a trim walks the whole heap:
~0.3 s for 5 GB on a 2-core CPU)."""

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


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


@functools.lru_cache(maxsize=1)
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2  # glibc >= 2.33
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError):  # not glibc, or an older one
        return None
    return libc


def heap_bytes() -> int:
    """Size of glibc's heaps, free parts included (`mallinfo2().arena`; 0 where it cannot be read)."""
    libc = _libc()
    return int(libc.mallinfo2().arena) if libc is not None else 0


def release_free_memory() -> bool:
    """Give the heap's free pages back to the kernel (`malloc_trim(0)`); whether it could. Live
    memory is untouched; pages given back are faulted in again when next used."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


@dataclass
class HeapGrowth:
    """Gives the free heap back when the heap has grown by more than `grow_by` bytes since the last
    time (see the module's doc)."""

    grow_by: int = RELEASE_AT
    """Heap growth, bytes, past which the free heap is given back."""
    mark: int = 0
    """The heap's size just before it was last given back (0: never)."""

    def release_if_grown(self) -> bool:
        """Release now if the heap grew past `grow_by` since `mark`; whether it did."""
        size = heap_bytes()
        if size - self.mark <= self.grow_by or not release_free_memory():
            return False
        # The size before the trim, not after: a trim also shrinks the heap itself when its top is
        # free, and the next cycle growing it back to where it was is reuse, not growth.
        self.mark = size
        return True
