"""Run tests again as an unprivileged user (uid 65534), as a cluster user would run them.

CI runs as root. This drops to uid 65534 with `setpriv`, from a world-readable copy of the
package and the named test files, in a private mount namespace where an interpreter installed
under a directory others cannot enter (pyenv under /root) is made reachable: a tmpfs with mode
0755 over that directory and the interpreter's tree bound back into it. Nothing else of it shows.
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


def _hidden_ancestor(path: Path) -> tuple[Path, Path] | None:
    """(the first directory above ``path`` that others cannot enter, its child on the way), if any."""
    parts = [path, *path.parents][::-1]
    for parent, child in zip(parts, parts[1:]):
        if not os.stat(parent).st_mode & 0o001:
            return parent, child
    return None


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
    """``argv`` (its first item, "python", means ours) as uid 65534 in ``copy``."""
    python = Path(os.path.realpath(sys.executable))
    lines = ["set -e"]
    if hidden := _hidden_ancestor(python):
        parent, child = hidden
        lines += [f"stage=$(mktemp -d)", f"mount --bind {shlex.quote(str(child))} \"$stage\"",
                  f"mount -t tmpfs -o mode=755 tmpfs {shlex.quote(str(parent))}",
                  f"mkdir -p {shlex.quote(str(child))}", f"mount --move \"$stage\" {shlex.quote(str(child))}"]
    argv = [sys.executable if argv[0] == "python" else argv[0], *argv[1:]]
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "PYTHONPATH": str(copy),
           "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8"}
    lines.append(f"exec setpriv --reuid {UID} --regid {UID} --clear-groups env -i "
                 + " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + shlex.join(argv))
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(lines)],
                          cwd=copy, capture_output=True, text=True, timeout=timeout)
