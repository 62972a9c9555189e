"""Eight processes registering adapter versions of one model at once, on a real sqlite MLflow
store: unique consecutive versions, no "database is locked", and one version for a partition that
all of them register at once."""

from __future__ import annotations

import logging
import multiprocessing as mp
import traceback
from pathlib import Path

WORKERS = 8
EACH = 3
MODEL = "tinker-concurrent"


class _Locked(logging.Handler):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def emit(self, record):
        text = record.getMessage()
        if "locked" in text:
            self.seen.append(text[:300])


def _checkpoint(root: Path, name: str, content: str) -> Path:
    d = root / name
    d.mkdir()
    (d / "record.json").write_text(f'{{"content_hash": "{content}"}}')
    return d


def _register(uri: str, artifacts: str, run_id: str, i: int, barrier, out) -> None:
    """One process: its own tracker; all register their own partitions at the same moment, then
    all the same partition at the same moment."""
    locked = _Locked()
    logging.getLogger().addHandler(locked)
    try:
        from tinker_pipelines.tracking import Tracker

        t = Tracker(uri, artifact_location=artifacts)
        root = Path(artifacts).parent / f"proc{i}"
        root.mkdir()
        ckpts = [_checkpoint(root, f"c{j}", f"h{i}.{j}") for j in range(EACH)]
        shared = _checkpoint(root, "shared", "hs")
        barrier.wait(timeout=180)
        own = [t.register_adapter(run_id, MODEL, c, f"adapters/p{i}_{j}",
                                  tags={"partition": f"concurrent:{i}.{j}", "content_hash": f"h{i}.{j}",
                                        "tinker.checks": "passed"})
               for j, c in enumerate(ckpts)]
        barrier.wait(timeout=180)
        same = t.register_adapter(run_id, MODEL, shared, "adapters/shared",
                                  tags={"partition": "concurrent:shared", "content_hash": "hs"})
        out.put((i, own, same, locked.seen, None))
    except BaseException:
        out.put((i, None, None, locked.seen, traceback.format_exc()))


def test_eight_processes_get_unique_consecutive_versions(tmp_path):
    from tinker_pipelines.tracking import Tracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    artifacts = str(tmp_path / "artifacts")
    t = Tracker(uri, artifact_location=artifacts)  # the store, experiment and run exist before the burst
    run_id = t.experiment_run("concurrent")
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(WORKERS), ctx.Queue()
    procs = [ctx.Process(target=_register, args=(uri, artifacts, run_id, i, barrier, out)) for i in range(WORKERS)]
    for p in procs:
        p.start()
    results = sorted((out.get(timeout=400) for _ in procs), key=lambda r: r[0])
    for p in procs:
        p.join(timeout=60)
    errors = [r[4] for r in results if r[4]]
    assert not errors, errors[0]
    assert [r[3] for r in results] == [[]] * WORKERS  # no lock error, not even one retried
    assert all(p.exitcode == 0 for p in procs)
    own = sorted(int(v) for r in results for v in r[1])
    assert own == list(range(1, WORKERS * EACH + 1))
    shared = {r[2] for r in results}
    assert len(shared) == 1 and int(shared.pop()) > WORKERS * EACH
    registered = t.client.search_model_versions(f"name = '{MODEL}'")
    tags = {mv.tags["partition"]: (mv.tags["content_hash"], int(mv.version)) for mv in registered}
    assert len(registered) == WORKERS * EACH + 1 == len(tags)  # the losers of the shared race deleted theirs
    assert {p: h for p, (h, _) in tags.items()} == {
        **{f"concurrent:{i}.{j}": f"h{i}.{j}" for i in range(WORKERS) for j in range(EACH)},
        "concurrent:shared": "hs"}
