"""The code location, imported once by the step forkserver (`step_launch`) so forked steps skip it.

Importing a Dagster code location (its assets, resources and definitions) and resolving its
`Definitions` take ~1 s here, in every step process. The forkserver does both once, when the run
process's first step starts (this module is its first preload); each forked step then finds the
location in `sys.modules`, its repository already resolved.

The location's modules read `TINKER_*` when they are imported, so what the server imported holds
only for the environment and working directory the server started with: `refresh`, called in
each forked step with the step's own environment, directory and location, forgets those modules
when any of them differs, and the step imports them afresh, exactly as a fresh process would.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import sysconfig

LOCATION_ENV = "TINKER_STEP_PRELOAD_LOCATION"
"""JSON {"module", "working_directory"} of the code location to preload: in the environment the
server starts with, and only there (`step_launch` removes it again at once)."""

# Taken before anything else is imported: torch and mlflow add variables of their own at import
_STARTED = ({k: v for k, v in os.environ.items() if k != LOCATION_ENV}, os.getcwd())
_LOCATION: dict[str, str] | None = None
_LOADED: list[str] = []
"""Modules the preload imported that belong to the location (not third-party, not the library core)."""


def _install_dirs() -> tuple[str, ...]:
    """Where installed packages live: the interpreter's own paths, the site directories, and any
    `sys.path` entry holding a `*.dist-info` (packages installed elsewhere with `pip install
    --target` and put on PYTHONPATH, as on a bare GPU image). Forgetting such a package's modules
    in a step would import a second copy beside the one the rest of the process holds (dagster's
    config types then no longer match each other)."""
    import glob
    import site

    dirs = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs.update(getattr(site, "getsitepackages", list)())
    dirs.add(site.getusersitepackages() if hasattr(site, "getusersitepackages") else "")
    dirs.update(p for p in sys.path
                if p and os.path.isabs(p) and glob.glob(os.path.join(glob.escape(p), "*.dist-info")))
    return tuple(os.path.join(d, "") for d in dirs if d)


_LIBRARY_DIRS = _install_dirs()


def _location_module(name: str, module: object, location: str) -> bool:
    """Whether `module` (imported by the location) is the project's own: not the library core,
    which reads no environment at import, nor a module of the interpreter or an installed
    package (their submodules included, such as torch's `torch.ops` namespace objects)."""
    if name == location:
        return True
    top = name.partition(".")[0]
    if top == "tinker_pipelines":
        return False

    def own_file(m: object) -> bool:
        path = getattr(m, "__file__", None)
        if path is None:  # a namespace package: where its portions are
            path = next(iter(getattr(m, "__path__", None) or ()), None)
        return isinstance(path, str) and os.path.isabs(path) and not path.startswith(_LIBRARY_DIRS)

    return own_file(module) and (top == name or own_file(sys.modules.get(top)))


def _preload() -> None:
    global _LOCATION
    spec = os.environ.get(LOCATION_ENV)
    if not spec:
        return
    try:
        location = json.loads(spec)
        module, directory = location["module"], location.get("working_directory")
    except (ValueError, KeyError, TypeError):
        return
    _LOCATION = location
    before = set(sys.modules)
    added = bool(directory) and directory not in sys.path
    if added:
        sys.path.insert(0, directory)
    try:
        loaded = importlib.import_module(module)
        for value in list(vars(loaded).values()):
            # a Dagster `Definitions` resolves its repository once and caches it (~0.3 s a step)
            if type(value).__name__ == "Definitions" and callable(getattr(value, "get_repository_def", None)):
                value.get_repository_def()
    except Exception:  # noqa: BLE001 - the step imports it again and reports the error in its own log
        pass
    finally:
        if added:
            sys.path.remove(directory)
    _LOADED[:] = sorted(n for n in set(sys.modules) - before if _location_module(n, sys.modules[n], module))


def refresh(environ: dict[str, str], cwd: str, location: dict[str, str] | None) -> bool:
    """Forget the preloaded location unless the step runs that location in the server's
    environment and directory; True when it was forgotten (the step imports it again)."""
    if not _LOADED or (location == _LOCATION and (environ, cwd) == _STARTED):
        return False
    for name in _LOADED:
        sys.modules.pop(name, None)
    return True


def preloaded() -> list[str]:
    """The location's modules this process holds from the preload (empty in a fresh process)."""
    return [n for n in _LOADED if n in sys.modules]


_preload()
