"""Run tests again as an unprivileged user (uid 65534), as a cluster user would run them.

CI runs as root. This drops to uid 65534 with `setpriv`, from a world-readable copy of the
package and the named test files, in a private mount namespace where our interpreter is made
reachable even when it lives under a directory others cannot enter: the base interpreter (pyenv
under /root) and the venv itself (a checkout under /root, mode 0700). Over each such directory
goes a tmpfs with mode 0755, and the two trees are bound back into it; nothing else of it shows.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
UID = 65534


def _hidden_ancestor(path: Path) -> Path | None:
    """The first directory above ``path`` that others cannot enter, if any."""
    for directory in reversed(path.parents):
        if not os.stat(directory).st_mode & 0o001:
            return directory
    return None


def _reveal_lines(trees: list[Path]) -> list[str]:
    """Shell lines that make ``trees`` reachable: each is staged by a bind mount, a tmpfs covers
    every hidden directory above one (their first hidden ancestors never nest), then each is moved
    back to its own path inside it. Nested trees go with the outer one."""
    outer = [t for t in sorted(set(trees)) if not any(o != t and o in t.parents for o in trees)]
    hidden = {t: h for t in outer if (h := _hidden_ancestor(t))}
    lines = []
    for i, tree in enumerate(hidden):
        lines += [f"stage{i}=$(mktemp -d)", f"mount --bind {shlex.quote(str(tree))} \"$stage{i}\""]
    for directory in sorted(set(hidden.values())):
        lines.append(f"mount -t tmpfs -o mode=755 tmpfs {shlex.quote(str(directory))}")
    for i, tree in enumerate(hidden):
        lines += [f"mkdir -p {shlex.quote(str(tree))}", f"mount --move \"$stage{i}\" {shlex.quote(str(tree))}",
                  f"rmdir \"$stage{i}\""]
    return lines


def world_readable_copy(test_files: list[str]) -> Path:
    """The package and ``test_files`` (relative to tests/) in a new directory anyone can read."""
    copy = Path(tempfile.mkdtemp(prefix="tinker-unprivileged-"))
    shutil.copytree(REPO / "tinker_pipelines", copy / "tinker_pipelines",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", copy / "pyproject.toml")  # a project file the program must not read
    (copy / "tests").mkdir()
    for name in ["unprivileged.py", *test_files]:
        shutil.copy(REPO / "tests" / name, copy / "tests" / name)
    for directory, _, files in os.walk(copy):
        os.chmod(directory, 0o755)
        for name in files:
            os.chmod(os.path.join(directory, name), 0o644)
    return copy


def run_as_unprivileged(argv: list[str], copy: Path, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``argv`` (its first item, "python", means ours: this venv's, with its packages) as uid 65534 in ``copy``."""
    # The venv (sys.prefix) holds the packages and the interpreter's link; the link's target lies
    # in the base installation (sys.base_prefix, or wherever the link resolves to).
    base = Path(os.path.realpath(sys.executable)).parent.parent
    lines = ["set -e", *_reveal_lines([Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(), base])]
    argv = [sys.executable if argv[0] == "python" else argv[0], *argv[1:]]
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": str(copy),
           "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8"}
    lines.append(f"exec setpriv --reuid {UID} --regid {UID} --clear-groups env -i "
                 + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(argv))
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(lines)],
                          cwd=copy, capture_output=True, text=True, timeout=timeout)
