"""Alembic revision scripts parsed once by the step forkserver, not in every forked step.

Every step process opens the Dagster instance (its run, event log and schedule storages) and an
MLflow tracking store, and each of them checks its database's schema revision against the
installed package's alembic scripts: `alembic.script.ScriptDirectory` imports every revision
file of the package (about 80 modules per storage) to find the head. In a forked step that
took opening the instance from 0.027 to 0.045 s and an MLflow store from 0.021 to 0.030 s here. The scripts are installed files that do not change while the server lives, so the
server, when it preloads this module, keeps each revision file's module after its first import
and warms that cache for Dagster's and MLflow's script directories; a forked step inherits it.

Only revision files are cached (what `Script._from_path` loads); `env.py`, which runs the
migrations themselves, is imported afresh on every migration as alembic intends. Each call still
returns a new `Script` (alembic links a map's scripts to each other while building it), over the
cached module. A file is imported again when its size or modification time changed. With an
alembic whose private `Script._from_path` differs from the one this was written for, `install`
leaves alembic as it is.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

_SCRIPTS: dict[tuple[str, bool], tuple[tuple[int, int], Any]] = {}
"""(real path, sourceless) -> ((size, mtime_ns) when imported, the Script alembic built)."""
_installed = False


def install() -> bool:
    """Cache revision files' scripts in this process (idempotent). False when alembic's internals
    are not the expected ones (nothing is changed then)."""
    global _installed
    if _installed:
        return True
    from alembic.script.base import Script

    original = Script.__dict__.get("_from_path")
    if not isinstance(original, classmethod) or list(inspect.signature(original.__func__).parameters) != [
            "cls", "scriptdir", "path"]:
        return False
    load = original.__func__

    def _from_path(cls: type, scriptdir: Any, path: str | os.PathLike[str]) -> Any:
        real = str(Path(path))
        try:
            st = os.stat(real)
        except OSError:
            return load(cls, scriptdir, path)
        key, stamp = (real, bool(scriptdir.sourceless)), (st.st_size, st.st_mtime_ns)
        cached = _SCRIPTS.get(key)
        if cached is None or cached[0] != stamp:
            script = load(cls, scriptdir, path)
            _SCRIPTS[key] = cached = (stamp, script)
        script = cached[1]
        return None if script is None else cls(script.module, script.revision, script.path)

    Script._from_path = classmethod(_from_path)  # type: ignore[method-assign]
    _installed = True
    return True


def warm() -> int:
    """Import the revision files of Dagster's and MLflow's storages now; the number cached."""
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    locations = []
    try:
        from dagster._core.storage.sql import ALEMBIC_SCRIPTS_LOCATION
        locations.append(ALEMBIC_SCRIPTS_LOCATION)
    except ImportError:
        pass
    try:
        import mlflow.store
        locations.append(str(Path(mlflow.store.__file__).parent / "db_migrations"))
    except ImportError:
        pass
    for location in locations:
        config = Config()
        config.set_main_option("script_location", location)
        try:
            ScriptDirectory.from_config(config).get_heads()
        except Exception:  # a layout this does not know: the steps parse the scripts as before
            continue
    return len(_SCRIPTS)


if install():
    warm()
