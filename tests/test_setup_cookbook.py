"""`scripts/setup_cookbook`: one line per step, idempotent, one `error: ...` line on failure."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "setup_cookbook"


def test_a_failed_step_is_one_error_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    p = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "COOKBOOK_VENV": str(blocker / "venv")})
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [f"error: python3 -m venv {blocker / 'venv'} failed"]


def test_rerun_on_a_complete_environment_installs_nothing():
    # scripts/setup ends with this script, so every rerun of it takes this path.
    assert (REPO / ".venv-cookbook" / "bin" / "python").exists(), "no .venv-cookbook: run scripts/setup"
    p = subprocess.run([str(SCRIPT)], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert lines[0] == "setup_cookbook: venv .venv-cookbook exists"
    assert lines[1] == "setup_cookbook: torch==2.13.0 already installed"
    assert lines[2] == "setup_cookbook: tinker==0.38.0 and tinker-cookbook==0.5.8 already installed"
    assert lines[3].startswith("setup_cookbook: recipes import; done in ") and len(lines) == 4
