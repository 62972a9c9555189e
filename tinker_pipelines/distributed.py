"""The process group DeepSpeed training runs in: `init_process_group` (torchrun's group, or a
one-process group outside torchrun), `is_main_process` (rank 0, the rank that writes files) and
`_deepspeed`, the import of deepspeed that selects its CPU accelerator on a machine without a GPU.
"""

from __future__ import annotations

import atexit
import os
import socket
import tempfile
from pathlib import Path

import torch


def _deepspeed():
    """Import deepspeed; without a GPU, select its CPU accelerator first (no probing, no warning)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    return deepspeed


def init_process_group() -> None:
    """Join torchrun's process group, or make a one-process group when not launched by torchrun."""
    deepspeed = _deepspeed()
    from deepspeed.accelerator import get_accelerator

    # gloo on CPU (the CPU accelerator would ask for oneCCL, which is not installed)
    backend = "gloo" if get_accelerator().device_name() == "cpu" else get_accelerator().communication_backend_name()
    if not torch.distributed.is_initialized() and "WORLD_SIZE" not in os.environ:
        # A file store, not env:// — torch's TCPStore would listen on every interface (::) for as
        # long as the learner lives, whatever MASTER_ADDR says.
        store = Path(tempfile.mkdtemp(prefix="tinker-ds-")) / "store"
        with socket.socket() as s:  # set for DeepSpeed's environment check (no MPI discovery); nothing binds it
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.distributed.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend=backend, verbose=False)
    atexit.unregister(_destroy_process_group)  # once per process, however many learners join
    atexit.register(_destroy_process_group)


def _destroy_process_group() -> None:
    """Tear the group down while the interpreter is still whole: left to finalization, gloo's
    worker threads can outlive it and abort the process (SIGABRT, "terminate called without an
    active exception") after training has finished."""
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def is_main_process() -> bool:
    """Rank 0 of the process group (or of torchrun's environment before the group exists)."""
    if torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0
