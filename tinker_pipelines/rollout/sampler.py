"""Batched decoding with a KV cache that returns the sampled tokens and their logprobs.

All rows decode together. Where time goes on CPU, and what this module does about it:

- The Llama-shaped families (`architectures`: Llama, Qwen2/2.5, Qwen3, Mistral; also with a
  PEFT LoRA adapter) decode through `LeanDecoder`: a static KV cache allocated once per call,
  q|k|v and gate|up fused into one matmul each (LoRA merged into those copies), no per-step
  masks, cache concatenation or output objects. Greedy outputs equal `model.generate`'s token
  for token; other models use their own forward (`hf_decoder`).
- Sampling (`draw.sample_tokens`, re-exported here) draws one uniform per row and inverts the
  CDF (cumsum + searchsorted), ~10x cheaper on CPU than `torch.multinomial` over a large vocabulary.
- Finished rows are dropped from the batch (and the cache) once a quarter of the batch has
  finished: pruning copies the cache, so it is batched rather than done for every stop.
- Identical prompts (a GRPO group) are prefilled once; a prompt that extends one of the last
  call's prompts (the next turn of an episode) reuses that prompt's keys and values while the
  weights are unchanged, so only the new tokens are prefilled. Otherwise a start that every
  prompt shares (a system prompt, a task's instructions: `shared_prefix`) is prefilled once
  per adapter and copied into each row's cache; the logprobs then differ from a full prefill's
  by float rounding (~1e-5 on SmolLM2; greedy tokens still equal `generate`'s).
- Tokens and logprobs stay in tensors until a row is read out. Stop tokens and lengths end rows
  on the device; Python looks at them (one host sync) every step on a CPU, where a sync costs
  nothing, and every `decode_rows.DEVICE_CHECK_EVERY` steps elsewhere (`Sampler.check_every`),
  where each one drains the device's queue. Stop strings are scanned at those checks, for every step since
  the last one, so rows end exactly where a scan after every step would end them. On CUDA the
  uniforms are drawn on the device (`decode_rows.UniformSource`).

Host syncs that remain on CUDA, per call: the prompt setup and prefill; one every
`DEVICE_CHECK_EVERY` steps (live rows, stop strings, pruning); the read-out. Per step, only where
the request asks for it: per-row truncation parameters (`truncation.keep_mask` reads the largest top-k)
and top-p (one per widening of its partial sort), and whatever the model's own step does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from typing import Iterator

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tinker_pipelines.rollout.decode_rows import DecodeRows, UniformSource, check_interval, left_padded
from tinker_pipelines.rollout.draw import sample_tokens  # noqa: F401 (re-exported)
from tinker_pipelines.rollout.hf_decoder import _HFDecoder, warn_fallback
from tinker_pipelines.rollout.lean_decoder import LeanDecoder, PromptStore, unwrap_causal_lm, weights_fingerprint
from tinker_pipelines.rollout.samples import BASE, Sample, SampleRequest, completion_text  # noqa: F401 (re-exported)
from tinker_pipelines.rollout.shared_prefix import prefill_shared_prefix
from tinker_pipelines.rollout.truncation import check_params


log = logging.getLogger(__name__)


class ContextOverflowError(ValueError):
    """A prompt does not fit the model's context with room to generate."""


class Sampler:
    """Generates completions for a batch of token prompts with one model.

    The Llama-shaped families (also inside a PEFT LoRA wrapper) decode through `LeanDecoder`: a
    static KV cache and a lean per-token step that skips transformers' per-step overhead; other
    models go through their own forward with the cache their `generate` builds (`hf_decoder`),
    with one warning per model naming why and `decode_path` saying so. Both give the same tokens.

    Memory: between calls the lean path keeps its fused weight copies (q|k|v and gate|up: about
    two thirds of the layer weights) and the last call's prompt keys/values (`reuse_prompts`).
    """

    def __init__(self, model: PreTrainedModel, pad_token_id: int, stop_token_ids: list[int],
                 max_context: int | None = None, lean: bool = True, reuse_prompts: bool = True,
                 tokenizer: PreTrainedTokenizerBase | None = None):
        self.model = model
        self.tokenizer = tokenizer
        """Decodes completions to test stop strings (requests with `stop` need one)."""
        self.pad_token_id = pad_token_id
        self.stop_token_ids = list(stop_token_ids)
        self.max_context = max_context or getattr(model.config, "max_position_embeddings", None)
        self.lean = lean
        """Use the lean decode step where the model supports it (set False to compare)."""
        self.reuse_prompts = reuse_prompts
        """Keep the prompts' keys/values of the last call and reuse them for prompts that extend
        those (the next turn of an episode) while the weights are unchanged (lean path only)."""
        self._lean: tuple[tuple, LeanDecoder] | None = None
        self._store: PromptStore | None = None
        self._mixed: tuple[tuple, LeanDecoder | None] | None = None
        self.counts = {"mixed_batches": 0, "mixed_batch_errors": 0}
        """Batches of several requests `sample_each` decoded together, and those that failed and
        were rerun one request at a time (each logged with its cause)."""
        self.check_every: int | None = None
        """Decode steps between host checks for finished rows and stop strings (None: every step
        on a CPU, `DEVICE_CHECK_EVERY` elsewhere). Samples do not depend on it; a request's
        generator draws until the check after its last row finished."""
        self.device_uniforms: bool | None = None
        """Draw the uniforms on the model's device (None: on CUDA; `UniformSource`)."""
        self.decode_path: str | None = None
        """Which decoder the last call ran: "lean", or "hf: <why the lean decoder did not take the
        model>" (the model's own forward, one adapter at a time); None before the first call."""

    def invalidate(self) -> None:
        """Drop the fused weights and stored prompt keys/values (weights changed behind torch's
        version counters, e.g. through `param.data`, or to free memory)."""
        self._lean = self._store = self._mixed = None

    def _decoder(self) -> tuple[LeanDecoder | _HFDecoder, tuple | None]:
        """The decoder and the weights' fingerprint (None on the HF path). The lean decoder (its
        fused weights) is kept across calls until a parameter or adapter changes."""
        if self.lean and LeanDecoder.supports(self.model):
            fingerprint = weights_fingerprint(self.model)
            if self._lean is None or self._lean[0] != fingerprint:
                self._lean, self._store = (fingerprint, LeanDecoder(self.model)), None
            return self._lean[1], fingerprint
        self._lean = self._store = None
        if not self.lean:
            return _HFDecoder(self.model, "Sampler(lean=False)"), None
        reason = LeanDecoder.why_not(self.model) or "the lean decoder refused the model"
        warn_fallback(self.model, reason)
        return _HFDecoder(self.model, reason), None

    def sample(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
               generator: torch.Generator | None = None, *, top_k: int = 0, top_p: float = 1.0,
               min_p: float = 0.0, stop: tuple[str, ...] | list[str] = (), top_logprobs: int = 0,
               stop_token_ids: tuple[int, ...] | list[int] = ()) -> list[Sample]:
        """Complete every prompt; rows are independent of each other's lengths. `top_k`, `top_p`,
        `min_p`, `stop`, `top_logprobs` and `stop_token_ids` are `SampleRequest`'s (the defaults: no
        truncation, no stop strings, no top logprobs, the sampler's own stop tokens only)."""
        return self.sample_requests([SampleRequest(prompts, max_new_tokens, temperature, generator, top_k=top_k,
                                                   top_p=top_p, min_p=min_p, stop=tuple(stop),
                                                   top_logprobs=top_logprobs,
                                                   stop_token_ids=tuple(stop_token_ids))])[0]

    def supports_mixed_adapters(self) -> bool:
        """Whether rows of different LoRA adapters can decode in one batch (lean decoder,
        vanilla LoRA adapters); otherwise `sample_requests` runs one adapter at a time."""
        return (self.lean and LeanDecoder.supports(self.model) and hasattr(self.model, "peft_config")
                and self._mixed_decoder() is not None)

    @torch.inference_mode()
    def sample_requests(self, requests: list[SampleRequest]) -> list[list[Sample]]:
        """Complete several requests in one batch; returns each request's samples.

        Every row's tokens depend only on its prompt, its adapter and its request's uniforms, not
        on which other rows share the batch: a request's generator is advanced by one uniform per
        prompt and step while any of its rows is live (up to the next check for finished rows,
        `check_every`), exactly as if it were sampled alone. When
        requests name LoRA adapters, all rows go through one base pass per step plus each row's
        own adapter delta (`LeanDecoder` with per-row adapters)."""
        for r in requests:
            self._check(r)
        live = [i for i, r in enumerate(requests) if r.prompts]
        out: list[list[Sample]] = [[] for _ in requests]
        if not live:
            return out
        named = [requests[i].adapter for i in live]
        if any(a is not None for a in named):
            active = getattr(self.model, "active_adapter", None)
            requests = [r if r.adapter is not None else dataclasses.replace(r, adapter=active) for r in requests]
            named = [requests[i].adapter for i in live]
            decoder = self._mixed_decoder() if self.lean and LeanDecoder.supports(self.model) else None
            order = sorted(live, key=lambda i: named.index(requests[i].adapter))  # rows grouped by adapter
            mixed, alone = order, []
            try:
                if decoder is None:
                    raise _NotHostable
                results = self._decode([requests[i] for i in mixed], decoder, None, mixed=True)
            except _NotHostable:  # one adapter at a time through the model's own forward
                mixed, alone, results = [], order, []
            for i in alone:
                with _adapter_set(self.model, requests[i].adapter):
                    decoder, fingerprint = self._decoder()
                    results += self._decode([requests[i]], decoder, fingerprint)
            for i, res in zip(mixed + alone, results):
                out[i] = res
            return out
        decoder, fingerprint = self._decoder()
        results = self._decode([requests[i] for i in live], decoder, fingerprint)
        for i, res in zip(live, results):
            out[i] = res
        return out

    def sample_each(self, requests: list[SampleRequest]) -> list[list[Sample] | Exception]:
        """`sample_requests` for requests of independent callers: each request's samples, or the
        error that request alone caused. Invalid requests are refused before the batch; if the
        batch fails anyway, the generators are rewound and each request runs alone, so that one
        caller's bad request never fails the others (their samples are those of the batch)."""
        out: list[list[Sample] | Exception | None] = [None] * len(requests)
        ok = []
        for i, r in enumerate(requests):
            try:
                self._check(r)
                ok.append(i)
            except ValueError as e:
                out[i] = e
        gens = [requests[i].generator for i in ok]
        states = [g.get_state() if g is not None else None for g in gens]
        try:
            for i, samples in zip(ok, self.sample_requests([requests[i] for i in ok]) if ok else []):
                out[i] = samples
            self.counts["mixed_batches"] += len(ok) > 1
        except Exception as e:  # noqa: BLE001 - whose request it was is found below
            if len(ok) == 1:
                out[ok[0]] = e
                return out  # type: ignore[return-value]
            self.counts["mixed_batch_errors"] += 1
            log.warning("a batch of %d sample requests failed (%s: %s); running each alone", len(ok),
                        type(e).__name__, e)
            for g, state in zip(gens, states):
                if g is not None:
                    g.set_state(state)
            for i in ok:
                try:
                    out[i] = self.sample_requests([requests[i]])[0]
                except Exception as alone:  # noqa: BLE001
                    out[i] = alone
        return out  # type: ignore[return-value]

    def _check(self, r: SampleRequest) -> None:
        if not math.isfinite(r.temperature) or r.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {r.temperature}")
        check_params(r.top_k, r.top_p, r.min_p)
        if isinstance(r.top_logprobs, bool) or not isinstance(r.top_logprobs, int) or r.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be an integer >= 0, got {r.top_logprobs!r}")
        if not all(isinstance(x, str) and x for x in r.stop):
            raise ValueError(f"stop must be non-empty strings, got {r.stop!r}")
        if r.stop and self.tokenizer is None:
            raise ValueError("stop strings need the sampler's tokenizer (Sampler(..., tokenizer=...))")
        vocab = self.model.get_input_embeddings().num_embeddings
        bad = next((t for t in r.stop_token_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab),
                   None)
        if bad is not None:
            raise ValueError(f"stop token id {bad!r} is outside the model's vocabulary [0, {vocab})")
        if r.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {r.max_new_tokens}")
        if any(len(p) == 0 for p in r.prompts):
            raise ValueError("empty prompt")
        for p in r.prompts:
            lo, hi = min(p), max(p)
            if lo < 0 or hi >= vocab:
                raise ValueError(f"token id {lo if lo < 0 else hi} in a prompt is outside the model's "
                                 f"vocabulary [0, {vocab})")
        longest = max((len(p) for p in r.prompts), default=0)
        if self.max_context is not None and longest + r.max_new_tokens > self.max_context:
            raise ContextOverflowError(
                f"a prompt of {longest} tokens plus max_new_tokens={r.max_new_tokens} exceeds the "
                f"model context of {self.max_context} tokens"
            )

    def _mixed_decoder(self) -> LeanDecoder | None:
        """A decoder over the base weights alone (adapter deltas are added per row), kept while
        the base weights are unchanged; None when an adapter cannot run unmerged this way."""
        fingerprint = weights_fingerprint(self.model, base_only=True)
        if self._mixed is None or self._mixed[0] != fingerprint:
            decoder = LeanDecoder(self.model, base_only=True)
            self._mixed = (fingerprint, decoder if decoder.fused is not None else None)
        return self._mixed[1]

    def _decode(self, requests: list[SampleRequest], decoder, fingerprint: tuple | None,
                mixed: bool = False) -> list[list[Sample]]:
        """Prefill every request's prompts, then decode them together until each row ends
        (`DecodeRows` holds the per-row state; Python looks at it every `check_every` steps)."""
        device = next(self.model.parameters()).device
        M = max(r.max_new_tokens for r in requests)
        self.decode_path = f"hf: {decoder.reason}" if isinstance(decoder, _HFDecoder) else "lean"
        logits_BV = self._prefill(requests, decoder, fingerprint, mixed, M, device)
        state = DecodeRows(requests, M, logits_BV.shape[-1], self.stop_token_ids, device)
        draw = UniformSource(requests, device, self.device_uniforms)
        check_every = check_interval(device, self.check_every)
        scanned = 0  # steps whose stop strings were scanned
        for t in range(M):
            tok_B = state.step(t, logits_BV, draw(state.req_live, state.row_idx))
            if (t + 1) % check_every and t != M - 1:  # no host check this step: no sync
                logits_BV = decoder.step(tok_B, t)
                continue
            if state.has_stop_strings:
                state.scan_stop_strings(scanned, t, self.tokenizer)
                scanned = t + 1
            if state.check_live():
                if state.n_live == 0 or t == M - 1:
                    break
                keep = state.prune(t)
                if keep is not None:
                    tok_B = state.tok_BT[:, t]
                    decoder.select(keep)
            if t == M - 1:
                break
            logits_BV = decoder.step(tok_B, t)
        state.read_out(list(range(len(state.rows))), M)
        return state.by_request()

    def _prefill(self, requests: list[SampleRequest], decoder, fingerprint: tuple | None, mixed: bool, M: int,
                 device: torch.device) -> torch.Tensor:
        """Prefill the prompts of `requests` (each distinct prompt once, reusing stored or shared
        keys/values where it can) and leave the decoder's cache with one row per prompt; returns
        the next-token logits_BV."""
        prompts = [p for r in requests for p in r.prompts]
        req_of = [i for i, r in enumerate(requests) for _ in r.prompts]
        B = len(prompts)
        # identical prompts (a GRPO group) are prefilled once, then their cache rows repeated
        key = [(requests[req_of[b]].adapter, tuple(p)) if mixed else tuple(p) for b, p in enumerate(prompts)]
        unique: dict = {}
        row_of = [unique.setdefault(k, len(unique)) for k in key]
        U = len(unique)
        input_UL, mask_UL, positions_UL = left_padded([k[1] if mixed else k for k in unique], self.pad_token_id,
                                                       device)
        if mixed:
            names = list(dict.fromkeys(r.adapter for r in requests))
            row_adapter = [names.index(k[0]) for k in unique]
            if not decoder.set_adapters([None if n == BASE else n for n in names], row_adapter):
                raise _NotHostable
            store, hits = prefill_shared_prefix(decoder, [k[1] for k in unique], row_adapter, fingerprint)
            logits_BV = decoder.prefill_reusing(input_UL, mask_UL, positions_UL, M, store, hits)
        else:
            reuse = self.reuse_prompts and fingerprint is not None and decoder.fused is not None
            store = (self._store if reuse and self._store is not None and self._store.fingerprint == fingerprint
                     else None)
            hits = [store.lookup(p) for p in unique] if store is not None else []
            if not any(hits) and getattr(decoder, "fused", None) is not None:
                store, hits = prefill_shared_prefix(decoder, list(unique), [0] * U, fingerprint)
            if any(hits):
                logits_BV = decoder.prefill_reusing(input_UL, mask_UL, positions_UL, M, store, hits)
            else:
                logits_BV = decoder.prefill(input_UL, mask_UL, positions_UL, M)
            self._store = decoder.store(list(unique), fingerprint) if reuse else None
        if U < B or mixed:
            expand = torch.tensor(row_of, device=device)
            decoder.select(expand)
            logits_BV = logits_BV.index_select(0, expand)
        return logits_BV


class _NotHostable(Exception):
    """An adapter of the batch cannot run unmerged beside others (see `lora_factors`)."""


@contextlib.contextmanager
def _adapter_set(model: torch.nn.Module, adapter: str | None) -> Iterator[None]:
    """Apply only `adapter` (None: the bare base) for the block, then restore the active one."""
    previous = getattr(model, "active_adapter", None)
    if adapter == BASE:
        with model.disable_adapter():
            yield
        return
    model.set_adapter(adapter)
    try:
        yield
    finally:
        if previous is not None and previous != adapter:
            model.set_adapter(previous)
