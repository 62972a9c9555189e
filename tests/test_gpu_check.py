"""`scripts/gpu_check` and `scripts/gpu_check_wheels` on a machine without CUDA: the dry run takes
every part's code path in a process of its own (per simulated GPU for the per-device parts, with
its own CUDA_VISIBLE_DEVICES, CUDA uninitialized at its start, the measure() path without dagster);
the slots add up to the budget or the run is refused in one line; a part past its slot reads
timed out; the wheels' Requires-Dist are held against the image's versions. Its pure helpers:
which tests it runs on a GPU, how it reads pytest's summary, how it judges a lease."""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check"
WHEELS = ROOT / "scripts" / "gpu_check_wheels"


def _load(path: Path):
    loader = importlib.machinery.SourceFileLoader(path.name.replace("-", "_") + "_script", str(path))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(module)
    return module


gpu_check = _load(SCRIPT)
gpu_check_wheels = _load(WHEELS)


def _dry_args(**over) -> argparse.Namespace:
    return argparse.Namespace(**{"cpu_dry_run": True, "wheels": None, "absent": [], **over})


@pytest.mark.e2e
@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run of a machine without CUDA")
def test_dry_run_runs_each_part_in_its_own_process_per_simulated_gpu(tmp_path):
    """Two simulated GPUs: `full` runs twice at once, each process with its own
    CUDA_VISIBLE_DEVICES; `ready_device` runs measure() once, in a process without dagster."""
    env = {**os.environ, "OUT": str(tmp_path)}
    cmd = [sys.executable, str(SCRIPT), "--cpu-dry-run", "--all-gpus", "--sim-gpus", "2", "--only", "ready_device,full",
           "--budget-s", "1200", "--slot", "ready_device=600", "--slot", "full=600"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=1300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("versions: torch ") and "transformers" in lines[0] and "deepspeed" in lines[0]
    assert "cuda_driver absent" in lines[0]
    report = json.loads(lines[-1])
    assert report["mode"] == "cpu-dry-run" and report["all_ok"] is True and report["complete"] is True
    assert report["driver_imported_torch"] is False
    assert report["needs_cuda"] == ["ready_device", "full"] and not report["failed"] and not report["timed_out"]
    ready = report["checks"]["ready_device"]
    assert ready["ran_without_dagster"] is True and ready["process"]["dagster_loaded"] is False
    assert ready["process"]["cvd"] is None  # a node part sees every device
    full = report["checks"]["full_bf16"]
    assert set(full["devices"]) == {"0", "1"} and full["status"] == "pass"
    procs = [r["process"] for r in full["devices"].values()]
    assert [p["cvd"] for p in procs] == [d["cvd"] for d in report["devices"]]
    assert len({p["pid"] for p in procs}) == 2 and len({p["cvd"] for p in procs}) == 2
    assert all(p["cuda_initialized_at_start"] is False for p in procs)
    # the modules the device image lacks are hidden from the parts, as they will be missing there
    assert {"mlflow", "boto3", "gguf"} <= set(report["hidden_as_on_the_image"])
    assert not {"torch", "transformers", "peft", "dagster", "deepspeed"} & set(report["hidden_as_on_the_image"])
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == report
    log = (tmp_path / "gpu_check.log").read_text()
    assert "===== full.gpu0.log" in log and "===== full.gpu1.log" in log and "===== ready_device.log" in log


def test_the_dry_run_hides_what_the_image_lacks(tmp_path):
    """The dry run's sitecustomize answers "not found" for the image's missing modules, as the image
    would: find_spec is None (an optional import falls back), an import raises."""
    (tmp_path / "sitecustomize.py").write_text(gpu_check.HIDER)
    code = ("import importlib.util, sys; import packaging; print(importlib.util.find_spec('yaml'), "
            "importlib.util.find_spec('packaging.version') is not None)\n"
            "try:\n    import yaml.loader\nexcept ModuleNotFoundError as e:\n    print('missing', e.name)")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "GPU_CHECK_ABSENT": "yaml,nothing_else"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert proc.stdout.split() == ["None", "True", "missing", "yaml"], proc.stderr
    absent = gpu_check.absent_on_image(None)
    assert "mlflow" in absent and "boto3" in absent
    # what the image has, what the wheels carry, and what those need at this venv's versions stay
    assert not {"torch", "transformers", "peft", "dagster", "deepspeed", "yaml", "httpx"} & set(absent)


def test_without_a_gpu_only_the_dry_run_goes_on():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--only", "image"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert proc.returncode == 2 and proc.stdout.startswith("versions: ")
    assert proc.stderr.strip().splitlines() == [
        "gpu_check: NVML lists no GPU here: run it on a GPU machine, or --cpu-dry-run"]


def test_the_slots_add_up_to_the_budget(capsys):
    default = [p for p, part in gpu_check.PARTS.items() if not part.opt_in]
    dry = {p: gpu_check.PARTS[p].dry_slot_s for p in default}
    assert sum(dry.values()) <= gpu_check.DEFAULT_DRY_BUDGET_S
    slots = {p: gpu_check.PARTS[p].slot_s for p in default}
    assert sum(slots.values()) <= gpu_check.DEFAULT_BUDGET_S
    # the node parts are a call of their own (`--only node`), within the same default budget
    node = gpu_check.GROUPS["node"]
    assert all(gpu_check.PARTS[p].opt_in for p in node) and not set(node) & set(default)
    assert sum(gpu_check.PARTS[p].slot_s for p in node) <= gpu_check.DEFAULT_BUDGET_S
    assert sum(gpu_check.PARTS[p].dry_slot_s for p in node) <= gpu_check.DEFAULT_DRY_BUDGET_S
    assert gpu_check.budget_refusal({p: float(s) for p, s in slots.items()}, gpu_check.DEFAULT_BUDGET_S) is None
    # the device tool's 600 s per command holds the GPU run and the wheels' install beside it
    assert gpu_check.DEFAULT_BUDGET_S <= 550
    # a longer slot for one part: refused before any part runs, one line naming every part and its slot
    assert gpu_check.main(["--slot", "multi_lora=400"]) == 2
    out, err = capsys.readouterr()
    assert out.startswith("versions: ") and len(err.strip().splitlines()) == 1
    total = sum(slots.values()) - slots["multi_lora"] + 400
    assert f"add up to {total} s, over --budget-s {gpu_check.DEFAULT_BUDGET_S}" in err
    assert all(f"{p} {400 if p == 'multi_lora' else s}" in err for p, s in slots.items())
    assert gpu_check.main(["--cpu-dry-run", "--budget-s", "600"]) == 2
    assert f"add up to {sum(dry.values())} s, over --budget-s 600 (image {dry['image']}," in capsys.readouterr().err
    # fewer parts fit a smaller budget; an unknown part or a bad slot names the flag
    assert gpu_check.budget_refusal({"image": 40.0, "full": 35.0}, 75) is None
    assert "add up to 75 s, over --budget-s 74 (image 40, full 35)" in gpu_check.budget_refusal(
        {"image": 40.0, "full": 35.0}, 74)
    for bad, message in ((["--slot", "nope=3"], "--slot nope=3: unknown part 'nope'"),
                         (["--slot", "full=x"], "--slot full=x: seconds must be a positive number"),
                         (["--only", "image,nope"], "--only: unknown part(s) nope")):
        with pytest.raises(SystemExit):
            gpu_check.main(bad)
        assert message in capsys.readouterr().err


def test_a_part_past_its_slot_reads_timed_out_not_failed(tmp_path):
    res = gpu_check.run_part("image", _dry_args(), 0.5, [None], tmp_path)
    assert set(res) == {"signatures", "wheel_constraints"}
    for r in res.values():
        assert r["ok"] is False and r["status"] == "timed_out" and "ran past its 0.5 s slot" in r["why"]


def test_per_device_results_are_checked_against_their_gpu():
    t0, t1 = gpu_check.Target("0", "GPU-aaa", "GPU-aaa"), gpu_check.Target("1", "GPU-bbb", "GPU-bbb")

    def result(cvd, initialized=False, on_gpu=True, status="pass"):
        return {"full_bf16": {"ok": status == "pass", "status": status},
                "_proc": {"pid": 1, "cvd": cvd, "cuda_initialized_at_start": initialized, "on_expected_gpu": on_gpu}}

    good = gpu_check.merge_targets("full", [(t0, result("GPU-aaa")), (t1, result("GPU-bbb"))])["full_bf16"]
    assert good["ok"] is True and good["status"] == "pass" and set(good["devices"]) == {"0", "1"}
    crossed = gpu_check.merge_targets("full", [(t0, result("GPU-bbb")), (t1, result("GPU-bbb", on_gpu=False))])
    r = crossed["full_bf16"]
    assert r["ok"] is False and r["status"] == "fail"
    assert "CUDA_VISIBLE_DEVICES was 'GPU-bbb', not 'GPU-aaa'" in r["why"] and "gpu 1: it ran on" in r["why"]
    early = gpu_check.merge_targets("full", [(t0, result("GPU-aaa", initialized=True))])["full_bf16"]
    assert early["ok"] is False and "CUDA was initialized before the part began" in early["why"] and early["gpu"] == "0"
    slow = gpu_check.merge_targets("full", [(t0, result("GPU-aaa")), (t1, result("GPU-bbb", status="timed_out"))])
    assert slow["full_bf16"]["status"] == "timed_out"


def test_lease_judgement():
    from tinker_pipelines.scheduler.inventory import Inventory

    gpus = Inventory.from_dict({"devices": [{"kind": "cuda", "memory_gb": 80, "name": f"H100 {u}", "uuid": u,
                                             "visible": u} for u in ("GPU-aa11", "GPU-bb22")]})

    def step(lease, cvd, uuid, initialized=False):
        return {"lease_devices": lease, "cuda_visible_devices": cvd, "uuid": uuid,
                "cuda_initialized_at_start": initialized}

    right = [step("0", "GPU-aa11", "aa11"), step("1", "GPU-bb22", "bb22")] * 2
    assert gpu_check.judge_lease(right, gpus, cuda=True)["ok"] is True
    for wrong in (step("0", "GPU-aa11", "bb22"), step("0", "GPU-bb22", "aa11"), step("0", "GPU-aa11", "aa11", True),
                  step(None, None, "aa11"), step("0", "GPU-aa11", None)):
        verdict = gpu_check.judge_lease(right[:3] + [wrong], gpus, cuda=True)
        assert verdict["ok"] is False and verdict["why"].startswith("1 of 4 steps"), wrong
    assert gpu_check.judge_lease(right[:3], gpus, cuda=True)["why"] == "3 steps, not 4"
    # the dry run's simulated devices: no UUID to compare, CUDA still must be uninitialized
    sim = Inventory.from_config({"count": 2, "memory_gb": 80})
    dry = [step("0", None, None), step("1", None, None)] * 2
    assert gpu_check.judge_lease(dry, sim, cuda=False)["ok"] is True
    assert gpu_check.judge_lease(dry[:3] + [step("1", None, None, True)], sim, cuda=False)["ok"] is False


def test_signatures_of_this_venv_and_a_keyword_that_would_be_swallowed():
    assert gpu_check.signature_problems() == []
    forward = next(s for s in gpu_check.SIGNATURES if s[1] == "LlamaForCausalLM.forward")
    assert "cache" in forward[2] and "logits_to_keep" in forward[2]
    table = (("json", "dumps", ("indent", "cache"), "here.py"),
             ("json", "JSONDecoder.__init__", ("strict", "cache"), "x.py"),
             ("json", "no_such_thing", (), "there.py"))
    problems = gpu_check.signature_problems(table)
    version = "json (stdlib)"
    assert problems == [
        f"{version}: dumps has no parameter 'cache' (its **kwargs would swallow it unused); "
        "our code passes it in here.py",
        f"{version}: JSONDecoder.__init__ has no parameter 'cache' (the call would raise TypeError); "
        "our code passes it in x.py",
        f"{version}: json.no_such_thing is missing (AttributeError: module 'json' has no attribute 'no_such_thing'); "
        "used in there.py"]


def _wheel(dest: Path, name: str, version: str, requires: list[str]) -> Path:
    path = dest / f"{name}-{version}-py3-none-any.whl"
    meta = "Metadata-Version: 2.1\nName: {}\nVersion: {}\n{}".format(
        name, version, "".join(f"Requires-Dist: {r}\n" for r in requires))
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    return path


def _check_wheels(dest: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(WHEELS), str(dest), "--check-only", *extra], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)


def test_wheels_whose_constraints_the_image_does_not_meet_are_refused(tmp_path):
    _wheel(tmp_path, "carried", "1.0", ["torch>=2.12", "helper<2", "tokenizers<0.24,>=0.23.1", "nowhere>=1",
                                        "winonly; sys_platform == 'win32'", "docs>=1; extra == 'docs'",
                                        "packaging>=20", "grpcio>=1.81.1"])
    _wheel(tmp_path, "helper", "2.0", ["numpy>=3"])
    _wheel(tmp_path, "twice", "1.0", [])
    _wheel(tmp_path, "twice", "1.1", [])
    proc = _check_wheels(tmp_path, "--have", "grpcio==1.80.0")
    assert proc.returncode == 1
    assert sorted(proc.stderr.strip().splitlines()) == sorted([
        "error: two versions of twice in the wheel set: 1.0, 1.1",
        "error: carried-1.0-py3-none-any.whl needs torch>=2.12: the image has torch 2.11.0",
        "error: carried-1.0-py3-none-any.whl needs helper<2: the wheel set has helper 2.0",
        "error: carried-1.0-py3-none-any.whl needs nowhere>=1: neither the wheel set nor the image has nowhere",
        "error: carried-1.0-py3-none-any.whl needs grpcio>=1.81.1: the image has grpcio 1.80.0",
        "error: helper-2.0-py3-none-any.whl needs numpy>=3: the image has numpy 2.5.2"])
    assert ("unverified: carried-1.0-py3-none-any.whl needs packaging>=20: the image's packaging version "
            "is not known here") in proc.stdout
    # versions from a file, as `pip freeze` writes them, meet every constraint
    (tmp_path / "twice-1.1-py3-none-any.whl").unlink()
    (tmp_path / "image.txt").write_text("torch==2.12.1\nnumpy==3.0.0\ngrpcio==1.81.1\npackaging==24.0\n")
    _wheel(tmp_path, "nowhere", "1.0", [])
    (tmp_path / "helper-2.0-py3-none-any.whl").unlink()
    _wheel(tmp_path, "helper", "1.5", [])
    proc = _check_wheels(tmp_path, "--image-versions", str(tmp_path / "image.txt"))
    assert proc.returncode == 0 and proc.stderr == "" and "unverified" not in proc.stdout, proc.stdout + proc.stderr
    bad = _check_wheels(tmp_path, "--have", "torch 2.11")
    assert bad.returncode == 2 and "--have: 'torch 2.11' is not NAME==VERSION" in bad.stderr


def test_wheels_against_this_interpreter(tmp_path):
    """--installed (what gpu_check's image part runs on the device): this venv's own versions."""
    _wheel(tmp_path, "carried", "1.0", [f"torch=={torch.__version__.split('+')[0]}", "packaging>=20",
                                        "torch<2; python_version < '3'"])
    assert _check_wheels(tmp_path, "--installed").returncode == 0
    _wheel(tmp_path, "other", "1.0", ["torch<2"])
    proc = _check_wheels(tmp_path, "--installed")
    assert proc.returncode == 1 and f"needs torch<2: the image has torch {torch.__version__}" in proc.stderr
    check = gpu_check.wheel_check(str(tmp_path))
    assert check["ok"] is False and check["wheels"] == 2 and "other-1.0-py3-none-any.whl needs torch<2" in check["why"]
    assert gpu_check.wheel_check(str(tmp_path / "none")) == {"ok": True, "wheels": 0,
                                                             "note": f"no wheels in {tmp_path / 'none'}"}


def test_gpu_tests_are_the_cuda_ones_and_no_end_to_end_test():
    ids = gpu_check.cuda_test_ids()
    assert "tests/test_devices.py::test_train_and_resume_on_cuda" in ids
    assert "tests/test_decode_syncs.py::test_cuda_micro_batch_peak_is_below_the_unchunked_one" in ids
    # skipped where there IS a GPU, or no CUDA code: running them on a GPU proves nothing about GPUs
    assert "tests/test_devices.py::test_cuda_config_on_a_cpu_machine_fails_before_any_model_loads" not in ids
    assert "tests/test_deepspeed.py::test_deepspeed_config_defaults_off" not in ids
    # torchrun end to end (600-900 s each): not in a slot of seconds
    assert not [i for i in ids if "test_one_step_matches_the_plain_learner" in i
                or "test_cli_train_under_torchrun" in i]
    assert {i.split("::")[0] for i in ids} <= set(gpu_check.cuda_test_files())


def test_cuda_test_files_are_those_with_cuda_code():
    files = gpu_check.cuda_test_files()
    assert "tests/test_devices.py" in files and "tests/test_activation_checkpointing.py" in files
    assert "tests/test_worker_batching.py" not in files and "tests/test_multi_lora_sampling.py" not in files
    assert all("torch.cuda.is_available()" in (ROOT / f).read_text() for f in files)


def test_pytest_summary_skips_are_not_failures():
    counts = gpu_check.pytest_counts("....s\n=== 12 passed, 3 skipped, 18 deselected in 4.2s ===\n")
    assert counts == {"passed": 12, "failed": 0, "errors": 0, "skipped": 3, "deselected": 18, "collected": 0}
    counts = gpu_check.pytest_counts("FAILED x\n== 1 failed, 10 passed, 1 skipped, 2 errors in 9s ==")
    assert counts == {"passed": 10, "failed": 1, "errors": 2, "skipped": 1, "deselected": 0, "collected": 0}
    assert gpu_check.pytest_counts("a::b\n\n13/15 tests collected (2 deselected) in 3.1s\n")["collected"] == 13
    assert gpu_check.pytest_counts("a::b\n\n12 tests collected in 3.1s\n")["collected"] == 12


def test_measure_figures_become_a_check_only_with_a_true_boolean():
    assert gpu_check.booleans_ok({"bf16_worker_ok": True, "gap": 0.1}, ["bf16_worker_ok", "gap"])["ok"] is True
    bad = gpu_check.booleans_ok({"bf16_worker_ok": False, "gap": 0.1}, ["bf16_worker_ok", "gap"])
    assert bad["ok"] is False and "bf16_worker_ok" in bad["why"]
    none = gpu_check.booleans_ok({"bf16_agreement_max": 0.01}, ["bf16_agreement_max"])
    assert none["ok"] is False and "no pass/fail boolean" in none["why"]


def test_leased_uuid_normalization():
    assert gpu_check.norm_uuid("GPU-5C0B-11") == gpu_check.norm_uuid("5c0b-11")
    assert gpu_check.norm_uuid(None) != gpu_check.norm_uuid("5c0b-11")


@pytest.mark.e2e
@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run of a machine without CUDA")
def test_the_node_part_on_two_simulated_gpus(tmp_path):
    """Items 1, 3, 4 of issue 50 on 2 simulated GPUs, each in a process of its own that found CUDA
    uninitialized: a LoRA step per device on that device's worker, the Tinker service over a worker
    per base and device with one killed, a 2-rank step whose gathered rollouts equal 1 rank's."""
    env = {**os.environ, "OUT": str(tmp_path)}
    cmd = [sys.executable, str(SCRIPT), "--cpu-dry-run", "--sim-gpus", "2", "--only", "node", "--budget-s", "1800",
           "--slot", "node_workers=600", "--slot", "node_tinker=600", "--slot", "node_ddp=600"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=1900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["all_ok"] is True and report["skipped"] == [] and report["driver_imported_torch"] is False
    assert report["needs_cuda"] == ["node_workers", "node_tinker", "node_ddp"] and len(report["node_gpus"]) == 2
    checks = report["checks"]
    assert {c: checks[c]["status"] for c in gpu_check.GROUPS["node"]} == dict.fromkeys(gpu_check.GROUPS["node"], "pass")
    pids = {checks[c]["process"]["pid"] for c in gpu_check.GROUPS["node"]}
    assert len(pids) == 3 and all(checks[c]["process"]["cuda_initialized_at_start"] is False for c in checks)
    workers = checks["node_workers"]
    assert (workers["steps_on_leased_worker"], workers["workers"], workers["distinct_worker_devices"]) == (1.0, 2, 2)
    assert workers["cuda_initialized_in_steps"] == 0 and workers["cuda_initialized_in_workers"] == 0
    tinker = checks["node_tinker"]
    assert tinker["tinker_workers"] == 4 and tinker["tinker_devices"] == 2 and tinker["worker_death_isolated"] is True
    ddp = checks["node_ddp"]
    assert ddp["ddp_rollouts_split_equal"] is True and len(ddp["rows_per_rank"]) == 2 and ddp["lease_released"]


def test_on_one_gpu_the_node_part_is_skipped_not_passed(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path)}
    cmd = [sys.executable, str(SCRIPT), "--cpu-dry-run", "--sim-gpus", "1", "--only", "node"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the dry run takes its GPUs")
    assert proc.returncode == 1, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    node = list(gpu_check.GROUPS["node"])
    assert report["all_ok"] is False and report["skipped"] == node and report["failed"] == []
    assert len(report["node_gpus"]) == 1
    for c in node:
        r = report["checks"][c]
        assert r["ok"] is False and r["status"] == "skipped" and "needs at least 2" in r["why"], r
        assert "process" not in r  # nothing ran


def test_node_verdicts_name_what_is_not_as_wanted():
    wants = {"workers": 2, "rows_per_rank": lambda rows: len(rows) == 2 and min(rows) > 0}
    assert gpu_check.node_verdict({"workers": 2, "rows_per_rank": [8, 8]}, wants)["ok"] is True
    bad = gpu_check.node_verdict({"workers": 1, "rows_per_rank": [16, 0]}, wants)
    assert bad["ok"] is False and bad["why"] == "not as wanted: workers=1, rows_per_rank=[16, 0]"
    assert gpu_check.node_verdict({}, {"worker_keys_physical": True})["ok"] is False  # absent is not true
