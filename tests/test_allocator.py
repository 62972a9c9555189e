"""The allocator setting every sampling/training process takes (`tinker_pipelines.allocator`)."""

import os
import subprocess
import sys

import pytest

CODE = "from tinker_pipelines.allocator import retain_freed_memory as r; print(r(), r())"


def _run(env_value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TINKER_MALLOC"}
    if env_value is not None:
        env["TINKER_MALLOC"] = env_value
    return subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt exists on Linux only")
def test_glibc_takes_the_settings_once_per_process():
    assert _run(None) == "True True"


def test_system_keeps_the_defaults():
    assert _run("system") == "False False"
    assert _run(" System ") == "False False"
