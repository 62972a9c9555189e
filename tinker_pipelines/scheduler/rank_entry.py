"""One rank of a ranked step (`ranks.launch_ranks`): `torchrun ... -m tinker_pipelines.scheduler.rank_entry COMMAND...`.

Every rank first takes its own leased device (`apply_rank_device`). Rank 0 then runs COMMAND (the
Dagster step) as its child and, when it ends, releases the followers that got no task; every other
rank follows rank 0's `ranks.run` call. A failure leaves one line in the ranks' directory.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

from tinker_pipelines.scheduler.ranks import (RANK_DEVICE_ENV, RANK_DIR_ENV, RANK_VISIBLE_ENV, follow, release,
                                              write_rank_error)

TORCHRUN_LOCAL_RANK_ENV = "TINKER_TORCHRUN_LOCAL_RANK"
"""torchrun's LOCAL_RANK, kept where a rank's LOCAL_RANK became 0 (it sees one GPU)."""


def apply_rank_device(environ: Any) -> str:
    """Point this rank at its leased device (torchrun's LOCAL_RANK-th of the step's lease); returns it.
    On a real CUDA inventory, CUDA_VISIBLE_DEVICES names that GPU alone, so cuda:0 (LOCAL_RANK 0,
    what DeepSpeed and `distributed.rank_device` take) is it; CUDA has not started here yet."""
    local = int(environ["LOCAL_RANK"])
    devices = environ["TINKER_LEASE_DEVICES"].split(",")
    if len(devices) != int(environ.get("LOCAL_WORLD_SIZE", len(devices))):
        raise RuntimeError(f"torchrun started {environ.get('LOCAL_WORLD_SIZE')} ranks for a lease of "
                           f"{len(devices)} devices ({environ['TINKER_LEASE_DEVICES']})")
    environ[RANK_DEVICE_ENV] = devices[local]
    visible = environ.get(RANK_VISIBLE_ENV)
    if visible:
        environ["CUDA_VISIBLE_DEVICES"] = json.loads(visible)[local]
        environ[TORCHRUN_LOCAL_RANK_ENV] = str(local)
        environ["LOCAL_RANK"] = "0"
    return devices[local]


def _lead(command: list[str], rank_dir: Path) -> int:
    """Rank 0: the step command as a child (torchrun's SIGTERM passed on), then release the followers."""
    child = subprocess.Popen(command)
    signal.signal(signal.SIGTERM, lambda *_: child.terminate())
    code = child.wait()
    release(rank_dir)
    if code != 0:
        write_rank_error(0, RuntimeError(f"the step process exited with code {code}"))
    return code


def main(argv: list[str]) -> int:
    rank = int(os.environ.get("RANK", "0"))
    try:
        apply_rank_device(os.environ)
        rank_dir = Path(os.environ[RANK_DIR_ENV])
        if rank == 0:
            return _lead(argv, rank_dir)
        follow(rank_dir)
        return 0
    except BaseException as e:  # noqa: BLE001 - every failure becomes the rank's one line
        if isinstance(e, SystemExit) and not e.code:
            return 0
        traceback.print_exc()
        print(write_rank_error(rank, e), file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
