"""The base an adapter needs, travelling with it: SFT warm starts as registered versions.

An adapter trained after an SFT warm start is only the trained policy on *that* warm start. Its
record names the base (`base_ref`): the catalogue model it started from and, for a warm start,
the content hash of the SFT weights. The `sft` job registers each warm start as a version of
`sft_model_name(experiment)` tagged with that hash, so `resolve_base` finds the very weights an
adapter was trained on from the registry anywhere (another machine, after the SFT was re-run),
and refuses, naming the hash, when they are gone, instead of loading the adapter into another
policy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tinker_pipelines.checkpoint import CheckpointError, read_record
from tinker_pipelines.config import Config
from tinker_pipelines.models import base_identity

SFT_KIND = "sft_base"
"""`tinker.kind` tag of a registered SFT base version (and `kind` of its record)."""


class BaseMissing(RuntimeError):
    """The base an adapter was trained on is neither in the registry nor in the artifact store."""


def sft_model_name(experiment: str) -> str:
    """Registry name of an experiment's SFT warm starts: `sft-<experiment>`. Not `tinker-*`:
    the registry sensor evaluates those as adapters."""
    return f"sft-{experiment}"


def base_ref(cfg: Config, sft_record: dict[str, Any] | None = None) -> dict[str, Any]:
    """What an adapter's record says of its base: the catalogue model (`name`, `identity`) and,
    after a warm start, `sft_content_hash` (the hash in the SFT base's own record)."""
    m = cfg.model
    ref: dict[str, Any] = {"name": m.name, "identity": base_identity(m.name, m.kwargs,
                                                                     cfg.seed if m.seed is None else m.seed)}
    if cfg.sft.steps or sft_record is not None:  # None: warm-started, but the weights were never saved
        ref["sft_content_hash"] = sft_record["content_hash"] if sft_record is not None else None
    return ref


def check_same_base(record: dict[str, Any], sft_record: dict[str, Any] | None, path: str | Path) -> None:
    """Refuse (`CheckpointError`) a checkpoint trained on another warm start than the one loaded
    (`sft_record`, None: the catalogue base): the adapter would act as another policy."""
    base = record.get("base")
    if not base:  # a record that predates `base`
        return
    if "sft_content_hash" not in base:
        if sft_record is not None:
            raise CheckpointError(f"checkpoint {path} was trained on the catalogue base {base['name']!r}, "
                                  "not on an SFT warm start")
        return
    want = base["sft_content_hash"]
    if want is None:  # warm-started weights that were never saved: nothing to compare
        return
    got = sft_record.get("content_hash") if sft_record is not None else None
    if got != want:
        loaded = f"the warm start {got[:16]}" if got else "no warm start"
        raise CheckpointError(f"checkpoint {path} was trained on the SFT warm start {want[:16]}, but {loaded} is "
                              "loaded (pass the base it was trained on; bases.resolve_base finds it)")


def register_base(tracker: Any, run_id: str, experiment: str, local_dir: str | Path) -> str:
    """Register the SFT base written at `local_dir` (`Experiment.save_base`) as a version of
    `sft_model_name(experiment)`; idempotent per content hash. Returns the version."""
    record = read_record(local_dir, verify=False)  # just written; every load verifies its files
    return tracker.register_adapter(run_id, sft_model_name(experiment), local_dir, "sft_base", tags={
        "partition": experiment, "content_hash": record["content_hash"], "tinker.experiment": experiment,
        "tinker.kind": SFT_KIND, "base_model": record.get("base_model", "")})


def find_base_version(tracker: Any, experiment: str, content_hash: str):
    """The registered SFT base version of `experiment` with `content_hash`, or None."""
    from mlflow.exceptions import MlflowException

    try:
        return tracker.find_version(sft_model_name(experiment), content_hash=content_hash)
    except MlflowException:  # the registered model does not exist
        return None


def base_tags(tracker: Any, experiment: str, record: dict[str, Any]) -> dict[str, str]:
    """Registry tags naming an adapter version's base: `tinker.base` (catalogue identity) and,
    after a warm start, `tinker.base_model` / `tinker.base_version` of its registered version."""
    base = record.get("base") or {}
    tags = {"tinker.base": str(base.get("identity", ""))}
    want = base.get("sft_content_hash")
    if want:
        mv = find_base_version(tracker, experiment, want)
        tags.update({"tinker.base_model": sft_model_name(experiment),
                     "tinker.base_version": str(mv.version) if mv is not None else "unregistered"})
    return tags


def recorded_base(record: dict[str, Any], cfg: Config) -> dict[str, Any]:
    """The record's `base`; a record written before it existed says only `sft.steps` (a warm
    start of unknown hash: the store's current one is taken)."""
    return record.get("base") or base_ref(cfg)


def resolve_base(record: dict[str, Any], cfg: Config, experiment: str, cache_dir: str | Path,
                 tracker: Any = None, store: Any = None) -> tuple[str, str]:
    """(what `load_model` takes, `base_identity`) of the base the checkpoint with `record` needs.

    A catalogue base is its name. A warm start is looked up by its content hash: the registered
    version (downloaded once into `cache_dir/<hash>`), else the experiment's SFT in the artifact
    store when its hash is the same. Raises `BaseMissing` naming the hash otherwise. Only the
    records are read here: whatever loads the directory (`load_model`, `Experiment.use_base`, a
    worker) verifies its files against them, so a large base is hashed once, not twice.
    """
    base = recorded_base(record, cfg)
    if "sft_content_hash" not in base:
        return base["name"], base["identity"]
    want = base["sft_content_hash"]
    if want and tracker is not None:
        mv = find_base_version(tracker, experiment, want)
        if mv is not None:
            root = Path(cache_dir) / want
            hit = next((p for p in [root, *sorted(root.glob("*"))] if _has_base(p, want)), None)
            path = hit or tracker.download_version(sft_model_name(experiment), str(mv.version), root)
            _check_base(path, want, f"{sft_model_name(experiment)} v{mv.version}")
            return str(Path(path).resolve()), base_identity(str(path))
    key = f"{experiment}/sft"
    if store is not None and store.exists(key):
        path = store.local_dir(key)
        got = read_record(path, verify=False).get("content_hash")
        if want is None or got == want:
            return str(Path(path).resolve()), base_identity(str(path))
    where = f"registered as {sft_model_name(experiment)}" + (" or in the artifact store" if store is not None else "")
    what = f"the SFT warm start with content hash {want[:16]}" if want else "an SFT warm start"
    raise BaseMissing(f"this adapter of experiment {experiment!r} was trained on {what}, which is not {where}"
                      + (" (the warm start was re-run since?)" if want else " (materialize sft_checkpoint)"))


def _has_base(path: Path, want: str) -> bool:
    try:
        return read_record(path, verify=False).get("content_hash") == want
    except CheckpointError:
        return False


def _check_base(path: Path, want: str, what: str) -> None:
    got = read_record(path, verify=False).get("content_hash")
    if got != want:
        raise CheckpointError(f"{what} at {path} hashes to {got}, not the {want} its adapter was trained on")
