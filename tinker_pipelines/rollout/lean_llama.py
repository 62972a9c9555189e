"""Renamed `lean_decoder` (one decoder for every family in `architectures`); the old names stay
importable for code written against them."""

from tinker_pipelines.rollout.lean_decoder import (  # noqa: F401
    LeanDecoder, LeanDecoder as LeanLlamaDecoder, PromptStore, linear_params, unwrap_causal_lm, weights_fingerprint)
