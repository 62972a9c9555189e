"""A checkpoint cannot run code: every `torch.load` in the project is `weights_only=True`, and a
malicious pickle planted in a checkpoint is refused without running — whether or not whoever
planted it also rewrote the record's hashes."""

from __future__ import annotations

import ast
import json
import os
import pickle
from pathlib import Path

import pytest

from tinker_pipelines.checkpoint import CheckpointError, file_manifest, read_record
from tinker_pipelines.config import config_from_dict
from tinker_pipelines.loops.train import train

ROOT = Path(__file__).resolve().parents[1]


class _Payload:
    """Unpickling this writes a marker file: proof that code ran."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_every_torch_load_in_the_project_is_weights_only():
    offenders = []
    for pkg in ("tinker_pipelines", "assets", "resources", "benchmarks", "scripts"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load":
                    kw = {k.arg: ast.unparse(k.value) for k in node.keywords}
                    if kw.get("weights_only") != "True":
                        offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("safety") / "run"
    train(config_from_dict({"seed": 1, "output_dir": str(out), "env": {"path": "arithmetic"},
                            "model": {"name": "tiny", "dtype": "float32"},
                            "training": {"iterations": 1, "groups_per_batch": 2, "group_size": 2,
                                         "max_new_tokens": 2},
                            "eval": {"every": 1, "num_tasks": 2}}))
    return out


@pytest.mark.parametrize("victim", ["optimizer.pt", "rng.pt"])
@pytest.mark.parametrize("rehash", [False, True], ids=["record-untouched", "record-rewritten"])
def test_planted_pickle_in_a_checkpoint_runs_nothing(run, tmp_path, victim, rehash):
    import shutil

    out = tmp_path / "run"
    shutil.copytree(run, out)
    ck = out / "checkpoints/iter_00000"
    marker = tmp_path / "pwned"
    (ck / victim).write_bytes(pickle.dumps({"optimizer": _Payload(marker), "steps": 1}))
    if rehash:  # an attacker who can write the record too: the hashes match, torch.load must still refuse
        record = json.loads((ck / "record.json").read_text())
        record["files"] = file_manifest(ck)
        (ck / "record.json").write_text(json.dumps(record))
        read_record(ck)  # the record now vouches for the planted file
    cfg = config_from_dict({**read_record(ck, verify=False)["config"], "output_dir": str(out)})
    with pytest.raises(CheckpointError, match=f"{victim} (has|does not match|holds objects)"):
        train(cfg, resume=True)
    assert not marker.exists(), "unpickling the planted file ran code"
