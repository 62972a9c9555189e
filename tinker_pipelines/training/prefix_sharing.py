"""Shared-prefix training forward: a group's common prompt runs once, its completions attend to it.

In a GRPO/RLOO/DPO micro-batch, consecutive datums often share a long token prefix (the prompt),
which carries no loss. `plan_prefix_sharing` finds those runs from the tokens alone;
`shared_prefix_forward` runs each run's prefix once (one row per run), expands the prefix's
per-layer keys and values to the run's rows, and runs every datum's continuation on top of them
with its own positions and a mask that hides other runs' prefix padding. The keys and values stay
in the autograd graph, so the result and its gradients are those of the plain forward (LoRA
adapters on k/v projections and full-parameter training included), at the cost of the prefix
tokens once per run instead of once per datum.

The prefix of a run always ends before the first weighted target position of each member, so
every position that carries loss (multi-turn episodes included) is computed in the continuation.
It runs for every family of `rollout.architectures` (Llama, Qwen2/2.5, Qwen3, Mistral, Qwen3.5): a
layer with a sliding window gets the window in its continuation mask (`_additive_mask`), as
transformers' own sliding mask bounds the plain forward. A Gated DeltaNet layer (Qwen3.5) has
no keys and values: its prefix state is its conv and recurrent states at the prefix's end, which
each row continues from (`_hybrid_prefix_pass`, `_StateLayer`).
A caller that needs every position's logprob (Tinker's `forward_backward` returns them) asks for
`every_position`: the prefix's positions then come from the prefix pass's logits, without
gradient (they carry no loss), once per run instead of once per row with gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

from tinker_pipelines.rollout.architectures import FAMILIES, family_of, rope_problem
from tinker_pipelines.rollout.truncation import CHUNK_ELEMENTS, target_logprobs
from tinker_pipelines.training.activation_checkpointing import decoder_layers

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
"""Architectures whose forward is verified to take a grad-carrying `DynamicCache`, explicit
position ids and a 4D additive mask (tests/test_prefix_sharing.py, tests/test_architectures.py)."""
SHARED_KINDS = ("attention", "linear_attention")
"""Layer kinds (`Family.layer_kinds`) whose prefix state the shared forward hands to each row:
keys and values, or a Gated DeltaNet layer's conv and recurrent states (`_StateLayer`)."""
MIN_SHARED_TOKENS = 4
"""A run must share at least this many tokens to be worth a prefix row."""
MAX_COST_SHARE = 0.8
"""Share only when the padded token count of both passes is below this share of the plain one."""


@dataclass(frozen=True)
class PrefixPlan:
    """How a right-padded [B, T] micro-batch splits into shared prefixes and continuations."""

    run_B: torch.Tensor
    """Index of each row's run (prefix row), long [B]."""
    prefix_len_P: torch.Tensor
    """Shared prefix length of each run, long [P]."""
    lengths_B: torch.Tensor
    """Unpadded length of each row, long [B]."""

    @property
    def prefix_len_B(self) -> torch.Tensor:
        return self.prefix_len_P[self.run_B]

    @property
    def cont_len_B(self) -> torch.Tensor:
        return self.lengths_B - self.prefix_len_B


def supports_prefix_sharing(model: torch.nn.Module) -> bool:
    """Whether the shared forward is known to equal the plain one for this model."""
    return prefix_sharing_problem(model) is None


def prefix_sharing_problem(model: torch.nn.Module) -> str | None:
    """Why the shared forward may not equal the plain one for this model (one line), or None."""
    config = getattr(model, "config", None)
    family = family_of(config)
    if family is None:
        return f"model_type {getattr(config, 'model_type', None)!r} is not one of {', '.join(SUPPORTED_MODEL_TYPES)}"
    impl = getattr(config, "_attn_implementation", None)
    if impl not in ("sdpa", "eager"):
        return f"attention implementation {impl!r} is not 'sdpa' or 'eager'"
    odd = set(family.layer_kinds(config)) - set(SHARED_KINDS)
    if odd:
        return f"layer kinds {sorted(odd)}: only {', '.join(SHARED_KINDS)} layers take a shared prefix's state"
    # a prefix pass and a longer continuation must see one rotary table; the HF forward rotates
    # a partial head itself (Qwen3.5), so only a table that moves between calls is refused
    return rope_problem(config, partial_ok=True)


def plan_prefix_sharing(inputs_BT: torch.Tensor, mask_BT: torch.Tensor, weights_BT: torch.Tensor,
                        min_shared: int = MIN_SHARED_TOKENS, max_cost: float = MAX_COST_SHARE,
                        breaks: frozenset[int] = frozenset()) -> PrefixPlan | None:
    """Group consecutive rows that share a token prefix; None when sharing would not pay.

    A row may share at most up to its first weighted position (that position's logit is needed).
    A row joins the current run when the run's shared length stays >= `min_shared` and the
    run's saving (members beyond the first x shared length) does not drop by joining. A row in
    `breaks` always starts a new run (rows of another experiment: its adapter makes other keys)."""
    B, T = inputs_BT.shape
    if B < 2:
        return None
    lengths_B = mask_BT.sum(dim=1)
    has_w_B = weights_BT.ne(0).any(dim=1)
    first_w_B = torch.where(has_w_B, weights_BT.ne(0).float().argmax(dim=1), lengths_B)
    cap = first_w_B.tolist()
    rows, lengths = inputs_BT.tolist(), lengths_B.tolist()
    runs: list[int] = []
    prefix_lens: list[int] = []
    start, n, p = 0, 1, cap[0]
    for j in range(1, B + 1):
        if j < B and j not in breaks:
            a, b = rows[start], rows[j]
            m = min(lengths[start], lengths[j], p, cap[j])
            lcp = next((k for k in range(m) if a[k] != b[k]), m)
            if lcp >= min_shared and n * lcp >= (n - 1) * p:
                n, p = n + 1, lcp
                continue
        runs += [len(prefix_lens)] * n
        prefix_lens.append(p)
        if j < B:
            start, n, p = j, 1, cap[j]
    P = len(prefix_lens)
    if P == B:
        return None
    dev = inputs_BT.device
    plan = PrefixPlan(torch.tensor(runs, device=dev), torch.tensor(prefix_lens, device=dev), lengths_B)
    cost = P * max(prefix_lens) + B * int(plan.cont_len_B.max())
    if cost >= max_cost * B * T:
        return None
    return plan


def _additive_mask(plan: PrefixPlan, Lp: int, Lc: int, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
    """[B, 1, Lc, Lp + Lc]: a continuation token sees its run's prefix (not the prefix rows'
    padding) and its own earlier continuation tokens; continuation padding only follows valid
    tokens. With a sliding `window`, a token at position p sees positions p - window + 1 .. p, as
    transformers' sliding mask lets it in the plain (right-padded) forward."""
    device = plan.prefix_len_P.device
    k_K, j_C = torch.arange(Lp, device=device), torch.arange(Lc, device=device)
    prefix_ok_BCK = (k_K[None, :] < plan.prefix_len_B[:, None])[:, None, :].expand(-1, Lc, -1)
    causal_CC = j_C[None, :] <= j_C[:, None]
    if window is not None:
        pos_BC = plan.prefix_len_B.to(device)[:, None] + j_C[None, :]
        prefix_ok_BCK = prefix_ok_BCK & (k_K[None, None, :] > pos_BC[:, :, None] - window)
        causal_CC = causal_CC & (j_C[None, :] > j_C[:, None] - window)
    allowed_BCK = torch.cat([prefix_ok_BCK, causal_CC[None].expand(len(plan.run_B), -1, -1)], dim=2)
    mask = torch.zeros(allowed_BCK.shape, dtype=dtype, device=device)
    return mask.masked_fill(~allowed_BCK, torch.finfo(dtype).min)[:, None]


def _continuation_mask(model: torch.nn.Module, plan: PrefixPlan, Lp: int, Lc: int, dtype: torch.dtype,
                       device: torch.device):
    """The continuation pass's mask: one tensor when every layer sees the same keys, else one per
    layer type (transformers' Qwen2/Qwen3 take that mapping; Mistral's window is every layer's)."""
    config = model.config
    windows = family_of(config).window_of(config)
    masks = {w: _additive_mask(plan, Lp, Lc, dtype, w).to(device) for w in set(windows)}
    if "linear_attention" in family_of(config).layer_kinds(config):
        # a Gated DeltaNet layer takes no mask: its continuation starts from the prefix's state and
        # the padding it could see comes after every valid column
        return {"full_attention": next(iter(masks.values())), "linear_attention": None}
    if len(masks) == 1:
        return next(iter(masks.values()))
    return {kind: masks[w] for kind, w in zip(config.layer_types, windows)}


def shared_prefix_forward(model: torch.nn.Module, plan: PrefixPlan, inputs_BT: torch.Tensor,
                          targets_BT: torch.Tensor, weights_BT: torch.Tensor, temperature: float | torch.Tensor,
                          value_head: torch.nn.Module | None = None,
                          truncation: tuple = (0, 1.0, 0.0), support_BT: torch.Tensor | None = None,
                          every_position: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs of the targets and (with `value_head`) values, both [B, T]; positions before the
    first weighted continuation position of the micro-batch, and each run's prefix, read 0 (with
    `every_position`, their logprobs are computed: the prefix's without gradient). `truncation`
    is the sampler's (top_k, top_p, min_p) and `support_BT` the sizes of the sets it kept
    (`rollout.truncation.target_logprobs`); per-row parameters are [B, 1] ([B, 1, 1] temperature)."""
    B, T = inputs_BT.shape
    device = inputs_BT.device
    run_B, plen_P = plan.run_B.to(device), plan.prefix_len_P.to(device)
    plen_B, clen_B = plen_P[run_B], plan.cont_len_B.to(device)
    P, Lp, Lc = len(plen_P), max(int(plen_P.max()), 1), max(int(clen_B.max()), 1)

    first_B = torch.zeros(P, dtype=torch.long, device=device).scatter_reduce(
        0, run_B, torch.arange(B, device=device), "amin", include_self=False)
    kinds = family_of(model.config).layer_kinds(model.config)
    prefix = _hybrid_prefix_pass if "linear_attention" in kinds else _prefix_pass
    expanded, logits_PLV = prefix(model, inputs_BT, first_B, plen_P, run_B, Lp, every_position)
    prefix_BT = _prefix_logprobs(logits_PLV, plan, targets_BT, temperature, truncation,
                                 support_BT) if every_position else None
    del logits_PLV

    # Continuation pass: row i holds positions plen_i .. len_i - 1; padding is routed to spare columns.
    j_C = torch.arange(Lc, device=device)
    valid_BC = j_C[None, :] < clen_B[:, None]
    pos_BC = plen_B[:, None] + j_C[None, :]
    gather_BC = torch.where(valid_BC, pos_BC, 0)
    cont_BC = torch.where(valid_BC, inputs_BT.gather(1, gather_BC), inputs_BT[0, 0])
    weighted_BC = weights_BT.gather(1, gather_BC).ne(0) & valid_BC
    start = 0
    if weighted_BC.any() and not every_position:
        start = int(weighted_BC.float().argmax(dim=1)[weighted_BC.any(dim=1)].min())
    dtype = model.get_input_embeddings().weight.dtype
    out = model(input_ids=cont_BC, attention_mask=_continuation_mask(model, plan, Lp, Lc, dtype, device),
                position_ids=pos_BC, cache=expanded, use_cache=True, logits_to_keep=Lc - start,
                output_hidden_states=value_head is not None, **_chunking(model, Lc))
    support_BK = support_BT.gather(1, gather_BC)[:, start:] if support_BT is not None else None
    lp_BK = target_logprobs(out.logits, targets_BT.gather(1, gather_BC)[:, start:], temperature, *truncation,
                            support_BK=support_BK)

    scatter_BK = torch.where(valid_BC, pos_BC, T + j_C[None, :])[:, start:]

    def to_rows(x_BK: torch.Tensor) -> torch.Tensor:
        x_BK = x_BK.masked_fill(~valid_BC[:, start:], 0.0)
        return torch.zeros(B, T + Lc, dtype=x_BK.dtype, device=device).scatter(1, scatter_BK, x_BK)[:, :T]

    values_BT = to_rows(value_head(out.hidden_states[-1][:, start:])) if value_head is not None else None
    lp_BT = to_rows(lp_BK)
    return (lp_BT if prefix_BT is None else lp_BT + prefix_BT), values_BT


DELTA_CHUNKS = (32, 64)
"""Chunk sizes of transformers' chunked gated delta rule the continuation picks from: it pads a
pass to a whole chunk, and a continuation is often much shorter than its default 64."""


def _chunking(model: torch.nn.Module, Lc: int) -> dict:
    """The continuation's chunk size for Gated DeltaNet layers (transformers passes a forward's
    extra keywords down to `torch_chunk_gated_delta_rule`): the smallest of `DELTA_CHUNKS` that
    holds `Lc` columns, else its default. Same arithmetic, another grouping of it."""
    if "linear_attention" not in family_of(model.config).layer_kinds(model.config):
        return {}
    return {"chunk_size": next((c for c in DELTA_CHUNKS if Lc <= c), DELTA_CHUNKS[-1])}


def _prefix_pass(model: torch.nn.Module, inputs_BT: torch.Tensor, first_B: torch.Tensor, plen_P: torch.Tensor,
                 run_B: torch.Tensor, Lp: int, every_position: bool) -> tuple[DynamicCache, torch.Tensor | None]:
    """One row per run, right-padded, purely causal (padding sits after the tokens it could
    disturb, and the continuation mask hides it); returns each row's copy of its run's keys and
    values, and (with `every_position`) the prefix rows' detached logits `[P, Lp, V]`."""
    prefix_PL = inputs_BT[first_B, :Lp]
    # full layers, one per decoder layer, made up front: a config-built cache would give a sliding
    # layer only its window of the prefix, and activation checkpointing replays a layer over the
    # cache layer it first saw, so that layer must exist before its decoder layer runs
    cache = DynamicCache()
    cache.layers.extend(DynamicLayer() for _ in range(len(decoder_layers(model))))
    out = model(input_ids=prefix_PL, cache=cache, use_cache=True, logits_to_keep=Lp if every_position else 1)
    logits_PLV = out.logits.detach() if every_position else None
    del out  # its logits: the output layer's graph over the prefix goes with them
    expanded = DynamicCache(ddp_cache_data=[(layer.keys.index_select(0, run_B), layer.values.index_select(0, run_B))
                                            for layer in cache.layers])
    return expanded, logits_PLV


class _StateLayer(LinearAttentionLayer):
    """A Gated DeltaNet layer's cache entry in the shared forward: its conv state `[B, C, K]`
    (the layer's last K conv inputs) and recurrent state `[B, Hv, Dk, Dv]` stay in the autograd
    graph. Updates rebind where transformers' copy in place: the continuation's backward still
    needs the state it started from, and an activation checkpoint's replay restores a layer's
    attributes, not a tensor's contents. `record_past` keeps transformers off its in-place
    one-token conv update (a continuation of one column)."""

    rebinds = True
    """Read by `activation_checkpointing`: a replay may restore this layer from its attributes."""

    def __init__(self, conv_BCK: torch.Tensor | None = None, rec_BHKV: torch.Tensor | None = None):
        super().__init__()
        self.record_past = True
        if conv_BCK is not None:
            self.conv_states, self.recurrent_states = {0: conv_BCK}, {0: rec_BHKV}
            self.conv_kernel_size = {0: conv_BCK.shape[-1]}
            self.has_previous_state = {0: True}

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size: int | None = None,
                          **kwargs) -> torch.Tensor:
        K = self.conv_kernel_size[0] or conv_kernel_size
        full = torch.cat([self.conv_states[0], conv_states], dim=-1) if self.has_previous_state[0] else conv_states
        last = full[..., -K:]
        self.conv_states = {0: torch.nn.functional.pad(last, (K - last.shape[-1], 0))}
        self.conv_kernel_size, self.has_previous_state = {0: K}, {0: True}
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs) -> torch.Tensor:
        self.recurrent_states = {0: recurrent_states}
        return recurrent_states


def _hybrid_prefix_pass(model: torch.nn.Module, inputs_BT: torch.Tensor, first_B: torch.Tensor,
                        plen_P: torch.Tensor, run_B: torch.Tensor, Lp: int,
                        every_position: bool) -> tuple[DynamicCache, torch.Tensor | None]:
    """`_prefix_pass` for a model with Gated DeltaNet layers: their state after a prefix must be
    the state at the prefix's own end, and a padding column would decay and write it, so the
    runs go by prefix length, one unpadded pass per length. Keys and values are zero-padded to
    `Lp` (the continuation mask hides the columns past a run's prefix)."""
    kinds = family_of(model.config).layer_kinds(model.config)
    parts, order, logits = [], [], []
    for length in sorted(set(plen_P.tolist())):
        runs = (plen_P == length).nonzero().squeeze(1)
        cache = DynamicCache()
        cache.layers.extend(DynamicLayer() if k == "attention" else _StateLayer() for k in kinds)
        out = model(input_ids=inputs_BT[first_B[runs], :length], cache=cache, use_cache=True,
                    logits_to_keep=length if every_position else 1)
        if every_position:
            logits.append(torch.nn.functional.pad(out.logits.detach(), (0, 0, 0, Lp - length)))
        del out
        parts.append(cache.layers)
        order.append(runs)
    # run p's state is row part_P[p] of the concatenated parts
    part_P = torch.empty_like(plen_P).scatter_(0, torch.cat(order), torch.arange(len(plen_P), device=plen_P.device))
    pick_B = part_P[run_B]

    def rows(tensors: list[torch.Tensor], pad: bool = False) -> torch.Tensor:
        padded = [torch.nn.functional.pad(t, (0, 0, 0, Lp - t.shape[2])) if pad else t for t in tensors]
        return torch.cat(padded).index_select(0, pick_B)

    expanded = DynamicCache()
    for i, kind in enumerate(kinds):
        layers = [p[i] for p in parts]
        if kind == "attention":
            layer = DynamicLayer()
            layer.update(rows([x.keys for x in layers], pad=True), rows([x.values for x in layers], pad=True))
        else:
            layer = _StateLayer(rows([x.conv_states[0] for x in layers]), rows([x.recurrent_states[0] for x in layers]))
        expanded.layers.append(layer)
    logits_PLV = torch.cat(logits).index_select(0, part_P) if every_position else None
    return expanded, logits_PLV


@torch.no_grad()
def _prefix_logprobs(logits_PLV: torch.Tensor, plan: PrefixPlan, targets_BT: torch.Tensor,
                     temperature: float | torch.Tensor, truncation: tuple,
                     support_BT: torch.Tensor | None) -> torch.Tensor:
    """Each row's target logprobs at its run's prefix positions, from the prefix rows' logits
    [P, Lp, V], 0 elsewhere; [B, T] fp32. Rows take their own targets and sampling parameters
    (a client's targets need not be the next input token), a bounded number of rows at a time."""
    B, T = targets_BT.shape
    _, Lp, V = logits_PLV.shape
    device = logits_PLV.device
    run_B = plan.run_B.to(device)
    in_prefix_BL = torch.arange(Lp, device=device)[None, :] < plan.prefix_len_P.to(device)[run_B][:, None]
    out_BT = torch.zeros(B, T, dtype=torch.float32, device=device)
    step = max(1, CHUNK_ELEMENTS // (Lp * V))

    def rows(x, s: slice):  # a per-row parameter's rows `s`; a number as it is
        return x[s] if isinstance(x, torch.Tensor) and x.dim() > 0 else x

    for i in range(0, B, step):
        s = slice(i, min(B, i + step))
        lp_RL = target_logprobs(logits_PLV.index_select(0, run_B[s]), targets_BT[s, :Lp], rows(temperature, s),
                                *(rows(x, s) for x in truncation),
                                support_BK=support_BT[s, :Lp] if support_BT is not None else None)
        out_BT[s, :Lp] = torch.where(in_prefix_BL[s], lp_RL, 0.0)
    return out_BT
