"""What every `tinker-pipelines` command shares: one-line errors and the model flags' checks."""

from __future__ import annotations

import contextlib


def one_line(text: object) -> str:
    """A message as one line: a wrapped or multi-line message must not look like several errors."""
    return "; ".join(line.strip() for line in str(text).splitlines() if line.strip()) or "(no message)"


def parse_model_kwargs(text: str) -> dict:
    import json

    try:
        kwargs = json.loads(text) if text else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"--model-kwargs is not JSON: {e}") from None
    if not isinstance(kwargs, dict):
        raise ValueError(f"--model-kwargs must be a JSON object, got {text}")
    return kwargs


@contextlib.contextmanager
def flags_named():
    """Name the command-line flag, not the config field, in a model check's error."""
    try:
        yield
    except ValueError as e:
        message = str(e)
        for field, flag in (("model.name", "--model"), ("model.device", "--device"), ("model.dtype", "--dtype")):
            message = message.replace(field, flag)
        raise ValueError(message) from None
