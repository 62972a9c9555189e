"""`tiny`: a small Llama-style model (or, with `arch`, one of each family users train) and a
byte-level BPE tokenizer, built in-process.

Nothing is downloaded: the tokenizer is trained on a small fixed corpus in about a second and
the model is randomly initialised from a seed. It exists for tests, CI and fast experiments.
"""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

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


TINY_ARCHS = ("llama", "llama3", "qwen2", "qwen3", "qwen3_5", "mistral")
"""The architectures `tiny` can be built as (`arch`): each family users train, at tiny sizes,
randomly initialised from transformers' own config class (nothing downloaded)."""


def tiny_config(arch: str, vocab_size: int, hidden_size: int, num_layers: int, eos_token_id: int,
                pad_token_id: int):
    """The transformers config of `tiny` as `arch`: 4 attention heads of hidden_size / 4, and what
    marks the family as its published models set it (grouped-query attention, `llama3` RoPE
    scaling, Qwen2's q/k/v bias, Qwen3's q/k norms, Qwen3.5's three Gated DeltaNet layers to each
    full-attention one and its partial rotary, Mistral's untied output layer)."""
    import transformers as tf

    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=hidden_size * 4,
                  num_hidden_layers=num_layers, num_attention_heads=4, max_position_embeddings=1024,
                  bos_token_id=None, eos_token_id=eos_token_id, pad_token_id=pad_token_id)
    head_dim = hidden_size // 4
    if arch == "llama":  # the original tiny: multi-head attention, tied embeddings
        return tf.LlamaConfig(**common, num_key_value_heads=4, tie_word_embeddings=True)
    if arch == "llama3":  # Llama 3.2's small sizes: GQA, tied, rope_type llama3
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
        return tf.LlamaConfig(**common, num_key_value_heads=2, tie_word_embeddings=True, rope_parameters=rope)
    if arch == "qwen2":  # Qwen2.5's small sizes: q/k/v bias (built in), GQA, tied
        return tf.Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=True)
    if arch == "qwen3":  # q/k RMSNorm, explicit head_dim, GQA, tied
        return tf.Qwen3Config(**common, num_key_value_heads=2, head_dim=head_dim, tie_word_embeddings=True)
    if arch == "qwen3_5":  # hybrid: layer i is full attention when (i + 1) % 4 == 0, else Gated DeltaNet
        half = int(head_dim * 0.25) // 2  # rotary frequencies, split over (text, height, width)
        rope = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                "mrope_section": [half - 2 * (half // 4), half // 4, half // 4], "mrope_interleaved": True}
        return tf.Qwen3_5TextConfig(**common, num_key_value_heads=2, head_dim=head_dim, tie_word_embeddings=True,
                                    linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
                                    linear_num_key_heads=2, linear_num_value_heads=4, rope_parameters=rope)
    if arch == "mistral":  # GQA, untied output layer, no sliding window (as Mistral 7B v0.2 on)
        return tf.MistralConfig(**common, num_key_value_heads=2, tie_word_embeddings=False, sliding_window=None)
    raise ValueError(f"arch {arch!r} is not one of {', '.join(TINY_ARCHS)}")


def build_tiny(seed: int = 0, hidden_size: int = 128, num_layers: int = 4,
               dtype: torch.dtype = torch.float32, arch: str = "llama"):
    """The tiny model (~1M parameters at the defaults) and its tokenizer, seeded; `arch` picks the
    family (`TINY_ARCHS`; the default is the Llama every earlier tiny was)."""
    from transformers import AutoModelForCausalLM

    tokenizer = build_tokenizer()
    config = tiny_config(arch, len(tokenizer), hidden_size, num_layers, tokenizer.eos_token_id,
                         tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = (LlamaForCausalLM(config) if arch == "llama" else AutoModelForCausalLM.from_config(config)).to(dtype)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.eval(), tokenizer
