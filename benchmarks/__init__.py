"""Side-by-side benchmarks, each runnable as `python -m benchmarks.NAME`; the last line printed is one JSON object."""


def ready_main(measure, argv: list[str] | None = None) -> None:
    """The `__main__` of a `ready_*` part: `--device DEV` (default cpu), then `measure(DEV)`'s JSON
    as the last line (what `benchmarks.gpu_ready` and `scripts/gpu_check` parse)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=(measure.__module__ or "").rsplit(".", 1)[-1])
    parser.add_argument("--device", default="cpu", help="cpu here; cuda (or cuda:N) on a GPU")
    print(json.dumps(measure(parser.parse_args(argv).device)))
