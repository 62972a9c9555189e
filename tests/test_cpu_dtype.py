"""`model.dtype: auto` on a CPU: bf16 where the CPU computes it natively (AMX or AVX512-BF16, read
from /proc/cpuinfo's flags once), fp32 everywhere else; the run's log says which, in one line.
The flags are faked both ways with cpuinfo files of our own; the last test holds this machine
to the same rule."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tinker_pipelines.models import dtypes, dtype_note, resolve_dtype

SAPPHIRE_RAPIDS = "fpu vme sse4_2 avx2 avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8"
GENOA = "fpu vme sse4_2 avx2 avx512f avx512bw avx512_vnni avx512_bf16"
AMX_ONLY = "fpu sse4_2 avx2 amx_bf16 amx_tile"
ICE_LAKE = "fpu vme sse4_2 avx2 avx512f avx512bw avx512_vnni avx512_fp16 avx512bf16x"  # no avx512_bf16 flag
HASWELL = "fpu vme sse4_2 avx avx2 fma"


def _cpuinfo(tmp_path: Path, flags: str, name: str = "cpuinfo") -> Path:
    """Two cores' worth of /proc/cpuinfo with `flags`."""
    core = "processor\t: {n}\nvendor_id\t: GenuineIntel\nmodel name\t: Some CPU\nflags\t\t: {flags}\n\n"
    path = tmp_path / name
    path.write_text(core.format(n=0, flags=flags) + core.format(n=1, flags=flags))
    return path


@pytest.mark.parametrize("flags, want, flag", [
    (SAPPHIRE_RAPIDS, torch.bfloat16, "amx_bf16"),
    (GENOA, torch.bfloat16, "avx512_bf16"),
    (AMX_ONLY, torch.bfloat16, "amx_bf16"),
    (ICE_LAKE, torch.float32, None),
    (HASWELL, torch.float32, None),
])
def test_auto_is_bf16_exactly_where_the_cpu_has_native_bf16(tmp_path, monkeypatch, flags, want, flag):
    monkeypatch.setattr(dtypes, "CPUINFO", str(_cpuinfo(tmp_path, flags)))
    assert dtypes.cpu_bf16_flag() == flag
    assert resolve_dtype("auto", "cpu") == want
    note = dtype_note("auto", "cpu", want)
    assert "\n" not in note and note.startswith(f"model.dtype auto: {str(want).removeprefix('torch.')} (")
    assert (flag in note) if flag else "neither amx_bf16 nor avx512_bf16" in note
    # a dtype named outright is never changed, and says nothing
    assert resolve_dtype("float32", "cpu") == torch.float32 and resolve_dtype("bf16", "cpu") == torch.bfloat16
    assert dtype_note("float32", "cpu", torch.float32) is None


def test_no_cpuinfo_means_fp32_and_the_flags_are_read_once(tmp_path, monkeypatch):
    monkeypatch.setattr(dtypes, "CPUINFO", str(tmp_path / "absent"))  # macOS, a sandbox without /proc
    assert resolve_dtype("auto", "cpu") == torch.float32
    path = _cpuinfo(tmp_path, GENOA, "genoa")
    monkeypatch.setattr(dtypes, "CPUINFO", str(path))
    assert resolve_dtype("auto", "cpu") == torch.bfloat16
    path.write_text("flags\t: fpu avx2\n")  # read once: a later change of the file is not seen
    assert resolve_dtype("auto", "cpu") == torch.bfloat16


def test_this_machine_follows_the_rule():
    """Whichever kind of machine runs the suite, `auto` on its CPU is what the rule says."""
    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    flags = {f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}
    native = bool(flags & {"amx_bf16", "avx512_bf16"})
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if native else torch.float32)
    assert resolve_dtype("auto", "cpu") == resolve_dtype("auto", torch.device("cpu"))


@pytest.mark.e2e
def test_a_worker_on_auto_logs_its_choice_and_runs_it(tmp_path):
    """`tinker-pipelines worker --dtype auto` says in its log which dtype it chose and why (one
    line), and its hello reports the same dtype the rule gives on this machine."""
    from tinker_pipelines.worker.client import WorkerClient, start_worker

    want = resolve_dtype("auto", "cpu")
    proc = start_worker("tiny", tmp_path / "w.sock", device="cpu", dtype="auto", extra=["--threads", "1"],
                        log=tmp_path / "log")
    try:
        client = WorkerClient(tmp_path / "w.sock")
        assert client.info["dtype"] == str(want).removeprefix("torch.")
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    lines = [line for line in (tmp_path / "log").read_text().splitlines() if line.startswith("model.dtype auto:")]
    assert lines == [dtype_note("auto", "cpu", want)]
