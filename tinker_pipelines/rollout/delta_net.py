"""Qwen3.5's Gated DeltaNet layer as a lean decoder layer kind ('linear_attention').

Instead of keys and values, each row carries two states per layer: the last `K` inputs of the
layer's short depthwise convolution (`conv_BCK`, C = q|k|v channels) and the recurrent state of
the gated delta rule (`state_BHKV`, fp32, one `[Dk, Dv]` matrix per value head). A decode step
updates both in the recurrent form; a prefill block of many tokens runs transformers' own chunked
form (`torch_chunk_gated_delta_rule`) from each row's initial states. The arithmetic follows
transformers' torch path (`Qwen3_5GatedDeltaNet.forward`, `causal_conv1d_update`,
`torch_recurrent_gated_delta_rule`) op for op, so greedy tokens equal `generate`'s, except where a
decode step computes the same sums in another order to run faster (`_conv_step`, the recurrent
step's matvecs): ~1e-7 apart in fp32, and still independent of the batch.

A prefill block may hold, left of a row's new tokens, columns that are not the row's to run:
left padding, or cached prompt tokens of a longer row's block (`LeanDecoder.prefill_reusing`).
Those columns are "dead" (`live_BT` false): their input is zeroed as transformers zeroes padding,
their decay and write strength are 0, so the recurrent state passes them unchanged, and the
conv state is moved right next to the row's first new token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN


def _hf():
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return modeling_qwen3_5


def _lanes(fn: Callable, x: torch.Tensor) -> torch.Tensor:
    """`fn(x)` (exp, sigmoid, softplus) with the last dim padded to 64 values: torch computes
    the tail of a tensor that fills no whole vector with scalar code whose floats differ from the
    vector code's, so over `[B, T, Hv]` a row's values changed with the batch size (Hv = 4)."""
    pad = -x.shape[-1] % 64
    return fn(F.pad(x, (0, pad)))[..., : x.shape[-1]] if pad else fn(x)


@dataclass(slots=True)
class DeltaNet:
    """One Gated DeltaNet layer's parameters besides its in and out projections."""

    conv_CK: torch.Tensor
    conv_bias: torch.Tensor | None
    neg_A_H: torch.Tensor
    """-exp(A_log) in fp32: the per-head decay rate."""
    dt_bias_H: torch.Tensor
    norm: torch.nn.Module
    """The gated RMSNorm (`Qwen3_5RMSNormGated`), run as the module itself."""
    act: Callable
    n_k: int
    n_v: int
    dk: int
    dv: int

    @classmethod
    def of(cls, lin: torch.nn.Module) -> "DeltaNet | None":
        """`lin`'s (a `Qwen3_5GatedDeltaNet`) parameters, or None where an adapter changed its conv."""
        if type(lin.conv1d) is not torch.nn.Conv1d:
            return None
        return cls(lin.conv1d.weight.squeeze(1), lin.conv1d.bias, -lin.A_log.float().exp(), lin.dt_bias, lin.norm,
                   ACT2FN[lin.activation], lin.num_k_heads, lin.num_v_heads, lin.head_k_dim, lin.head_v_dim)

    @property
    def splits(self) -> list[int]:
        """in_proj's outputs side by side: q|k|v (the conv's channels), z, b, a."""
        key, value = self.n_k * self.dk, self.n_v * self.dv
        return [2 * key + value, value, self.n_v, self.n_v]

    def empty_states(self, B: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """A fresh row's conv state `[B, C, K]` (model dtype) and recurrent state `[B, Hv, Dk, Dv]` (fp32)."""
        C, K = self.conv_CK.shape
        return (torch.zeros((B, C, K), dtype=dtype, device=device),
                torch.zeros((B, self.n_v, self.dk, self.dv), dtype=torch.float32, device=device))


def _conv(d: DeltaNet, x_BCT: torch.Tensor, conv_BCK: torch.Tensor, live_BT: torch.Tensor | None):
    """The causal depthwise conv of `x_BCT` after each row's last K inputs; (output, new conv state).
    With `live_BT`, a row's conv state is moved next to its first live column."""
    B, C, T = x_BCT.shape
    K = d.conv_CK.shape[1]
    if T == 1 and live_BT is None:
        return _conv_step(d, x_BCT, conv_BCK)
    seq_BCW = torch.cat([conv_BCK, x_BCT], dim=-1).to(d.conv_CK.dtype)
    if live_BT is not None:
        for i, m in enumerate(live_BT.sum(1).tolist()):
            if m < T:  # dead columns are zeros (input masked): the state goes right before the live ones
                seq_BCW[i, :, : T - m + K] = 0
                seq_BCW[i, :, T - m: T - m + K] = conv_BCK[i]
    out = F.conv1d(seq_BCW, d.conv_CK.unsqueeze(1), d.conv_bias, padding=0, groups=C)[:, :, -T:]
    return d.act(out).to(x_BCT.dtype), seq_BCW[:, :, -K:]


def _conv_step(d: DeltaNet, x_BC1: torch.Tensor, conv_BCK: torch.Tensor):
    """`_conv` for one token: the state shifts by one column and the output is its K-tap dot
    product with the kernel, in fp32 (a conv1d over K + 1 columns costs twice this at decode
    sizes, for one output column in two). Elementwise ops and a reduction over each row's own
    K values, so a row's floats do not depend on the batch."""
    B, C, K = conv_BCK.shape
    # the shift as one contiguous copy of the flattened state (a cat of 3 + 1 columns copies in
    # 3-value pieces, 4x slower); the column that wraps in from the next channel is overwritten
    seq_BCK = torch.empty_like(conv_BCK)
    seq_BCK.view(B, C * K)[:, :-1] = conv_BCK.reshape(B, C * K)[:, 1:]
    seq_BCK[:, :, K - 1] = x_BC1[:, :, 0]
    out_BC1 = (seq_BCK.float() * d.conv_CK.float()).sum(-1, keepdim=True)
    if d.conv_bias is not None:
        out_BC1 = out_BC1 + d.conv_bias.float()[:, None]
    return d.act(out_BC1.to(seq_BCK.dtype)).to(x_BC1.dtype), seq_BCK


def _recurrent_step(q, k, v, g, beta, state_BHKV, in_place: bool = False):
    """`torch_recurrent_gated_delta_rule` for one token: q/k `[B, Hk, Dk]`, v `[B, Hv, Dv]`,
    g/beta `[B, Hv]`; returns (output `[B, Hv, Dv]` in v's dtype, new state). `in_place`: the
    caller owns `state_BHKV` (no one else holds it), so it is updated where it is."""
    dtype = v.dtype
    n_rep = v.shape[1] // k.shape[1]
    l2norm = _hf().l2norm  # per head, so before the heads repeat: the same floats, n_rep times fewer
    q = l2norm(q.float(), dim=-1, eps=1e-6)
    k = l2norm(k.float(), dim=-1, eps=1e-6)
    q = q / (q.shape[-1] ** 0.5)
    if n_rep > 1:
        q, k = q.repeat_interleave(n_rep, dim=1), k.repeat_interleave(n_rep, dim=1)
    # k^T S and q^T S are batched matvecs, where broadcast-and-sum made [B, Hv, Dk, Dv]
    # temporaries (each matvec is one row's and head's: its floats do not depend on the batch).
    # A fresh 2 MB state per layer and step cost ~10x the multiply itself (new pages each time):
    # an owned state decays in place; another (a `PromptStore` may hold it) into a new tensor.
    decay_BH11 = _lanes(torch.exp, g.float())[..., None, None]
    state_BHKV = state_BHKV.mul_(decay_BH11) if in_place else state_BHKV * decay_BH11
    kv_mem_BHV = torch.matmul(k.unsqueeze(-2), state_BHKV).squeeze(-2)
    delta_BHV = (v.float() - kv_mem_BHV) * beta.float().unsqueeze(-1)
    state_BHKV.addcmul_(k.unsqueeze(-1), delta_BHV.unsqueeze(-2))
    return torch.matmul(q.unsqueeze(-2), state_BHKV).squeeze(-2).to(dtype), state_BHKV


def _chunked_rows(q, k, v, g, beta, state_BHKV, live_BT: torch.Tensor):
    """The chunked form row by row over each row's live columns only: a row's floats then do
    not depend on the other rows or on the block's width (batched, they changed by ~1e-9 with
    the batch: `LeanDecoder.invariant`). Dead columns' outputs are zeros."""
    o = torch.zeros_like(v)
    states = []
    for i, m in enumerate(live_BT.sum(1).tolist()):
        T = v.shape[1]
        o_i, s_i = _hf().torch_chunk_gated_delta_rule(
            q[i:i + 1, T - m:], k[i:i + 1, T - m:], v[i:i + 1, T - m:], g=g[i:i + 1, T - m:],
            beta=beta[i:i + 1, T - m:], initial_state=state_BHKV[i:i + 1], output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        o[i, T - m:] = o_i[0]
        states.append(s_i)
    return o, torch.cat(states)


def mix(d: DeltaNet, proj_BTP: torch.Tensor, conv_BCK: torch.Tensor, state_BHKV: torch.Tensor,
        live_BT: torch.Tensor | None = None, rowwise: bool = False,
        own_state: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer between its projections: `proj_BTP` is in_proj's output (q|k|v, z, b, a) of the
    (masked) normed input; returns (the gated norm's output `[B, T, Hv * Dv]`, for out_proj, the
    new conv state, the new recurrent state). One token steps the recurrent form; more run the
    chunked form, with `live_BT` marking each row's own columns (`rowwise`: one row at a time).
    `own_state`: no one but the caller holds `state_BHKV`, so a decode step writes into it."""
    B, T, _ = proj_BTP.shape
    mixed, z, b, a = proj_BTP.split(d.splits, dim=-1)
    out_BCT, conv_BCK = _conv(d, mixed.transpose(1, 2), conv_BCK, live_BT)
    key = d.n_k * d.dk
    q, k, v = out_BCT.transpose(1, 2).split([key, key, d.n_v * d.dv], dim=-1)
    beta = _lanes(torch.sigmoid, b)
    g = d.neg_A_H * _lanes(F.softplus, a.float() + d.dt_bias_H)
    if T == 1 and live_BT is None:
        o, state_BHKV = _recurrent_step(q.reshape(B, d.n_k, d.dk), k.reshape(B, d.n_k, d.dk),
                                        v.reshape(B, d.n_v, d.dv), g[:, 0], beta[:, 0], state_BHKV, own_state)
        o = o[:, None]
    elif rowwise and live_BT is not None:
        o, state_BHKV = _chunked_rows(q.reshape(B, T, d.n_k, d.dk), k.reshape(B, T, d.n_k, d.dk),
                                      v.reshape(B, T, d.n_v, d.dv), g, beta, state_BHKV, live_BT)
    else:
        if live_BT is not None:  # dead columns neither decay nor write the state
            dead = ~live_BT[..., None]
            g, beta = g.masked_fill(dead, 0.0), beta.masked_fill(dead, 0.0)
        o, state_BHKV = _hf().torch_chunk_gated_delta_rule(
            q.reshape(B, T, d.n_k, d.dk), k.reshape(B, T, d.n_k, d.dk), v.reshape(B, T, d.n_v, d.dv), g=g, beta=beta,
            initial_state=state_BHKV, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o = d.norm(o.reshape(-1, d.dv), z.reshape(-1, d.dv))
    return o.reshape(B, T, -1), conv_BCK, state_BHKV
