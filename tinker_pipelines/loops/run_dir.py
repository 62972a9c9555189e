"""An output directory across crashes: which checkpoint to resume, whether it belongs to this
config, and a `metrics.jsonl` that holds every finished iteration exactly once.

The plain loop writes `checkpoints/iter_XXXXX` (atomically, record last) and then appends the
iteration's line to `metrics.jsonl`. A kill can land between the two, or mid-line, or leave a
hidden partial checkpoint; `prepare_resume` turns any of those states back into "iterations
0..k-1 finished" before the loop goes on.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

from tinker_pipelines.checkpoint import CheckpointError, is_complete, read_record, remove_partial
from tinker_pipelines.config import Config, config_to_dict
from tinker_pipelines.tracking.mlflow_tracker import flat_fields

CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
# What a resumed run may change: how long it goes on, where it runs, and on which device.
RESUMABLE_CHANGES = ("training.iterations", "output_dir", "model.device")


def _flat_json(d: dict[str, Any]) -> dict[str, Any]:
    """Dotted names -> values as they read back from a record (tuples as lists)."""
    return flat_fields(json.loads(json.dumps(d, default=str)))


def config_differences(saved: dict[str, Any], cfg: Config) -> list[str]:
    """The fields (dotted names) where `cfg` differs from a checkpoint's recorded config,
    leaving out those a resume may change."""
    return _differences(_flat_json(saved), _flat_json(config_to_dict(cfg)))


def _differences(then: dict[str, Any], now: dict[str, Any]) -> list[str]:
    return [k for k in sorted(set(now) | set(then)) if now.get(k) != then.get(k) and k not in RESUMABLE_CHANGES
            and not any(k.startswith(p + ".") for p in RESUMABLE_CHANGES)]


def checkpoint_dirs(out: str | Path) -> list[Path]:
    """`iter_*` directories under `out/checkpoints`, oldest first (complete or not)."""
    return sorted((Path(out) / CHECKPOINTS).glob("iter_*"))


def latest_complete(out: str | Path) -> tuple[Path | None, dict[str, Any] | None, list[tuple[Path, str]]]:
    """The newest checkpoint whose files match its record, that record, and the newer ones
    that do not (partial or corrupt: never resumed from) with why; each is verified once."""
    skipped = []
    for d in reversed(checkpoint_dirs(out)):
        try:
            return d, read_record(d, verify=True), skipped
        except CheckpointError as e:
            skipped.append((d, str(e)))
    return None, None, skipped


def check_fresh(out: str | Path, base_in_use: bool = False) -> None:
    """A fresh run must not start in a directory holding an earlier run's checkpoints or
    warm-started base (`sft/`): a later `--resume` would pick them up, and overwriting them would
    lose them. `base_in_use`: `sft/` is this run's base (a worker serves it), not an earlier run's."""
    out = Path(out)
    found = sorted(p for p in (out / CHECKPOINTS).glob("*") if p.is_dir())
    if found:
        raise CheckpointError(f"output_dir {out} already holds {len(found)} checkpoint(s) of an earlier run "
                              f"({found[0].name}..{found[-1].name}): resume it (--resume), choose another "
                              f"output_dir, or start over (--overwrite deletes them)")
    if not base_in_use and (out / "sft").exists():
        raise CheckpointError(f"output_dir {out} already holds an earlier run's warm start ({out / 'sft'}): choose "
                              f"another output_dir, or start over (--overwrite deletes it)")


def clear_run(out: str | Path, keep_base: bool = False) -> None:
    """Delete an earlier run's checkpoints, metrics and warm-started base (`--overwrite`);
    `keep_base`: not the base (a worker serves it)."""
    out = Path(out)
    shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)
    if not keep_base:
        shutil.rmtree(out / "sft", ignore_errors=True)
    (out / METRICS).unlink(missing_ok=True)


def check_resumable(path: Path, cfg: Config, record: dict[str, Any] | None = None) -> dict[str, Any]:
    """The record of checkpoint `path` (read and verified unless given) after checking it was
    made with this config."""
    record = read_record(path, verify=True) if record is None else record
    then, now = _flat_json(record.get("config", {})), _flat_json(config_to_dict(cfg))
    diff = _differences(then, now)
    if diff:
        shown = ", ".join(f"{k} ({then.get(k)!r} -> {now.get(k)!r})" for k in diff[:4])
        more = f" and {len(diff) - 4} more" if len(diff) > 4 else ""
        raise CheckpointError(f"checkpoint {path} was made with another config: {shown}{more}; resume with the "
                              f"config it was made with, or start a fresh output_dir")
    return record


def _read_lines(path: Path) -> list[dict[str, Any]]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:  # a line torn by a kill mid-write
                continue
    return rows


def restore_metrics(out: str | Path, next_iteration: int) -> int:
    """Rewrite `metrics.jsonl` to hold the starting evaluation (iteration -1) and iterations
    0..next_iteration-1 once each, in order, taking any line a kill lost from that iteration's
    checkpoint record; lines of iterations after the checkpoint are dropped (they run again).
    Returns how many lines were recovered from checkpoints."""
    out = Path(out)
    log = out / METRICS
    by_it: dict[int, dict[str, Any]] = {}
    for row in _read_lines(log):
        it = int(row.get("iteration", -2))
        if -1 <= it < next_iteration:
            by_it.setdefault(it, row)
    recovered = 0
    for it in range(next_iteration):
        if it not in by_it:
            ck = out / CHECKPOINTS / f"iter_{it:05d}"
            metrics = read_record(ck, verify=False).get("metrics") if ck.is_dir() and is_complete(ck) else None
            if metrics:
                by_it[it] = metrics
                recovered += 1
    tmp = log.with_name(f".{log.name}.tmp")
    with open(tmp, "w") as f:
        for it in sorted(by_it):
            f.write(json.dumps(by_it[it], sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, log)
    return recovered


def prepare_resume(out: str | Path, cfg: Config) -> Path | None:
    """Clean up after a crash and return the checkpoint to resume from (None: nothing finished
    yet, start from the beginning). Raises `CheckpointError` when checkpoints exist but none is
    complete, or when the newest complete one was made with another config."""
    ckpt_dir = Path(out) / CHECKPOINTS
    if ckpt_dir.is_dir():
        remove_partial(ckpt_dir, "iter_")
    if Path(out).is_dir():
        remove_partial(out, "sft")
    latest, record, skipped = latest_complete(out)
    if latest is None and skipped:
        raise CheckpointError(f"no complete checkpoint in {ckpt_dir}: {', '.join(p.name for p, _ in skipped[:3])} "
                              f"failed verification ({skipped[0][1]})")
    for bad, why in skipped:  # newer than the one resumed from: the loop writes them again
        warnings.warn(f"skipping {bad}: {why}", stacklevel=2)
    if latest is None:
        return None
    check_resumable(latest, cfg, record)
    return latest


def append_metrics(path: str | Path, metrics: dict[str, float]) -> None:
    """One JSON line per iteration (keys sorted) in `metrics.jsonl`."""
    with open(path, "a") as f:
        f.write(json.dumps(metrics, sort_keys=True) + "\n")
