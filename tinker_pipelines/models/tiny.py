"""`tiny`: a small Llama-style model and a byte-level BPE tokenizer, built in-process.

Nothing is downloaded: the tokenizer is trained on a small fixed corpus in about a second and
the model is randomly initialised from a seed. It exists for tests, CI and fast experiments.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]

_CORPUS_WORDS = (
    "system user assistant tool Answer with a single number and nothing else What is the answer "
    "Guess number between higher lower correct too high low You are helpful I think it is yes no "
    "call result error calculator python print def return for in if else plus minus times equals "
    "Repeat this The of to and you your my please thank question reply"
)


def _corpus() -> list[str]:
    lines = [_CORPUS_WORDS] * 20
    lines += [f"<|im_start|>user\n{a} + {b} = ?<|im_end|>\n" for a in range(20) for b in range(20)]
    lines += [f"{n}" for n in range(1000)]
    return lines


def build_tokenizer(vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with ChatML special tokens; digits are split one by one."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>", pad_token="<|pad|>",
        unk_token=None,
    )
    fast.chat_template = CHATML_TEMPLATE
    return fast


def build_tiny(seed: int = 0, hidden_size: int = 128, num_layers: int = 4,
               dtype: torch.dtype = torch.float32) -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    """The tiny model (~1M parameters at the defaults) and its tokenizer, seeded."""
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 4,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=4,
        max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.eval(), tokenizer
