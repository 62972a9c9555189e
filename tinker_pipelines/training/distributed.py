"""The process group DeepSpeed training runs in: `init_process_group` (torchrun's group, or a
one-process group outside torchrun), `is_main_process` (rank 0, the rank that writes files) and
`_deepspeed`, the import of deepspeed that selects its CPU accelerator on a machine without a GPU.

Which backend, which device a rank takes and whether `model.device` allows it are pure functions
(`backend_for`, `rank_device`, `accelerator_for`, `check_rank_model_device`); `set_rank_device`
applies them before a model loads (one GPU per rank: cuda:LOCAL_RANK), without importing deepspeed.
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


def accelerator_for(ds_accelerator: str | None, cuda_available: bool) -> str:
    """The device type DeepSpeed will run on: `DS_ACCELERATOR` when set, else CUDA when there is
    one (what `_deepspeed` makes DeepSpeed pick), else the CPU.

    >>> accelerator_for(None, True), accelerator_for("cpu", True), accelerator_for(None, False)
    ('cuda', 'cpu', 'cpu')
    """
    if ds_accelerator:
        return ds_accelerator
    return "cuda" if cuda_available else "cpu"


def backend_for(device_type: str) -> str:
    """The process group's backend: NCCL on CUDA, gloo on the CPU (DeepSpeed's CPU accelerator would
    ask for oneCCL, which is not installed).

    >>> backend_for("cuda"), backend_for("cpu")
    ('nccl', 'gloo')
    """
    backends = {"cuda": "nccl", "cpu": "gloo"}
    if device_type not in backends:
        raise ValueError(f"DeepSpeed training runs on 'cuda' or 'cpu', not {device_type!r} (DS_ACCELERATOR)")
    return backends[device_type]


def rank_device(local_rank: int, accelerator: str) -> torch.device:
    """The device of the rank with `local_rank` on its machine: cuda:LOCAL_RANK (one GPU per
    rank, as torchrun numbers them), or the CPU.

    >>> rank_device(1, "cuda"), rank_device(1, "cpu")
    (device(type='cuda', index=1), device(type='cpu'))
    """
    return torch.device("cuda", local_rank) if accelerator == "cuda" else torch.device("cpu")


def check_rank_model_device(requested: str, world_size: int) -> None:
    """Raise `ValueError` naming `model.device` when it pins every rank of a multi-rank run to one
    GPU ('cuda:N'): the ranks take cuda:LOCAL_RANK (`rank_device`) with 'auto' or 'cuda'.

    >>> check_rank_model_device("cuda:0", 2)
    Traceback (most recent call last):
    ...
    ValueError: model.device 'cuda:0' would put all 2 ranks on one GPU: use 'auto' or 'cuda' (each rank takes cuda:LOCAL_RANK)
    """
    if world_size > 1 and requested.startswith("cuda:"):
        raise ValueError(f"model.device {requested!r} would put all {world_size} ranks on one GPU: use 'auto' or "
                         "'cuda' (each rank takes cuda:LOCAL_RANK)")


def set_rank_device(requested: str = "auto") -> torch.device:
    """Make this rank's device (`rank_device` of torchrun's LOCAL_RANK) the current one, before the
    model loads and before anything is copied onto the GPU (the KL reference), so that 'auto'
    puts each rank on its own GPU and not every rank on cuda:0. Returns it. Does not import deepspeed."""
    check_rank_model_device(requested, int(os.environ.get("WORLD_SIZE", "1")))
    dev = rank_device(int(os.environ.get("LOCAL_RANK", "0")),
                      accelerator_for(os.environ.get("DS_ACCELERATOR"), torch.cuda.is_available()))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    return dev


def init_process_group(device: torch.device | None = None) -> torch.device:
    """Join torchrun's process group, or make a one-process group when not launched by torchrun
    (on `device`'s GPU when it is one); returns this rank's device, made current first (NCCL
    binds each rank's communicator to the current GPU). Inside a ranked Dagster step only from
    the body `scheduler.ranks.run` calls (ValueError otherwise: the other ranks would never join)."""
    from tinker_pipelines.scheduler.ranks import check_in_ranked_body

    check_in_ranked_body()
    deepspeed = _deepspeed()
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator().device_name()
    backend = backend_for(accelerator)
    if not torch.distributed.is_initialized() and "WORLD_SIZE" not in os.environ:
        local = device.index if device is not None and device.type == "cuda" and device.index is not None else 0
        os.environ["LOCAL_RANK"] = str(local)  # DeepSpeed's engine takes its device from LOCAL_RANK
    rank_dev = rank_device(int(os.environ.get("LOCAL_RANK", "0")), accelerator)
    if rank_dev.type == "cuda":
        torch.cuda.set_device(rank_dev)
    if not torch.distributed.is_initialized() and "WORLD_SIZE" not in os.environ:
        # A file store, not env:// — torch's TCPStore would listen on every interface (::) for as
        # long as the learner lives, whatever MASTER_ADDR says.
        store = Path(tempfile.mkdtemp(prefix="tinker-ds-")) / "store"
        with socket.socket() as s:  # set for DeepSpeed's environment check (no MPI discovery); nothing binds it
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.distributed.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend=backend, verbose=False)
    atexit.unregister(_destroy_process_group)  # once per process, however many learners join
    atexit.register(_destroy_process_group)
    return rank_dev


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
