"""Side-by-side benchmarks, each runnable as `python -m benchmarks.NAME`; the last line printed is one JSON object."""
