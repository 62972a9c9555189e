"""Import hygiene of the Dagster side and the layer rule of the library.

- every module of `assets/` and `resources/`, and the composition root, imports on its own: in a
  fresh interpreter, each module is imported after every project module was dropped from
  `sys.modules` (third-party packages stay loaded, so the check costs one torch import, not one
  per module), so an import cycle that bites only from one entry point shows up as an ImportError;
- the project's import graph among `assets/`, `resources/` and `assets.definitions`
  (read from the source, function-level imports included) has no cycle;
- the library core has no import cycle, and (except `scheduler/`) never imports
  dagster, `assets` or `resources`, not even inside a function.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("assets", "resources", "tinker_pipelines")
DAGSTER_SIDE = ("assets", "resources")
COMPOSITION_ROOT = "assets.definitions"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def _imports(path: Path) -> set[str]:
    """Absolute names of the modules `path` imports anywhere (module level or in a function),
    skipping `if TYPE_CHECKING:` blocks; `from a import b` yields `a` and `a.b`."""
    tree = ast.parse(path.read_text(), str(path))
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    """Edges between the modules of assets/, resources/ and the composition root."""
    nodes = {_module_name(p): p for pkg in DAGSTER_SIDE for p in _files(pkg)}
    nodes[COMPOSITION_ROOT] = ROOT / "assets" / "definitions.py"
    return {name: {m for m in _imports(path) if m in nodes and m != name} for name, path in nodes.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_cycle_among_assets_resources_and_the_composition_root():
    graph = _graph()
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    # the circle this replaced: launch -> definitions -> sensors -> launch
    assert "assets.launch" not in graph["assets.sensors"]
    assert not any("assets.launch" in deps for deps in graph.values())


def test_the_cycle_check_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_library_core_never_imports_dagster_assets_or_resources():
    offenders = []
    for path in _files("tinker_pipelines"):
        rel = path.relative_to(ROOT / "tinker_pipelines").as_posix()
        if rel.startswith("scheduler/"):
            continue
        for name in _imports(path):
            if name.split(".")[0] in ("dagster", "dagster_graphql", "dagster_webserver", "assets", "resources"):
                offenders.append(f"{rel} imports {name}")
    assert not offenders, offenders


PROBE = r"""
import importlib, json, sys, traceback
project = tuple(sys.argv[1].split(","))
failures = {}
for name in sys.argv[2:]:
    for loaded in [m for m in sys.modules if m.split(".")[0] in project]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except ImportError:
        failures[name] = traceback.format_exc(limit=-4)
print(json.dumps(failures))
"""


def test_every_dagster_side_module_imports_on_its_own():
    modules = sorted({_module_name(p) for pkg in DAGSTER_SIDE for p in _files(pkg)}) + [COMPOSITION_ROOT]
    with tempfile.TemporaryDirectory(prefix="tinker-imports-") as home:
        env = {**os.environ, "TINKER_HOME": home, "DAGSTER_HOME": home, "OMP_NUM_THREADS": "1"}
        out = subprocess.run([sys.executable, "-c", PROBE, ",".join(PROJECT), *modules], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    failures = json.loads(out.stdout.strip().splitlines()[-1])
    assert not failures, "\n".join(f"{name}:\n{tb}" for name, tb in failures.items())


def test_library_core_has_no_import_cycle():
    """Function-level imports included; an edge from a module to its own package (`from
    tinker_pipelines.tracking import codec` inside the package) is not a cycle."""
    nodes = {_module_name(p): p for p in _files("tinker_pipelines")}
    graph = {n: {m for m in _imports(p) if m in nodes and m != n and not n.startswith(m + ".")}
             for n, p in nodes.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))
    # the circle this replaced: train -> dpo -> train; the stages import neither loop
    assert not graph["tinker_pipelines.loops.experiment"] & {"tinker_pipelines.loops.train", "tinker_pipelines.loops.dpo"}


def test_the_cli_loads_torch_only_after_serve_and_worker_set_the_openmp_wait_policy():
    """`tinker-pipelines serve` / `worker` must set OMP_WAIT_POLICY before libgomp starts (an idle
    OpenMP worker spinning beside the request threads stalled the endpoint 7-10x): importing the
    CLI loads no torch, and by the time `serve` runs its command the policy is PASSIVE."""
    code = ("import os, sys; os.environ.pop('OMP_WAIT_POLICY', None); import tinker_pipelines.cli as c; "
            "assert 'torch' not in sys.modules, 'cli imported torch'; "
            "rc = c.main(['serve', '--model', 'tiny', '--port', '70000']); "
            "print(rc, os.environ.get('OMP_WAIT_POLICY'), 'torch' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "PASSIVE", "False"]  # the bad port is refused before torch loads
