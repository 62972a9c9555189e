"""What every `tinker-pipelines` command shares: one-line errors and the model flags' checks."""

from __future__ import annotations

import contextlib


def one_line(text: object) -> str:
    """A message as one line: a wrapped or multi-line message must not look like several errors."""
    return "; ".join(line.strip() for line in str(text).splitlines() if line.strip()) or "(no message)"


NOISE = (
    # transformers 5 on every training step: a deprecation inside its own code, nothing to act on
    (FutureWarning, r"`is_gradient_checkpointing` is deprecated"),
)
"""Third-party warnings a user of the command line cannot act on: (category, message regex)."""


def warnings_as_lines(stream=None) -> None:
    """Show each warning of this process as one line, `warning: <message>`, on stderr (not
    Python's `file:line: Category: message` and source line), and drop `NOISE`."""
    import sys
    import warnings

    for category, pattern in NOISE:
        warnings.filterwarnings("ignore", message=pattern, category=category)

    def show(message, category, filename, lineno, file=None, line=None):
        from tqdm import tqdm

        # through tqdm: a progress bar being drawn is cleared first, so the warning starts its own line
        tqdm.write(f"warning: {one_line(message)}", file=file or stream or sys.stderr)

    warnings.showwarning = show


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
