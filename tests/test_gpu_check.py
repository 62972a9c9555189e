"""`scripts/gpu_check` on a machine without CUDA: every check is reported, each fails for want of
CUDA and says so, and the script exits 1 without crashing. Its pure helpers: which test files it
runs on a GPU, how it reads pytest's summary (a skip is not a failure), how it turns `measure()`
figures into a check."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check"


def _load():
    loader = importlib.machinery.SourceFileLoader("gpu_check_script", str(SCRIPT))
    spec = importlib.util.spec_from_loader("gpu_check_script", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


gpu_check = _load()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the report of a machine without CUDA")
def test_dry_run_without_cuda_fails_every_check_for_want_of_cuda(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-dry-run"], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = [c for checks, _ in gpu_check.PARTS.values() for c in checks]
    assert list(report["checks"]) == expected
    assert report["all_ok"] is False and report["device"] == "cpu (no CUDA)"
    for name, check in report["checks"].items():
        assert check["ok"] is False and check["why"] == "no CUDA", (name, check)
    assert report["checks"]["gpu_tests"]["cpu_part"]["files"] == gpu_check.cuda_test_files()
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == report


def test_cuda_test_files_are_those_with_cuda_code():
    files = gpu_check.cuda_test_files()
    assert "tests/test_devices.py" in files and "tests/test_activation_checkpointing.py" in files
    # no CUDA code: running it on a GPU proves nothing about GPUs
    assert "tests/test_worker_batching.py" not in files and "tests/test_multi_lora_sampling.py" not in files
    assert all("torch.cuda.is_available()" in (ROOT / f).read_text() for f in files)


def test_pytest_summary_skips_are_not_failures():
    counts = gpu_check.pytest_counts("....s\n=== 12 passed, 3 skipped in 4.2s ===\n")
    assert counts == {"passed": 12, "failed": 0, "errors": 0, "skipped": 3}
    counts = gpu_check.pytest_counts("FAILED x\n== 1 failed, 10 passed, 1 skipped, 2 errors in 9s ==")
    assert counts == {"passed": 10, "failed": 1, "errors": 2, "skipped": 1}


def test_measure_figures_become_a_check_only_with_a_true_boolean():
    assert gpu_check.booleans_ok({"bf16_worker_ok": True, "gap": 0.1}, ["bf16_worker_ok", "gap"])["ok"] is True
    bad = gpu_check.booleans_ok({"bf16_worker_ok": False, "gap": 0.1}, ["bf16_worker_ok", "gap"])
    assert bad["ok"] is False and "bf16_worker_ok" in bad["why"]
    none = gpu_check.booleans_ok({"bf16_agreement_max": 0.01}, ["bf16_agreement_max"])
    assert none["ok"] is False and "no pass/fail boolean" in none["why"]


def test_leased_uuid_normalization():
    assert gpu_check.norm_uuid("GPU-5C0B-11") == gpu_check.norm_uuid("5c0b-11")
    assert gpu_check.norm_uuid(None) != gpu_check.norm_uuid("5c0b-11")
