"""benchmarks.paper's bookkeeping: each phase's memory peak, and the table's ratios from them."""

from benchmarks.paper import _measured, report


def _touch(n: int) -> int:
    """n bytes of fresh pages, each written: the heap may hold freed pages that a bytearray would
    reuse without the resident size growing (the process keeps freed buffers, `allocator`)."""
    import mmap

    with mmap.mmap(-1, n) as m:
        for i in range(0, n, mmap.PAGESIZE):
            m[i] = 1
        return len(m)


def test_a_phase_records_the_peak_it_reached_and_returns_its_result():
    peaks: dict[str, float] = {}
    grow = _measured(peaks, "update", _touch)
    assert grow(64 << 20) == 64 << 20
    first = peaks["update"]
    small = _measured(peaks, "update", lambda: 0)
    small()
    assert peaks["update"] == first  # the phase's peak is the largest of its calls
    _measured(peaks, "rollout", lambda: None)()
    assert 0 < peaks["rollout"] and first >= peaks["rollout"] + 60  # reset between phases: the 64 MB is gone


def _mode(mode: str, peaks: dict[str, float], reached: float | None) -> dict:
    return {"mode": mode, "before": 0.7, "after": 0.95 if mode == "lora" else 1.0, "curve": [(0, 0.9, 5.0, 0.1)],
            "time_to_target_s": reached, "train_s": 50.0, "peak_mb": max(peaks.values()), "peaks_mb": peaks,
            "memory": "resident", "trainable": 10}


def test_report_takes_its_ratios_from_the_phase_peaks():
    tools = {"lora": _mode("lora", {"rollout": 900.0, "update": 1200.0, "evaluation": 800.0}, 10.0),
             "full": _mode("full", {"rollout": 1500.0, "update": 2000.0, "evaluation": 1500.0}, 30.0),
             "gradient_checkpointing": True, "learning_rates": {"lora": 2e-4, "full": 2e-5}}
    r = report(tools, None, None, 0.8)
    assert r["memory_ratio"] == 0.6 and r["update_memory_ratio"] == 0.6
    assert r["time_to_target_ratio"] == 3.0 and r["comparable"] is True
    assert r["peaks_mb"]["full"] == {"rollout": 1500, "update": 2000, "evaluation": 1500}
    tools["lora"]["time_to_target_s"] = None  # never reached: no ratio, not a division by zero
    assert report(tools, None, None, 0.8)["time_to_target_ratio"] is None
