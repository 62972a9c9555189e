"""Resume after a crash: kill -9 at chosen moments (plain loop and Dagster), and the states a kill
or a user mistake leaves in an output_dir — each resumed exactly, or refused naming the cause."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from benchmarks import resume as bench
from tinker_pipelines.checkpoint import CheckpointError, atomic_directory, read_record, remove_partial
from tinker_pipelines.config import config_from_dict
from tinker_pipelines.loops.run_dir import restore_metrics
from tinker_pipelines.loops.train import Experiment, deterministic_metrics, train

CFG = {"seed": 2, "model": {"name": "tiny", "dtype": "float32"},  # fp32 whatever the CPU's bf16
       "env": {"path": "arithmetic", "kwargs": {"max_operand": 3}},
       "algorithm": {"name": "grpo", "kl_coef": 0.05},
       "training": {"iterations": 3, "learning_rate": 5e-3, "groups_per_batch": 2, "group_size": 4, "max_new_tokens": 4,
                    "stop": ["\n\n"]},  # a list in YAML, a tuple in the config: every resume here compares the two
       "sft": {"steps": 4, "batch_size": 8, "examples": 16}, "eval": {"every": 2, "num_tasks": 2}}


def cfg_at(out: Path, **over) -> object:
    data = json.loads(json.dumps(CFG))
    for dotted, v in over.items():
        if "__" not in dotted:
            data[dotted] = v
            continue
        section, field = dotted.split("__")
        data.setdefault(section, {})[field] = v
    return config_from_dict({**data, "output_dir": str(out)})


@pytest.fixture(scope="module")
def done(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("resume") / "full"
    train(cfg_at(out))
    return out


def _copy(done: Path, tmp_path: Path, keep: int) -> Path:
    """`done`'s output_dir as a kill after `keep` iterations left it (later checkpoints gone)."""
    out = tmp_path / "run"
    shutil.copytree(done, out)
    for d in sorted((out / "checkpoints").glob("iter_*"))[keep:]:
        shutil.rmtree(d)
    return out


def _lines(out: Path) -> list[dict]:
    return [deterministic_metrics(json.loads(x)) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_lost_and_torn_metric_lines_are_restored_once(done, tmp_path):
    out = _copy(done, tmp_path, keep=2)
    lines = (done / "metrics.jsonl").read_text().splitlines()
    # the kill came after iteration 1's checkpoint but before its line, which it tore mid-write
    (out / "metrics.jsonl").write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][:17])
    assert restore_metrics(out, 2) == 1
    assert [m["iteration"] for m in _lines(out)] == [-1.0, 0.0, 1.0]
    train(cfg_at(out), resume=True)
    assert _lines(out) == _lines(done)
    assert bench.same_state(out / "checkpoints/iter_00002", done / "checkpoints/iter_00002")


def test_partial_checkpoint_is_never_latest_and_a_rewrite_killed_midway_is_restored(done, tmp_path):
    out = _copy(done, tmp_path, keep=2)
    ck = out / "checkpoints"
    partial = ck / ".iter_00002.abc123"  # a write killed before its rename
    partial.mkdir()
    (partial / "adapter_model.safetensors").write_bytes(b"half")
    (ck / "iter_00002").mkdir()  # a directory without its commit marker
    os_old = ck / ".iter_00001.old"  # killed between the two renames of a rewrite of iter_00001
    (ck / "iter_00001").rename(os_old)
    train(cfg_at(out), resume=True)
    assert not partial.exists() and not os_old.exists()
    assert bench.same_state(ck / "iter_00002", done / "checkpoints/iter_00002")
    assert _lines(out) == _lines(done)


def test_remove_partial_keeps_other_hidden_files(tmp_path):
    (tmp_path / ".venv.d").mkdir()
    (tmp_path / ".iter_00000.x").mkdir()
    assert remove_partial(tmp_path, "iter_") == [tmp_path / ".iter_00000.x"]
    assert (tmp_path / ".venv.d").exists()


@pytest.mark.parametrize("damage,message", [
    (lambda d: (d / "optimizer.pt").write_bytes((d / "optimizer.pt").read_bytes()[:100]), "optimizer.pt has 100 bytes"),
    (lambda d: (d / "rng.pt").unlink(), "rng.pt is missing"),
    (lambda d: (d / "adapter_model.safetensors").write_bytes(b"x" * (d / "adapter_model.safetensors").stat().st_size),
     "adapter_model.safetensors does not match its recorded sha256"),
    (lambda d: (d / "record.json").write_text("{\"config\": "), "record.json is not valid JSON"),
])
def test_damaged_only_checkpoint_is_refused_naming_the_file(done, tmp_path, damage, message):
    out = _copy(done, tmp_path, keep=1)
    damage(out / "checkpoints/iter_00000")
    with pytest.raises(CheckpointError, match=message):
        train(cfg_at(out), resume=True)
    assert (out / "metrics.jsonl").read_text() == (done / "metrics.jsonl").read_text()  # nothing rewritten


def test_damaged_newest_checkpoint_is_skipped_and_rewritten(done, tmp_path):
    out = _copy(done, tmp_path, keep=3)
    rng = out / "checkpoints/iter_00002/rng.pt"
    rng.write_bytes(rng.read_bytes()[:-8])
    with pytest.warns(UserWarning, match="iter_00002.*rng.pt"):
        train(cfg_at(out), resume=True)
    assert bench.same_state(out / "checkpoints/iter_00002", done / "checkpoints/iter_00002")


@pytest.mark.parametrize("over,field", [
    ({"training__learning_rate": 1e-2}, "training.learning_rate"),
    ({"algorithm__name": "rloo"}, "algorithm.name"),
    ({"seed": 9}, "seed"),
])
def test_resume_with_another_config_names_the_field(done, tmp_path, over, field):
    out = _copy(done, tmp_path, keep=2)
    with pytest.raises(CheckpointError, match=f"made with another config: {field} "):
        train(cfg_at(out, **over), resume=True)


def test_resume_may_extend_iterations(done, tmp_path):
    out = _copy(done, tmp_path, keep=3)
    more = train(cfg_at(out, training__iterations=4), resume=True)
    assert [m["iteration"] for m in more] == [3.0]


def test_stop_strings_read_back_equal_from_records_params_and_settings(done, tmp_path):
    """`training.stop` is a tuple in the config and a list in YAML, JSON records and MLflow params:
    a run dir written before it became a tuple (records hold what `asdict` + JSON wrote) resumes."""
    import dataclasses

    from assets.lineage import _first_difference
    from tinker_pipelines.config import config_to_dict
    from tinker_pipelines.loops.run_dir import check_resumable, config_differences
    from tinker_pipelines.tracking.mlflow_tracker import flatten

    out = _copy(done, tmp_path, keep=2)
    cfg = cfg_at(out)
    assert cfg.training.stop == ("\n\n",)
    ckpt = out / "checkpoints/iter_00001"
    record = read_record(ckpt)
    assert record["config"]["training"]["stop"] == ["\n\n"]
    earlier = json.loads(json.dumps(dataclasses.asdict(cfg)))  # what the list-typed field wrote
    assert earlier["training"]["stop"] == ["\n\n"] and config_differences(earlier, cfg) == []
    assert check_resumable(ckpt, cfg, {**record, "config": earlier}) is not None
    assert config_to_dict(cfg)["training"]["stop"] == ["\n\n"]
    assert flatten(config_to_dict(cfg))["training.stop"] == str(["\n\n"])  # the MLflow param as logged before
    stored = json.loads(json.dumps({"config": earlier}, sort_keys=True))  # Dagster's stored experiment settings
    assert _first_difference(stored, {"config": config_to_dict(cfg)}) is None
    assert [m["iteration"] for m in train(cfg, resume=True)] == [2.0]


def test_checkpoint_of_another_model_says_so(done, tmp_path):
    out = _copy(done, tmp_path, keep=1)
    cfg = cfg_at(out, model__kwargs={"hidden_size": 48})
    exp = Experiment(cfg)
    exp.start_rl()
    with pytest.raises(CheckpointError, match="does not fit this model"):
        exp.resume(out / "checkpoints/iter_00000")


def test_fresh_run_refuses_an_old_output_dir_and_overwrite_starts_over(done, tmp_path):
    out = _copy(done, tmp_path, keep=3)
    with pytest.raises(CheckpointError, match="already holds 3 checkpoint"):
        train(cfg_at(out))
    assert len(list((out / "checkpoints").glob("iter_*"))) == 3  # nothing lost
    train(cfg_at(out, training__iterations=1), overwrite=True)
    assert [p.name for p in (out / "checkpoints").glob("iter_*")] == ["iter_00000"]
    assert read_record(out / "checkpoints/iter_00000")["iteration"] == 1


def test_overwrite_deletes_nothing_when_the_config_cannot_build_its_model(done, tmp_path, monkeypatch):
    import tinker_pipelines.loops.experiment as experiment_module

    out = _copy(done, tmp_path, keep=2)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))

    def broken(*a, **k):  # a model directory that fails to load, after every config check passed
        raise OSError("model files unreadable")

    monkeypatch.setattr(experiment_module, "load_model", broken)
    with pytest.raises(OSError, match="unreadable"):
        train(cfg_at(out, training__iterations=1), overwrite=True)
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before


def test_fresh_run_refuses_an_earlier_warm_start(done, tmp_path):
    out = _copy(done, tmp_path, keep=0)  # SFT finished, no iteration did
    assert (out / "sft").is_dir() and not list((out / "checkpoints").glob("iter_*"))
    with pytest.raises(CheckpointError, match="already holds an earlier run's warm start"):
        train(cfg_at(out))
    assert (out / "sft").is_dir()


def test_sft_base_is_verified_on_load(done, tmp_path):
    out = _copy(done, tmp_path, keep=1)
    weights = next((out / "sft").glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"sft is corrupt: {weights.name}"):
        train(cfg_at(out), resume=True)


def test_atomic_directory_failure_keeps_the_previous_version(tmp_path):
    target = tmp_path / "ck"
    with atomic_directory(target) as d:
        (d / "a").write_text("old")
    with pytest.raises(OSError):
        with atomic_directory(target) as d:
            (d / "a").write_text("new")
            raise OSError(28, "No space left on device")
    assert (target / "a").read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["ck"]


@pytest.mark.parametrize("kind,moment", [("plain", "checkpoint_write"), ("dagster", "after_checkpoint")])
@pytest.mark.e2e
def test_kill_9_and_resume_is_exact(tmp_path, kind, moment):
    """A real SIGKILL to the training process inside a checkpoint write (plain loop) and right
    after a checkpoint, before it is registered (Dagster run): the resumed run's final adapter,
    optimizer, RNG and metrics equal an uninterrupted run's, nothing is logged or registered twice,
    and for Dagster the failed run and its re-execution are both in the instance."""
    cfg = bench.PLAIN if kind == "plain" else bench.DAGSTER
    ref_out = tmp_path / "ref"
    ref = {"out": ref_out, "gaps": bench._gaps(bench._run(kind, cfg, ref_out))}
    moments = bench.PLAIN_MOMENTS if kind == "plain" else bench.DAGSTER_MOMENTS
    row = bench.trial(kind, cfg, ref, tmp_path, moments.index(moment), random.Random(1))
    assert row["moment"] == moment and row["killed"], row
    assert row["identical"] and row["duplicate_metrics"] == 0 and row["unloadable_checkpoints"] == 0, row
    assert row.get("failed_run_shown", True), row
