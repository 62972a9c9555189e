"""No function in the library is over `MAX_LINES` lines unless a `# long: <reason>` comment on the
line above its def (or above its first decorator) says why."""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tinker_pipelines", "assets", "resources")
MAX_LINES = 80

EXCLUDED: tuple[str, ...] = ()
"""Paths (relative to the repository root, fnmatch patterns) this test does not walk: none."""


def long_functions(source: str, max_lines: int = MAX_LINES) -> list[tuple[int, str, int]]:
    """(line of the def, name, length) of each function over `max_lines` lines without a
    `# long: <reason>` comment on the line above it. A function's length runs from its first
    decorator to its last line; a nested function counts inside its parent and on its own."""
    lines = source.splitlines()
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        length = node.end_lineno - first + 1
        above = lines[first - 2].strip() if first >= 2 else ""
        reason = above[len("# long:"):].strip() if above.startswith("# long:") else ""
        if length > max_lines and not reason:
            out.append((node.lineno, node.name, length))
    return out


def library_files() -> list[Path]:
    files = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not any(fnmatch.fnmatch(rel, pattern) for pattern in EXCLUDED):
                files.append(path)
    return files


def test_no_library_function_is_long_without_a_reason():
    files = library_files()
    assert any(p.name == "sampler.py" for p in files) and len(files) > 40, "the walk found too few modules"
    offenders = [f"{p.relative_to(ROOT)}:{line} {name} ({n} lines)"
                 for p in files for line, name, n in long_functions(p.read_text())]
    assert not offenders, (f"functions over {MAX_LINES} lines: split them, or write '# long: <reason>' on the line "
                           "above the def:\n" + "\n".join(offenders))


def _function(n_lines: int, above: str = "", decorated: bool = False) -> str:
    body = "".join(f"    x{i} = {i}\n" for i in range(n_lines - 1 - decorated))
    return above + ("@staticmethod\n" if decorated else "") + "def f():\n" + body


def test_the_check_counts_lines_and_honours_only_a_written_reason():
    assert long_functions(_function(MAX_LINES)) == []
    assert long_functions(_function(MAX_LINES + 1)) == [(1, "f", MAX_LINES + 1)]
    assert long_functions(_function(MAX_LINES + 1, decorated=True)) == [(2, "f", MAX_LINES + 1)]
    assert long_functions(_function(MAX_LINES + 1, "# long: one table of cases, read top to bottom\n")) == []
    assert long_functions(_function(MAX_LINES + 1, "# long: the why\n", decorated=True)) == []
    assert long_functions(_function(MAX_LINES + 1, "# long:\n")) == [(2, "f", MAX_LINES + 1)]
    assert long_functions(_function(MAX_LINES + 1, "# long: why\n\n")) == [(3, "f", MAX_LINES + 1)]
    nested = "def outer():\n" + "".join("    " + line + "\n" for line in _function(MAX_LINES + 1).splitlines())
    assert {name for _, name, _ in long_functions(nested)} == {"outer", "f"}


def test_the_walk_covers_every_library_module():
    walked = {p.relative_to(ROOT).as_posix() for p in library_files()}
    every = {p.relative_to(ROOT).as_posix() for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    assert walked == every, sorted(every - walked)
