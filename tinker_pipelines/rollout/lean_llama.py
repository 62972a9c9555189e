"""A lean decode step for Llama-style models with a pre-allocated (static) KV cache.

Hugging Face's forward spends a few milliseconds per decode step on CPU outside the matmuls:
building a 4-D mask, growing every layer's cache with `torch.cat` (a copy of the whole cache per
step), rotary tables, output dataclasses and decorators. This module runs the same computation
for one new token per row with none of that:

- keys and values go into buffers allocated once per `sample` call (prompt + max_new_tokens);
- the attention mask is a boolean `[B, 1, 1, S]` built once and sliced per step;
- rotary cos/sin for every row and step are computed once (the model's own rotary module);
- the sub-modules (norms, projections, MLP, lm_head) are the model's own, called as modules,
  so a PEFT LoRA adapter injected into them is applied exactly as in the model's forward.

The attention call mirrors transformers' SDPA path for one query token (grouped-query heads
packed along the query axis), so greedy outputs match `model.generate` token for token.
Only plain `LlamaForCausalLM` (optionally inside a PEFT LoRA wrapper) with SDPA attention and
default rotary scaling is supported; `LeanLlamaDecoder.supports` says so and callers fall back to
the model's own forward otherwise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaForCausalLM, rotate_half


def unwrap_causal_lm(model: torch.nn.Module) -> torch.nn.Module:
    """The causal LM inside a PEFT wrapper (its LoRA layers stay injected), else `model`."""
    get_base = getattr(model, "get_base_model", None)
    if get_base is not None:
        cfg = getattr(model, "active_peft_config", None)
        if cfg is not None and getattr(cfg, "is_prompt_learning", False):
            return model  # prompt tuning changes the inputs: keep the wrapper's forward
        return get_base()
    return model


def linear_params(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
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


def _fuse(modules: list[torch.nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """One weight (and bias) computing the outputs of `modules` side by side, or None."""
    params = [linear_params(m) for m in modules]
    if any(p is None for p in params):
        return None
    if len(params) == 1:
        return params[0]
    weight = torch.cat([w for w, _ in params])
    if all(b is None for _, b in params):
        return weight, None
    bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in params])
    return weight, bias


class LeanLlamaDecoder:
    """Decode steps for one batch: `prefill` once, then `step` per new token; `select` drops or repeats rows."""

    @staticmethod
    def supports(model: torch.nn.Module) -> bool:
        causal = unwrap_causal_lm(model)
        if type(causal) is not LlamaForCausalLM:
            return False
        cfg = causal.config
        rope = getattr(cfg, "rope_parameters", None) or {}
        return (cfg._attn_implementation == "sdpa" and rope.get("rope_type", "default") == "default"
                and not getattr(causal.model, "gradient_checkpointing", False) and not causal.training
                and all(not layer.training for layer in causal.model.layers))

    def __init__(self, model: PreTrainedModel):
        self.causal = unwrap_causal_lm(model)
        inner = self.causal.model
        cfg = self.causal.config
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers[: cfg.num_hidden_layers])
        self.norm = inner.norm
        self.rotary = inner.rotary_emb
        self.lm_head = self.causal.lm_head
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.n_rep = attn.num_key_value_groups
        self.scaling = attn.scaling
        self.n_kv = cfg.num_key_value_heads
        # Per layer: fused q|k|v and gate|up weights (a fused matmul gives bitwise the same
        # outputs as separate ones and saves calls); LoRA adapters are merged in. The matmuls
        # run on these copies, so build a decoder per `sample` call (weights may have changed).
        self.fused = self._fuse_weights()

    def _fuse_weights(self) -> list[tuple] | None:
        fused = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            norms_ok = all(type(n).__name__ == "LlamaRMSNorm"
                           for n in (layer.input_layernorm, layer.post_attention_layernorm))
            qkv = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
            o = _fuse([attn.o_proj])
            gate_up = _fuse([mlp.gate_proj, mlp.up_proj])
            down = _fuse([mlp.down_proj])
            if not norms_ok or None in (qkv, o, gate_up, down):
                return None
            q_out, kv_out = attn.q_proj.out_features, attn.k_proj.out_features
            fused.append((layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon,
                          qkv, (q_out, kv_out, kv_out), o,
                          layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon,
                          gate_up, mlp.gate_proj.out_features, mlp.act_fn, down))
        head = _fuse([self.lm_head])
        if head is None or type(self.norm).__name__ != "LlamaRMSNorm":
            return None
        self.head = head
        return fused

    @torch.inference_mode()
    def prefill(self, input_BL: torch.Tensor, mask_BL: torch.Tensor, positions_BL: torch.Tensor,
                max_new_tokens: int) -> torch.Tensor:
        """Run the prompts with the model's own forward, copy its cache into static buffers and
        return the last position's logits `[B, V]`."""
        B, L = input_BL.shape
        cache = DynamicCache()
        out = self.causal(input_ids=input_BL, attention_mask=mask_BL, position_ids=positions_BL,
                          cache=cache, use_cache=True, logits_to_keep=1)
        S = L + max_new_tokens
        self.keys, self.values = [], []
        for layer in cache.layers[: len(self.layers)]:
            k = layer.keys.new_empty((B, self.n_kv, S, self.head_dim))
            v = torch.empty_like(k)
            k[:, :, :L] = layer.keys
            v[:, :, :L] = layer.values
            self.keys.append(k)
            self.values.append(v)
        # rows attend to their prompt tokens and to every generated one
        self.mask_B11S = torch.ones((B, 1, 1, S), dtype=torch.bool, device=input_BL.device)
        self.mask_B11S[:, 0, 0, :L] = mask_BL.bool()
        # rotary cos/sin of every step of every row, from the model's own rotary module
        pos_BT = positions_BL[:, -1:] + 1 + torch.arange(max_new_tokens, device=input_BL.device)
        dummy = out.logits.new_empty(0)
        self.cos_BTD, self.sin_BTD = self.rotary(dummy, pos_BT)
        self.col = L
        return out.logits[:, -1]

    def select(self, keep_idx: torch.Tensor) -> None:
        """Keep (or repeat) the rows `keep_idx`: a copy of the cache, call it rarely."""
        self.keys = [k.index_select(0, keep_idx) for k in self.keys]
        self.values = [v.index_select(0, keep_idx) for v in self.values]
        self.mask_B11S = self.mask_B11S.index_select(0, keep_idx)
        self.cos_BTD = self.cos_BTD.index_select(0, keep_idx)
        self.sin_BTD = self.sin_BTD.index_select(0, keep_idx)

    @torch.inference_mode()
    def step(self, tok_B: torch.Tensor, t: int) -> torch.Tensor:
        """Feed token `tok_B` as generated token number `t` (0-based); return next logits `[B, V]`."""
        col = self.col + t
        B = tok_B.shape[0]
        D, n_rep, n_kv = self.head_dim, self.n_rep, self.n_kv
        cos = self.cos_BTD[:, t:t + 1].unsqueeze(1)  # [B, 1, 1, D]
        sin = self.sin_BTD[:, t:t + 1].unsqueeze(1)
        mask = self.mask_B11S[..., : col + 1]
        h = self.embed(tok_B[:, None])  # [B, 1, H]
        if self.fused is None:
            return self._step_modules(h, cos, sin, mask, col)
        n_heads = n_kv * n_rep
        n_qk = n_heads + n_kv
        cos, sin = cos[:, 0], sin[:, 0]  # [B, 1, D]: broadcast over heads
        for (w1, eps1, (w_qkv, b_qkv), _, (w_o, b_o), w2, eps2, (w_gu, b_gu), inter, act,
             (w_d, b_d)), k_buf, v_buf in zip(self.fused, self.keys, self.values):
            x = h.pow(2).mean(-1, keepdim=True)  # LlamaRMSNorm, op for op
            x = w1 * (h * torch.rsqrt(x + eps1))
            qkv = F.linear(x, w_qkv, b_qkv)[:, 0]  # [B, (n_heads + 2 n_kv) D]
            qk = qkv[:, : n_qk * D].view(B, n_qk, D)  # rotary on q and k heads at once
            qk = (qk * cos) + (rotate_half(qk) * sin)
            k_buf[:, :, col] = qk[:, n_heads:]
            v_buf[:, :, col] = qkv[:, n_qk * D:].view(B, n_kv, D)
            # one query token: transformers packs the heads of a group as queries (GQA)
            q = qk[:, :n_heads].reshape(B, n_kv, n_rep, D) if n_rep > 1 else qk[:, :n_heads, None]
            o = F.scaled_dot_product_attention(q, k_buf[:, :, : col + 1], v_buf[:, :, : col + 1],
                                               attn_mask=mask, scale=self.scaling)
            o = o.reshape(B, 1, -1)
            h = h + F.linear(o, w_o, b_o)
            x = h.pow(2).mean(-1, keepdim=True)
            x = w2 * (h * torch.rsqrt(x + eps2))
            gate, up = F.linear(x, w_gu, b_gu).split([inter, inter], dim=-1)
            h = h + F.linear(act(gate) * up, w_d, b_d)
        x = h[:, -1]
        x = self.norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.norm.variance_epsilon))
        return F.linear(x, *self.head)

    def _step_modules(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                      col: int) -> torch.Tensor:
        """The same step through the model's sub-modules (adapters the fused path can't merge)."""
        B, D, n_rep, n_kv = h.shape[0], self.head_dim, self.n_rep, self.n_kv
        for layer, k_buf, v_buf in zip(self.layers, self.keys, self.values):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(B, 1, -1, D).transpose(1, 2)
            k = attn.k_proj(x).view(B, 1, -1, D).transpose(1, 2)
            v = attn.v_proj(x).view(B, 1, -1, D).transpose(1, 2)
            q = (q * cos) + (rotate_half(q) * sin)
            k = (k * cos) + (rotate_half(k) * sin)
            k_buf[:, :, col:col + 1] = k
            v_buf[:, :, col:col + 1] = v
            if n_rep > 1:  # transformers' one-query GQA packing: heads of a group as queries
                q = q.reshape(B, n_kv, n_rep, D)
            o = F.scaled_dot_product_attention(q, k_buf[:, :, : col + 1], v_buf[:, :, : col + 1],
                                               attn_mask=mask, scale=self.scaling)
            o = o.reshape(B, -1, 1, D).transpose(1, 2).reshape(B, 1, -1)
            h = h + attn.o_proj(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = self.norm(h)
        return self.lm_head(h[:, -1])
