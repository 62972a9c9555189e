"""A lean decode step for the Llama-shaped families, with a pre-allocated (static) KV cache.

One decoder runs every family of `architectures` (Llama with any static RoPE, Qwen2/2.5,
Qwen3, Mistral, Qwen3.5 whose Gated DeltaNet layers are `delta_net`'s layer kind): each is a
declared difference from a Llama (q/k RMSNorm, sliding windows, gated attention),
and what the modules show (biases, tied embeddings, grouped-query ratios, head sizes, the
rotary tables) is read from them. `LeanDecoder.why_not` names what it cannot run; callers then
use the model's own forward (`hf_decoder`).

Hugging Face's forward spends a few milliseconds per decode step on CPU outside the matmuls:
building a 4-D mask, growing every layer's cache with `torch.cat` (a copy of the whole cache per
step), rotary tables, output dataclasses and decorators. This module runs the same computation
for one new token per row with none of that:

- keys and values go into buffers allocated once per `sample` call (prompt + max_new_tokens);
- the attention mask is a boolean `[B, 1, 1, S]` built once and sliced per step (a layer with a
  sliding window slices its keys to the window, as transformers' sliding mask bounds them);
- rotary cos/sin for every row and step are computed once (the model's own rotary module, so
  `llama3`, `linear` and `yarn` scaling are its own numbers);
- q|k|v and gate|up run as one matmul each on fused weight copies (bitwise the same outputs as
  separate matmuls; a bias, Qwen2's, is fused the same way); active vanilla LoRA adapters are
  merged into those copies where they have the base's dtype, and added unmerged (as PEFT and the
  learner compute them) where they do not (fp32 LoRA on a bf16 base: `tinker_pipelines.models.dtypes`
  says why). Adapters that cannot be merged (DoRA, LoRA bias, ...) run through the model's own
  sub-modules instead;
- RMSNorm runs as transformers' `LlamaRMSNorm` (in fp32, cast back: `dtypes.rms_norm`); Qwen3's
  per-head q and k norms run as one such norm over the q and k heads side by side;
- the prefill is the model's own forward, except that a prompt extending one of the previous
  call's prompts (`PromptStore`) reuses their keys/values and runs only its new tokens.
- on CPU the output layer runs in blocks of `HEAD_BLOCK` vocabulary columns (`blocked_linear`):
  bitwise the same logits, and ~1.5x faster than one matmul over a 49k vocabulary at decode
  batch sizes, where it is a third of the step.
- on CPU, at decode row counts, every linear computes `(W @ x^T)^T` rather than `x @ W^T`
  (`rows_linear`, 12-128 rows): the same floats, 1.3-1.6x faster (MKL streams the weight as
  stored instead of re-packing all of it on every call).

The attention call mirrors transformers' SDPA path for one query token (grouped-query heads
packed along the query axis), so greedy outputs match `model.generate` token for token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel
from transformers.models.llama.modeling_llama import rotate_half

from tinker_pipelines.models.dtypes import rms_norm
from tinker_pipelines.rollout.architectures import Arch, describe
from tinker_pipelines.rollout.linears import attention, blocked_linear, invariant_linear, rows_linear
from tinker_pipelines.rollout.mixed_lora import RowAdapters
from tinker_pipelines.rollout import delta_net

def unwrap_causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The causal LM inside a PEFT wrapper (its LoRA layers stay injected), else `model`."""
    get_base = getattr(model, "get_base_model", None)
    if get_base is not None:
        cfg = getattr(model, "active_peft_config", None)
        if cfg is not None and getattr(cfg, "is_prompt_learning", False):
            return model  # prompt tuning changes the inputs: keep the wrapper's forward
        return get_base()
    return model


def linear_params(module: torch.nn.Module, base_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight, bias) that `module` applies right now: a plain `nn.Linear`, or a PEFT LoRA
    `Linear` with its active vanilla adapters merged into a new weight. None when unsupported
    (DoRA and other variants, LoRA bias, dropout in training, ...)."""
    if type(module) is torch.nn.Linear:
        return module.weight, module.bias
    base = getattr(module, "base_layer", None)
    if type(base) is not torch.nn.Linear or not hasattr(module, "get_delta_weight"):
        return None
    if getattr(module, "fan_in_fan_out", False):
        return None
    if base_only:  # the frozen base alone; adapters are applied per row (`lora_factors`)
        return None if getattr(module, "merged", False) else (base.weight, base.bias)
    if getattr(module, "merged", False):  # adapters already in the base weight
        return None if module.disable_adapters else (base.weight, base.bias)
    if module.disable_adapters:
        return base.weight, base.bias
    weight = base.weight
    for name in module.active_adapters:
        if name not in module.lora_A:
            continue
        if name in getattr(module, "lora_variant", {}) or getattr(module, "lora_bias", {}).get(name, False):
            return None
        dropout = module.lora_dropout[name]
        if module.training and not (isinstance(dropout, torch.nn.Identity) or getattr(dropout, "p", 1) == 0):
            return None
        weight = weight + module.get_delta_weight(name).to(weight.dtype)
    return weight, base.bias


def _unmerged_adapter(causal: torch.nn.Module) -> str | None | bool:
    """The one active LoRA adapter of `causal` whose dtype is not its base layers' (it must be
    added unmerged: `tinker_pipelines.models.dtypes`); None when every active adapter can be merged (or
    none is active); False when several active adapters would need it (the model's own forward)."""
    active, other_dtype = set(), False
    for m in causal.modules():
        base = getattr(m, "base_layer", None)
        if not hasattr(m, "lora_A") or base is None or m.disable_adapters or getattr(m, "merged", False):
            continue
        for name in m.active_adapters:
            if name in m.lora_A:
                active.add(name)
                other_dtype |= m.lora_A[name].weight.dtype != base.weight.dtype
    if not other_dtype:
        return None
    return next(iter(active)) if len(active) == 1 else False


def _fusable(causal: torch.nn.Module) -> bool:
    """Whether every active adapter of `causal` can run in the fused weights or beside them."""
    if any(getattr(m, "lora_variant", None) or any(getattr(m, "lora_bias", {}).values()) for m in causal.modules()):
        return False
    return _unmerged_adapter(causal) is not False


def _norm_params(norm: torch.nn.Module, centered: bool) -> tuple[torch.Tensor, float]:
    """(scale, eps) of an RMSNorm as `LeanDecoder._rms` applies it: a centered norm's `1 + weight` in fp32."""
    if centered:
        return 1.0 + norm.weight.float(), norm.eps
    return norm.weight, norm.variance_epsilon


def centered_rms_norm(h: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' `Qwen3_5RMSNorm` on `h` with `scale` = 1 + its weight (fp32): normalised and
    scaled in fp32, then cast back."""
    h32 = h.to(torch.float32)
    h32 = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)
    return (h32 * scale).to(h.dtype)


def _fuse(modules: list[torch.nn.Module], base_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """One weight (and bias) computing the outputs of `modules` side by side, or None."""
    params = [linear_params(m, base_only) for m in modules]
    if any(p is None for p in params):
        return None
    if len(params) == 1:
        return params[0]
    weight = torch.cat([w for w, _ in params])
    if all(b is None for _, b in params):
        return weight, None
    bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in params])
    return weight, bias


@dataclass
class PromptStore:
    """Keys and values of the prompts of a previous `sample` call, for prompts that extend them
    (the next turn of a multi-turn episode). Valid only while the weights are unchanged."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    L: int
    """Column after each row's last prompt token (prompts are left-padded)."""
    lengths: list[int]
    rows: dict[tuple[int, ...], int]
    """Prompt -> row."""
    fingerprint: tuple
    states: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    """Per-row state of the other layer kinds at each prompt's end (`LeanDecoder._states`):
    a Gated DeltaNet layer's conv and recurrent states."""

    def lookup(self, prompt: tuple[int, ...]) -> tuple[int, int] | None:
        """(row, length) of the longest stored prompt that is a strict prefix of `prompt`. (A
        prompt seen before is not reused: sampling it again gives bitwise the same results.)"""
        for n in sorted(set(self.lengths), reverse=True):
            if n < len(prompt) and prompt[:n] in self.rows:
                return self.rows[prompt[:n]], n
        return None


def weights_fingerprint(model: torch.nn.Module, base_only: bool = False) -> tuple:
    """Changes whenever a parameter is updated in place (optimizer step, state-dict load) or
    replaced, or an adapter is switched, merged or disabled. Not seen: edits through `p.data`
    (a separate version counter); call `Sampler.invalidate()` after those. With `base_only`,
    only the base weights count (adapter deltas are read afresh on every call)."""
    if base_only:
        return tuple((p.data_ptr(), p._version) for n, p in model.named_parameters() if "lora_" not in n)
    params = tuple((p.data_ptr(), p._version) for p in model.parameters())
    adapters = tuple((getattr(m, "disable_adapters", None), tuple(getattr(m, "active_adapters", ())),
                      getattr(m, "merged", None))
                     for m in model.modules() if hasattr(m, "lora_A"))
    return params + adapters


@dataclass(slots=True)
class FusedLayer:
    """One decoder layer's weights as the lean step runs them (adapters merged or added per row)."""

    norm1: torch.Tensor
    eps1: float
    qkv: tuple[torch.Tensor, torch.Tensor | None]
    """q|k|v as one weight and bias."""
    o: tuple[torch.Tensor, torch.Tensor | None]
    norm2: torch.Tensor
    eps2: float
    gate_up: tuple[torch.Tensor, torch.Tensor | None]
    inter: int
    act: torch.nn.Module
    down: tuple[torch.Tensor, torch.Tensor | None]
    qk_norm: torch.Tensor | None
    """Qwen3: the q norm's weight for each q head, then the k norm's for each k head, `[n_q + n_kv, D]`."""
    qk_eps: float
    mixer: "delta_net.DeltaNet | None" = None
    """A Gated DeltaNet layer's own parameters (its `qkv` is in_proj qkv|z|b|a, its `o` out_proj)."""


class LeanDecoder:
    """Decode steps for one batch: `prefill` once, then `step` per new token; `select` drops or repeats rows."""

    LAYER_KINDS = ("attention", "linear_attention")
    """Layer kinds (`architectures.Family.layer_kinds`) this decoder has a step for."""

    @classmethod
    def why_not(cls, model: torch.nn.Module) -> str | None:
        """Why `model` cannot decode here (one line naming the cause), or None when it can."""
        causal = unwrap_causal_lm(model)
        arch = describe(causal, cls.LAYER_KINDS)
        if isinstance(arch, str):
            return arch
        if getattr(causal.model, "gradient_checkpointing", False) or causal.training or any(
                layer.training for layer in causal.model.layers):
            return "the model is in training mode (dropout, gradient checkpointing)"
        if set(arch.kinds) != {"attention"} and not _fusable(causal):
            # the modules' own step (`_step_modules`) has no linear-attention layer
            return "an adapter that cannot be merged or added per row (DoRA, LoRA bias, several of another dtype) " \
                   "on a hybrid model"
        return None

    @classmethod
    def supports(cls, model: torch.nn.Module) -> bool:
        return cls.why_not(model) is None

    def __init__(self, model: PreTrainedModel, base_only: bool = False):
        """`base_only`: the fused weights are the frozen base alone and LoRA adapters are added
        per row (`set_adapters`), so rows of different adapters share each base matmul. On CPU a
        base-only decoder is batch-invariant (`linears`): a row's tokens and logprobs do not
        depend on the other rows of its batch, so an experiment samples on a shared worker what
        it samples alone."""
        self.base_only = base_only
        self.invariant = base_only and next(model.parameters()).device.type == "cpu"
        self.adapters: RowAdapters | None = None
        self.causal = unwrap_causal_lm(model)
        arch = describe(self.causal, self.LAYER_KINDS)
        assert isinstance(arch, Arch), arch
        self.arch = arch
        inner = self.causal.model
        cfg = self.causal.config
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers[: cfg.num_hidden_layers])
        self.windows = arch.windows
        """Per layer, the keys a query sees (itself included) when the layer has a sliding window."""
        self.kinds = arch.kinds
        self.hybrid = set(self.kinds) != {"attention"}
        self.slots = [self.kinds[:li].count(k) for li, k in enumerate(self.kinds)]
        """Per layer, its index among the layers of its kind: where its per-row state is kept."""
        self._rms = centered_rms_norm if arch.family.centered_norm else rms_norm
        self.norm = inner.norm
        self.final_norm = _norm_params(self.norm, arch.family.centered_norm)
        self.rotary = inner.rotary_emb
        self.lm_head = self.causal.lm_head
        attn = next((layer.self_attn for layer, k in zip(self.layers, self.kinds) if k == "attention"), None)
        self.head_dim = attn.head_dim if attn is not None else 0
        self.n_rep = attn.num_key_value_groups if attn is not None else 1
        self.scaling = attn.scaling if attn is not None else 1.0
        self.n_kv = cfg.num_key_value_heads
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.conv: list[torch.Tensor] = []
        """Per linear-attention layer, each row's last conv inputs `[B, C, K]` (`delta_net`)."""
        self.rec: list[torch.Tensor] = []
        """Per linear-attention layer, each row's recurrent state `[B, Hv, Dk, Dv]` (fp32)."""
        self.unmerged = None if base_only else _unmerged_adapter(self.causal)
        """The active adapter added unmerged to every row (its dtype is not the base's), else None."""
        # Per layer: fused q|k|v and gate|up weights (a fused matmul gives bitwise the same
        # outputs as separate ones and saves calls); LoRA adapters are merged in. The matmuls
        # run on these copies: rebuild the decoder when the weights change (`weights_fingerprint`).
        self.fused = None if self.unmerged is False else self._fuse_weights()
        if self.unmerged and self.fused is not None:
            self.adapters = RowAdapters.build(self.groups, [self.unmerged], [0])
            if self.adapters is None:
                self.fused = None

    def _fuse_weights(self) -> list[FusedLayer] | None:
        fused = []
        base_only = self.base_only or bool(self.unmerged)  # the adapters are added per row (`RowAdapters`)
        # An adapter on the embedding cannot run per row here (the output layer's can: `_head`).
        if base_only and type(self.embed) is not torch.nn.Embedding:
            return None
        family = self.arch.family
        norm_type, centered = family.norm, family.centered_norm
        self.groups = []
        for layer, kind in zip(self.layers, self.kinds):
            mlp = layer.mlp
            norms = [layer.input_layernorm, layer.post_attention_layernorm]
            mixer = None
            if kind == "linear_attention":  # in_proj q|k|v, z, b, a as the layer's first fused group
                lin = layer.linear_attn
                mixer = delta_net.DeltaNet.of(lin)
                first = ([lin.in_proj_qkv, lin.in_proj_z, lin.in_proj_b, lin.in_proj_a], [lin.out_proj])
            else:
                attn = layer.self_attn
                norms += [attn.q_norm, attn.k_norm] if family.qk_norm else []
                first = ([attn.q_proj, attn.k_proj, attn.v_proj], [attn.o_proj])
            groups = (*first, [mlp.gate_proj, mlp.up_proj], [mlp.down_proj])
            self.groups.append(groups)
            qkv, o, gate_up, down = (_fuse(g, base_only) for g in groups)
            if any(type(n).__name__ != norm_type for n in norms) or None in (qkv, o, gate_up, down):
                return None
            if kind == "linear_attention" and mixer is None:
                return None
            qk_norm, qk_eps = None, 0.0
            if family.qk_norm and kind == "attention":  # one norm over q and k heads side by side: the same floats
                n_q = attn.q_proj.out_features // self.head_dim // (2 if family.attn_gate else 1)
                (q_w, qk_eps), (k_w, k_eps) = (_norm_params(n, centered) for n in (attn.q_norm, attn.k_norm))
                qk_norm = torch.cat([q_w.expand(n_q, -1), k_w.expand(self.n_kv, -1)])
                if k_eps != qk_eps:
                    return None
            (n1, eps1), (n2, eps2) = (_norm_params(n, centered) for n in norms[:2])
            fused.append(FusedLayer(n1, eps1, qkv, o, n2, eps2, gate_up, mlp.gate_proj.out_features, mlp.act_fn, down,
                                    qk_norm, qk_eps, mixer))
        head = _fuse([self.lm_head], base_only)
        if head is None or type(self.norm).__name__ != norm_type:
            return None
        self.head = head
        # the output layer is the adapters' last "layer", of one group (`_head`)
        self.groups.append(([self.lm_head],))
        return fused

    @torch.inference_mode()
    def prefill(self, input_BL: torch.Tensor, mask_BL: torch.Tensor, positions_BL: torch.Tensor,
                max_new_tokens: int) -> torch.Tensor:
        """Run the prompts with the model's own forward, copy its cache into static buffers and
        return the last position's logits `[B, V]`."""
        B, L = input_BL.shape
        if self.unmerged and self.adapters is not None:  # None: the modules' own step (`fused` is None)
            self.adapters.set_rows([0] * B)
        # a hybrid model's cache needs its config: its linear-attention layers keep states, not keys
        # (a windowed family's must not have it: it would keep only the window's keys)
        cache = DynamicCache(config=self.causal.config) if self.hybrid else DynamicCache()
        out = self.causal(input_ids=input_BL, attention_mask=mask_BL, position_ids=positions_BL,
                          cache=cache, use_cache=True, logits_to_keep=1, **self._chunking(L))
        S = L + max_new_tokens
        self.keys, self.values, self.conv, self.rec = [], [], [], []
        for layer, kind in zip(cache.layers[: len(self.layers)], self.kinds):
            if kind == "linear_attention":
                self.conv.append(layer.conv_states[0])
                self.rec.append(layer.recurrent_states[0])
                continue
            k = layer.keys.new_empty((B, self.n_kv, S, self.head_dim))
            v = torch.empty_like(k)
            k[:, :, :L] = layer.keys
            v[:, :, :L] = layer.values
            self.keys.append(k)
            self.values.append(v)
        self._setup(mask_BL, positions_BL, max_new_tokens, out.logits.dtype)
        return out.logits[:, -1]

    DELTA_CHUNKS = (32, 64)
    """Chunk sizes of transformers' chunked gated delta rule a hybrid prefill picks from."""

    def _chunking(self, L: int) -> dict:
        """A hybrid model's prefill chunk size: the smallest of `DELTA_CHUNKS` that holds the `L`
        prompt columns (transformers passes it down to `torch_chunk_gated_delta_rule`, which pads
        to a whole chunk: a 32-token prompt in its default 64 costs ~2x). Same arithmetic, another
        grouping of it, as `training.prefix_sharing._chunking` does for a continuation."""
        if not self.hybrid:
            return {}
        return {"chunk_size": next((c for c in self.DELTA_CHUNKS if L <= c), self.DELTA_CHUNKS[-1])}

    def _setup(self, mask_BL: torch.Tensor, positions_BL: torch.Tensor, max_new_tokens: int,
               dtype: torch.dtype) -> None:
        B, L = mask_BL.shape
        # rows attend to their prompt tokens and to every generated one
        self.mask_B11S = torch.ones((B, 1, 1, L + max_new_tokens), dtype=torch.bool, device=mask_BL.device)
        self.mask_B11S[:, 0, 0, :L] = mask_BL.bool()
        # rotary cos/sin of every step of every row, from the model's own rotary module
        pos_BT = positions_BL[:, -1:] + 1 + torch.arange(max_new_tokens, device=mask_BL.device)
        self.cos_BTD, self.sin_BTD = self.rotary(torch.empty(0, dtype=dtype, device=mask_BL.device), pos_BT)
        self.col = L

    @torch.inference_mode()
    def prefill_reusing(self, input_BL: torch.Tensor, mask_BL: torch.Tensor, positions_BL: torch.Tensor,
                        max_new_tokens: int, store: PromptStore | None,
                        hits: list[tuple[int, int] | None]) -> torch.Tensor:
        """Like `prefill`, but row i's first `hits[i][1]` prompt tokens take their keys and values
        from row `hits[i][0]` of `store` (the same tokens at the same positions, same weights);
        only the remaining tail of the prompts runs through the layers. Needs the fused path."""
        assert self.fused is not None
        B, L = input_BL.shape
        if self.unmerged:
            self.adapters.set_rows([0] * B)
        lens = mask_BL.sum(1).tolist()
        news = [n - (h[1] if h else 0) for n, h in zip(lens, hits)]
        T = max(news)  # new columns L-T..L-1
        S = L + max_new_tokens
        self.keys = [input_BL.new_zeros((B, self.n_kv, S, self.head_dim), dtype=self.head[0].dtype)
                     for _ in range(self.kinds.count("attention"))]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self._initial_states(hits, store)
        for i, (n, hit) in enumerate(zip(lens, hits)):
            # cached tokens left of the new block; a hybrid row keeps all of them (its linear state
            # is the one at its hit's end), the block's columns left of its new tokens are then dead
            n_copy = (hit[1] if hit else 0) if self.hybrid else n - T
            if hit is None or n_copy <= 0:
                continue
            j, _ = hit
            src = store.L - store.lengths[j]
            for dst_k, dst_v, src_k, src_v in zip(self.keys, self.values, store.keys, store.values):
                dst_k[i, :, L - n: L - n + n_copy] = src_k[j, :, src: src + n_copy]
                dst_v[i, :, L - n: L - n + n_copy] = src_v[j, :, src: src + n_copy]
        live_BT = None
        if self.hybrid:  # each row's own new tokens: the last `news[i]` columns of the block
            live_BT = (torch.arange(T, device=input_BL.device)[None, :]
                       >= T - torch.tensor(news, device=input_BL.device)[:, None])
        masks = self._block_masks(mask_BL, T)
        h = self.embed(input_BL[:, L - T:])  # [B, T, H]
        cos, sin = self.rotary(h, positions_BL[:, L - T:])
        cos, sin = cos[:, :, None], sin[:, :, None]  # [B, T, 1, D]
        for li, f in enumerate(self.fused):
            x = self._rms(h, f.norm1, f.eps1)
            if self.kinds[li] == "attention":
                h = h + self._attend_block(x, f, li, cos, sin, masks, L, live_BT)
            else:
                h = h + self._delta(x, f, li, live_BT)
            h = h + self._mlp(self._rms(h, f.norm2, f.eps2), f, li)
        x = self._rms(h[:, -1], *self.final_norm)
        self._setup(mask_BL, positions_BL, max_new_tokens, x.dtype)
        return self._head(x)

    def _initial_states(self, hits: list[tuple[int, int] | None], store: PromptStore | None) -> None:
        """Each linear-attention layer's conv and recurrent states of the rows before their new
        tokens: the stored prompt's they extend (`hits`), else a fresh row's (zeros)."""
        self.conv, self.rec = [], []
        dtype, device = self.embed.weight.dtype, self.embed.weight.device
        for f in self.fused:
            if f.mixer is None:
                continue
            conv, rec = f.mixer.empty_states(len(hits), dtype, device)
            slot = len(self.conv)
            for i, hit in enumerate(hits):
                if hit is not None:
                    conv[i] = store.states["conv"][slot][hit[0]]
                    rec[i] = store.states["rec"][slot][hit[0]]
            self.conv.append(conv)
            self.rec.append(rec)

    def _attend_block(self, x: torch.Tensor, f: FusedLayer, li: int, cos: torch.Tensor, sin: torch.Tensor,
                      masks: dict, L: int, live_BT: torch.Tensor | None) -> torch.Tensor:
        """An attention layer over the block's T columns `x` `[B, T, H]` (its keys and values
        written to columns L-T..L-1, except dead ones: `live_BT`), before the residual add."""
        B, T, _ = x.shape
        D, n_rep, n_kv = self.head_dim, self.n_rep, self.n_kv
        n_heads = n_kv * n_rep
        k_buf, v_buf = self.keys[self.slots[li]], self.values[self.slots[li]]
        qk, v, gate = self._qk_v(x, f, li, cos, sin)  # [B, T, n_heads + n_kv, D]
        k_new, v_new = qk[:, :, n_heads:].transpose(1, 2), v.transpose(1, 2)
        if live_BT is not None:  # dead columns keep the keys and values copied from the store
            live = live_BT[:, None, :, None]
            k_new, v_new = torch.where(live, k_new, k_buf[:, :, L - T: L]), torch.where(live, v_new, v_buf[:, :, L - T: L])
        k_buf[:, :, L - T: L] = k_new
        v_buf[:, :, L - T: L] = v_new
        keys, values = k_buf[:, :, :L], v_buf[:, :, :L]
        if n_rep > 1:
            keys = keys[:, :, None].expand(B, n_kv, n_rep, L, D).reshape(B, n_heads, L, D)
            values = values[:, :, None].expand(B, n_kv, n_rep, L, D).reshape(B, n_heads, L, D)
        o = attention(qk[:, :, :n_heads].transpose(1, 2), keys, values, masks[self.windows[li]], self.scaling,
                      self.invariant)
        o = o.transpose(1, 2).reshape(B, T, -1)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self._lin(o, f.o, li, 1)

    def _delta(self, x: torch.Tensor, f: FusedLayer, li: int, live_BT: torch.Tensor | None = None) -> torch.Tensor:
        """A Gated DeltaNet layer on `x` `[B, T, H]` (`delta_net.mix`), before the residual add;
        its rows' conv and recurrent states advance."""
        slot = self.slots[li]
        if live_BT is not None:  # transformers zeroes padding's input to these layers
            x = x * live_BT[..., None].to(x.dtype)
        proj = self._lin(x, f.qkv, li, 0)
        # the decoder owns its recurrent states (`states` gives others copies): a step updates them in place
        o, self.conv[slot], self.rec[slot] = delta_net.mix(f.mixer, proj, self.conv[slot], self.rec[slot], live_BT,
                                                           rowwise=self.invariant, own_state=True)
        return self._lin(o, f.o, li, 1)

    def _block_masks(self, mask_BL: torch.Tensor, T: int) -> dict[int | None, torch.Tensor]:
        """Per window (None: none), which of the L columns each of the last T columns' queries
        sees: `[B, 1, T, L]` booleans. A windowed query sees the `window` columns ending at its
        own, as transformers' sliding mask (`kv > q - window`, in cache columns)."""
        B, L = mask_BL.shape
        dev = mask_BL.device
        q_col = torch.arange(L - T, L, device=dev)
        k_col = torch.arange(L, device=dev)
        out = {}
        for w in set(self.windows):
            causal_TL = k_col[None, :] <= q_col[:, None]
            if w is not None:
                causal_TL &= k_col[None, :] > q_col[:, None] - w
            allowed = mask_BL.bool()[:, None, :] & causal_TL[None]
            allowed[:, torch.arange(T, device=dev), q_col] = True  # pad queries see themselves: no NaN
            out[w] = allowed[:, None]
        return out

    def _qk_v(self, x: torch.Tensor, f: FusedLayer, li: int, cos: torch.Tensor, sin: torch.Tensor):
        """q and k heads side by side, normed where the family says and rotated, `[..., n_q + n_kv, D]`,
        the v heads `[..., n_kv, D]`, and the output gate `[..., n_q * D]` (None unless the family
        gates: Qwen3.5's q_proj gives `[q_h, gate_h]` per head) of `x` `[..., H]` (`cos`/`sin`
        broadcast over heads)."""
        D, n_kv = self.head_dim, self.n_kv
        n_q = n_kv * self.n_rep
        qkv = self._lin(x, f.qkv, li, 0)
        lead = qkv.shape[:-1]
        gate = None
        if self.arch.family.attn_gate:
            q_gate = qkv[..., : 2 * n_q * D].view(*lead, n_q, 2 * D)
            gate = q_gate[..., D:].reshape(*lead, n_q * D)
            k = qkv[..., 2 * n_q * D: (2 * n_q + n_kv) * D].view(*lead, n_kv, D)
            qk = torch.cat([q_gate[..., :D], k], dim=-2)
            v = qkv[..., (2 * n_q + n_kv) * D:].view(*lead, n_kv, D)
        else:
            qk = qkv[..., : (n_q + n_kv) * D].view(*lead, n_q + n_kv, D)
            v = qkv[..., (n_q + n_kv) * D:].view(*lead, n_kv, D)
        if f.qk_norm is not None:
            qk = self._rms(qk, f.qk_norm, f.qk_eps)
        return self._rotate(qk, cos, sin), v, gate

    @staticmethod
    def _rotate(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The rotary on the first `cos.shape[-1]` dims of each head (all of them but for a partial rotary)."""
        r = cos.shape[-1]
        if r == qk.shape[-1]:
            return (qk * cos) + (rotate_half(qk) * sin)
        rot = qk[..., :r]
        return torch.cat([(rot * cos) + (rotate_half(rot) * sin), qk[..., r:]], dim=-1)

    def _mlp(self, x: torch.Tensor, f: FusedLayer, li: int) -> torch.Tensor:
        gate, up = self._lin(x, f.gate_up, li, 2).split([f.inter, f.inter], dim=-1)
        return self._lin(f.act(gate) * up, f.down, li, 3)

    def set_adapters(self, names: list[str | None], row_adapter: list[int]) -> bool:
        """Rows decode with adapter `names[row_adapter[i]]` (None: the bare base); base-only
        decoders only. False, and nothing set, when an adapter is not a vanilla LoRA."""
        assert self.base_only and self.fused is not None
        self.adapters = RowAdapters.build(self.groups, names, row_adapter, self.invariant)
        return self.adapters is not None

    def _lin(self, x: torch.Tensor, wb: tuple[torch.Tensor, torch.Tensor | None], layer: int,
             group: int) -> torch.Tensor:
        """The fused linear `wb` on `x` [B, ..., in], plus each row's own adapter delta (a
        base-only decoder): the base matmul runs once over every row, then each row adds its own
        adapter's delta only (`RowAdapters.add_delta`: in the adapters' dtype, as PEFT does)."""
        y = invariant_linear(x, *wb) if self.invariant else rows_linear(x, *wb)
        if self.adapters is not None:
            self.adapters.add_delta(y, x, layer, group)
        return y

    def store(self, prompts: list[tuple[int, ...]], fingerprint: tuple) -> PromptStore:
        """The prompts' keys and values of the last prefill (decoding writes only later columns)."""
        return PromptStore(self.keys, self.values, self.col, [len(p) for p in prompts],
                           {p: i for i, p in enumerate(prompts)}, fingerprint, self.states())

    def states(self) -> dict[str, list[torch.Tensor]]:
        """The linear-attention layers' per-row states now, for a `PromptStore`: the conv states
        as they are (a step replaces them), copies of the recurrent ones (a step writes into them)."""
        return {"conv": list(self.conv), "rec": [r.clone() for r in self.rec]} if self.hybrid else {}

    def _per_row(self) -> dict[str, list[torch.Tensor]]:
        """Every per-row tensor of the batch's state (batch first), by name: what `select`
        drops and repeats (a Gated DeltaNet layer's conv and recurrent states with the keys and values)."""
        return {"keys": self.keys, "values": self.values, "conv": self.conv, "rec": self.rec}

    def select(self, keep_idx: torch.Tensor) -> None:
        """Keep (or repeat) the rows `keep_idx`: a copy of the cache, call it rarely."""
        for name, tensors in self._per_row().items():
            setattr(self, name, [t.index_select(0, keep_idx) for t in tensors])
        self.mask_B11S = self.mask_B11S.index_select(0, keep_idx)
        self.cos_BTD = self.cos_BTD.index_select(0, keep_idx)
        self.sin_BTD = self.sin_BTD.index_select(0, keep_idx)
        if self.adapters is not None:
            self.adapters.keep(keep_idx.tolist())

    @torch.inference_mode()
    def step(self, tok_B: torch.Tensor, t: int) -> torch.Tensor:
        """Feed token `tok_B` as generated token number `t` (0-based); return next logits `[B, V]`."""
        col = self.col + t
        cos = self.cos_BTD[:, t:t + 1].unsqueeze(1)  # [B, 1, 1, D]: broadcast over heads
        sin = self.sin_BTD[:, t:t + 1].unsqueeze(1)
        mask = self.mask_B11S[..., : col + 1]
        h = self.embed(tok_B[:, None])  # [B, 1, H]
        if self.fused is None:
            return self._step_modules(h, cos, sin, mask, col)
        for li, f in enumerate(self.fused):
            x = self._rms(h, f.norm1, f.eps1)
            if self.kinds[li] == "attention":
                h = h + self._attend_step(x, f, li, cos, sin, mask, col)
            else:
                h = h + self._delta(x, f, li)
            h = h + self._mlp(self._rms(h, f.norm2, f.eps2), f, li)
        x = self._rms(h[:, -1], *self.final_norm)
        return self._head(x)

    def _attend_step(self, x: torch.Tensor, f: FusedLayer, li: int, cos: torch.Tensor, sin: torch.Tensor,
                     mask: torch.Tensor, col: int) -> torch.Tensor:
        """An attention layer for one new token per row `x` `[B, 1, H]` at cache column `col`."""
        B, D, n_rep, n_kv = x.shape[0], self.head_dim, self.n_rep, self.n_kv
        n_heads = n_kv * n_rep
        k_buf, v_buf, w = self.keys[self.slots[li]], self.values[self.slots[li]], self.windows[li]
        qk, v, gate = self._qk_v(x, f, li, cos, sin)  # [B, 1, n_heads + n_kv, D]
        k_buf[:, :, col] = qk[:, 0, n_heads:]
        v_buf[:, :, col] = v[:, 0]
        lo = 0 if w is None else max(0, col + 1 - w)  # a sliding window: its last `w` columns
        # one query token: transformers packs the heads of a group as queries (GQA)
        q = qk[:, 0, :n_heads].reshape(B, n_kv, n_rep, D) if n_rep > 1 else qk[:, 0, :n_heads, None]
        o = attention(q, k_buf[:, :, lo: col + 1], v_buf[:, :, lo: col + 1], mask[..., lo:], self.scaling,
                      self.invariant).reshape(B, 1, -1)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self._lin(o, f.o, li, 1)

    def _head(self, x_BH: torch.Tensor) -> torch.Tensor:
        """The output layer's logits `[B, V]`: the base weight once over every row, then each
        row's own adapter delta where its adapter has LoRA there (Tinker's `train_unembed`, the
        SDK's default). The delta is added after the base product as PEFT adds it (in the
        adapters' dtype, rounded once: `RowAdapters.add_delta`), batch-invariant on CPU as
        every linear's, so a row's logits do not depend on its batch."""
        y_BV = blocked_linear(x_BH, *self.head, invariant=self.invariant)
        if self.adapters is not None:
            self.adapters.add_delta(y_BV, x_BH, len(self.layers), 0)
        return y_BV

    def _step_modules(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                      col: int) -> torch.Tensor:
        """The same step through the model's sub-modules (adapters the fused path can't merge)."""
        B, D, n_rep, n_kv = h.shape[0], self.head_dim, self.n_rep, self.n_kv
        qk_norm = self.arch.family.qk_norm
        for layer, k_buf, v_buf, w in zip(self.layers, self.keys, self.values, self.windows):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q, k = attn.q_proj(x).view(B, 1, -1, D), attn.k_proj(x).view(B, 1, -1, D)
            if qk_norm:
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = attn.v_proj(x).view(B, 1, -1, D).transpose(1, 2)
            q = (q * cos) + (rotate_half(q) * sin)
            k = (k * cos) + (rotate_half(k) * sin)
            k_buf[:, :, col:col + 1] = k
            v_buf[:, :, col:col + 1] = v
            if n_rep > 1:  # transformers' one-query GQA packing: heads of a group as queries
                q = q.reshape(B, n_kv, n_rep, D)
            lo = 0 if w is None else max(0, col + 1 - w)
            o = F.scaled_dot_product_attention(q, k_buf[:, :, lo: col + 1], v_buf[:, :, lo: col + 1],
                                               attn_mask=mask[..., lo:], scale=self.scaling)
            o = o.reshape(B, -1, 1, D).transpose(1, 2).reshape(B, 1, -1)
            h = h + attn.o_proj(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = self.norm(h)
        return self.lm_head(h[:, -1])
