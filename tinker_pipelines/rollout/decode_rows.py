"""The decode batch's per-row state (`DecodeRows`) and its uniforms (`UniformSource`), which
`sampler.Sampler._decode` steps through: what each row drew, which rows are live, where each ends,
and how often the host looks (see `sampler`'s module doc for why each is done this way)."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from tinker_pipelines.rollout.draw import sample_tokens
from tinker_pipelines.rollout.samples import Sample, SampleRequest
from tinker_pipelines.rollout.truncation import is_active

DEVICE_CHECK_EVERY = 8
"""Decode steps between host checks for finished rows on a device other than the CPU: a row that
ends runs up to this many steps more (its extra tokens are dropped), against one device sync per
step."""


def uniforms_on_device(device: torch.device, override: bool | None = None) -> bool:
    """Whether decode draws its uniforms on `device` (`Sampler.device_uniforms`; None: on CUDA)."""
    return device.type == "cuda" if override is None else override


def check_interval(device: torch.device, override: int | None = None) -> int:
    """Decode steps between host checks for finished rows (`Sampler.check_every`; None: every step
    on a CPU, `DEVICE_CHECK_EVERY` elsewhere)."""
    if override is not None and override < 1:
        raise ValueError(f"check_every must be >= 1, got {override}")
    return override or (1 if device.type == "cpu" else DEVICE_CHECK_EVERY)


class UniformSource:
    """The decode loop's uniforms, one per row and step, from each request's generator.

    Where they are drawn (`on_device`; default: on a CUDA device, not on a CPU): on the CPU, each
    request's generator draws on its own device and the draws are copied to the model's device:
    the stream of tokens is the same whatever device the model is on. On the device (no per-step
    host-to-device copy, which waits for the device to drain), a request whose generator is a CPU
    one gets a device generator seeded by one draw from it at the start of the call (so the
    request's samples are still a function of its generator's state alone, but not the CPU
    stream's); a device generator draws directly; no generator: the device's default one."""

    def __init__(self, requests: list[SampleRequest], device: torch.device, on_device: bool | None):
        self.requests, self.device = requests, device
        self.on_device = uniforms_on_device(device, on_device)
        self.gens: list[torch.Generator | None] = [r.generator for r in requests]
        if self.on_device:
            self.gens = [self._device_generator(r.generator) if r.temperature > 0 else None for r in requests]

    def _device_generator(self, gen: torch.Generator | None) -> torch.Generator | None:
        if gen is None or gen.device == self.device:
            return gen
        seed = int(torch.randint(0, 2 ** 62, (1,), generator=gen, device=gen.device))
        return torch.Generator(device=self.device).manual_seed(seed)

    def __call__(self, req_live: list[int], row_idx: torch.Tensor) -> torch.Tensor | None:
        """Uniforms for the batch's rows (None when every live request is greedy); a request
        draws one per prompt while `req_live` says any of its rows is live."""
        parts, drew = [], False
        for i, r in enumerate(self.requests):
            n = len(r.prompts)
            if r.temperature > 0 and req_live[i] > 0:
                gen = self.gens[i]
                if self.on_device:
                    parts.append(torch.rand(n, generator=gen, device=self.device))
                else:
                    parts.append(torch.rand(n, generator=gen, device=gen.device if gen is not None else "cpu").cpu())
                drew = True
            else:
                parts.append(torch.zeros(n, device=self.device if self.on_device else "cpu"))
        if not drew:
            return None
        return torch.cat(parts).to(self.device).index_select(0, row_idx)


def left_padded(prompts_U: list, pad_token_id: int,
                 device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_UL, mask_UL, positions_UL) on `device`: left padding keeps every row's last token aligned."""
    U, longest = len(prompts_U), max(len(p) for p in prompts_U)
    input_UL = torch.full((U, longest), pad_token_id, dtype=torch.long)
    mask_UL = torch.zeros((U, longest), dtype=torch.long)
    for i, p in enumerate(prompts_U):
        input_UL[i, longest - len(p):] = torch.tensor(p)
        mask_UL[i, longest - len(p):] = 1
    input_UL, mask_UL = input_UL.to(device), mask_UL.to(device)
    return input_UL, mask_UL, (mask_UL.cumsum(-1) - 1).clamp_(min=0)


class DecodeRows:
    """The decode batch's per-row state: the live rows plus finished rows not yet pruned.

    Row i of every `_B` / `_BT` tensor is original row `rows[i]` (requests' prompts in order). Stop
    tokens and lengths end rows on the device at every `step`; the host reads `live_B` only at
    `check_live`. A row's outputs are read out into `results` when it is pruned or at the end."""

    def __init__(self, requests: list[SampleRequest], M: int, vocab: int, stop_ids: list[int],
                 device: torch.device):
        self.requests, self.device = requests, device
        self.req_of = req_of = [i for i, r in enumerate(requests) for _ in r.prompts]
        B = len(req_of)
        self.rows = list(range(B))  # original index of each batch row
        self.offsets = [0]
        for r in requests:
            self.offsets.append(self.offsets[-1] + len(r.prompts))
        temps = [r.temperature for r in requests]
        self.temperature = temps[0] if len(set(temps)) == 1 else None  # one scalar: no per-row tensor
        self.temp_B = torch.tensor([temps[i] for i in req_of], device=device)
        self.temps32 = torch.tensor([temps[i] for i in req_of], dtype=torch.float32).tolist()  # per original row
        self.maxnew_B = torch.tensor([requests[i].max_new_tokens for i in req_of], device=device)
        self.req_B = torch.tensor(req_of, device=device)
        # truncation: scalars when every request agrees (no per-step syncs), else one value per row
        params = {(r.top_k, r.top_p, r.min_p) for r in requests}
        self.trunc: tuple | None = None
        if any(is_active(*x) for x in params):
            self.trunc = next(iter(params)) if len(params) == 1 else (
                torch.tensor([requests[i].top_k for i in req_of], device=device),
                torch.tensor([requests[i].top_p for i in req_of], device=device),
                torch.tensor([requests[i].min_p for i in req_of], device=device))
        # stop strings: the decoded tail of each row that has some, scanned at every check
        self.window = max((len(x) for r in requests for x in r.stop), default=0) + 3
        self.has_stop_strings = any(r.stop for r in requests)
        self.stop_hit: dict[int, str] = {}  # original row -> the stop string that ended it
        self.tok_BT = torch.empty((B, M), dtype=torch.long, device=device)
        self.lp_BT = torch.empty((B, M), dtype=torch.float32, device=device)
        self.sup_BT = torch.zeros((B, M), dtype=torch.long, device=device) if self.trunc is not None else None
        # top logprobs: the largest k any request asks for, each row read out with its own
        self.top_k = min(max(r.top_logprobs for r in requests), vocab)
        self.top_BTK = torch.empty((B, M, self.top_k), dtype=torch.float32, device=device) if self.top_k else None
        self.top_ids_BTK = torch.empty((B, M, self.top_k), dtype=torch.long, device=device) if self.top_k else None
        self.live_B = torch.ones(B, dtype=torch.bool, device=device)
        self.end_B = self.maxnew_B.clone()  # tokens kept per row
        self.req_live = [len(r.prompts) for r in requests]
        self.n_live = B  # live rows at the last check
        self.has_stop_ids = bool(stop_ids) or any(r.stop_token_ids for r in requests)
        self.is_stop_V = torch.zeros(vocab + 1, dtype=torch.bool, device=device)
        self.is_stop_V[[i for i in stop_ids if 0 <= i < vocab]] = True
        self.stop_set = set(stop_ids)
        self.stop_sets = [self.stop_set | set(r.stop_token_ids) for r in requests]  # per request
        self.is_stop_RV: torch.Tensor | None = None  # per request, when some request adds its own
        if any(r.stop_token_ids for r in requests):
            self.is_stop_RV = self.is_stop_V.repeat(len(requests), 1)
            for i, r in enumerate(requests):
                self.is_stop_RV[i, [t for t in r.stop_token_ids if 0 <= t < vocab]] = True
        self.results: list[Sample | None] = [None] * B
        self.row_idx = torch.arange(B, device=device)  # each batch row's column in the uniforms
        self.ends_by_length = bool(self.maxnew_B.ne(M).any())

    def step(self, t: int, logits_BV: torch.Tensor, u_B: torch.Tensor | None) -> torch.Tensor:
        """Draw step `t`'s tokens from `logits_BV`, record them, and end (on the device) the rows
        that drew a stop token or reached their length; returns tok_B."""
        uniform_temp = self.temperature is not None
        tok_B, lp_B, sup_B, *top = sample_tokens(
            logits_BV, self.temperature if uniform_temp else self.temp_B, None,
            u_B if u_B is not None else torch.zeros(len(self.rows), device=self.device),
            **(dict(zip(("top_k", "top_p", "min_p"), self.trunc)) if self.trunc else {}),
            with_support=True, host_temperatures=None if uniform_temp else [self.temps32[r] for r in self.rows],
            top_logprobs=self.top_k)
        if top:
            self.top_BTK[:, t], self.top_ids_BTK[:, t] = top
        self.tok_BT[:, t] = tok_B
        self.lp_BT[:, t] = lp_B
        if self.sup_BT is not None:
            self.sup_BT[:, t] = sup_B
        live_B = self.live_B
        if self.is_stop_RV is not None:
            done_B = self.is_stop_RV[self.req_B, tok_B] & live_B
        else:
            done_B = self.is_stop_V[tok_B] & live_B if self.has_stop_ids else torch.zeros_like(live_B)
        if self.ends_by_length:
            done_B |= self.maxnew_B.eq(t + 1) & live_B
        self.end_B = torch.where(done_B, torch.minimum(self.end_B, torch.full_like(self.end_B, t + 1)), self.end_B)
        self.live_B &= ~done_B
        return tok_B

    def check_live(self) -> bool:
        """Count the live rows (a host sync); whether some finished since the last check (then
        `req_live` is brought up to date)."""
        live_now = int(self.live_B.sum())
        finished, self.n_live = live_now < self.n_live, live_now
        if finished:
            self.req_live[:] = torch.bincount(self.req_B[self.live_B], minlength=len(self.requests)).tolist()
        return finished

    def prune(self, t: int) -> torch.Tensor | None:
        """Once a quarter of the batch has finished, read out the finished rows and drop them from
        the state; returns the kept batch rows (the caller drops them from the cache), or None."""
        n_rows = self.live_B.shape[0]
        if (n_rows - self.n_live) * 4 < n_rows:  # pruning copies the cache: batch it
            return None
        dead = (~self.live_B).nonzero().squeeze(1)
        self.read_out(dead.tolist(), t + 1)
        keep = self.live_B.nonzero().squeeze(1)
        self.rows = [self.rows[i] for i in keep.tolist()]
        self.tok_BT, self.lp_BT, self.end_B, self.live_B = (self.tok_BT[keep], self.lp_BT[keep], self.end_B[keep],
                                                            self.live_B[keep])
        self.sup_BT = self.sup_BT[keep] if self.sup_BT is not None else None
        if self.top_k:
            self.top_BTK, self.top_ids_BTK = self.top_BTK[keep], self.top_ids_BTK[keep]
        self.temp_B, self.maxnew_B, self.req_B, self.row_idx = (self.temp_B[keep], self.maxnew_B[keep],
                                                                self.req_B[keep], self.row_idx[keep])
        if self.trunc is not None and isinstance(self.trunc[0], torch.Tensor):
            self.trunc = tuple(x[keep] for x in self.trunc)
        return keep

    def scan_stop_strings(self, t_from: int, t_to: int, tokenizer: PreTrainedTokenizerBase) -> None:
        """End the rows whose text came to contain one of their stop strings at a step in
        [t_from, t_to], at the first such step, exactly as a scan after every step would: a
        row is tested at the steps it was live at, except one that a stop token ended (a
        stop token wins over a stop string completed by the same token)."""
        rows, requests, req_of, window = self.rows, self.requests, self.req_of, self.window
        idx = [i for i in range(len(rows)) if requests[req_of[rows[i]]].stop]
        if not idx:
            return
        lo = max(0, t_from + 1 - window)
        toks, ends = self.tok_BT[idx, lo:t_to + 1].tolist(), self.end_B[idx].tolist()
        windows, owners = [], []
        for j, i in enumerate(idx):
            for s in range(t_from, min(t_to, ends[j] - 1) + 1):
                if s == ends[j] - 1 and toks[j][s - lo] in self.stop_sets[req_of[rows[i]]]:
                    continue
                windows.append(toks[j][max(0, s + 1 - window) - lo:s + 1 - lo])
                owners.append((i, s))
        if not windows:
            return
        first: dict[int, int] = {}
        for (i, s), text in zip(owners, tokenizer.batch_decode(windows, skip_special_tokens=True)):
            found = [(text.find(x), x) for x in requests[req_of[rows[i]]].stop if x in text] if i not in first else []
            if found:
                self.stop_hit[rows[i]] = min(found)[1]
                first[i] = s + 1
        if first:
            hit = torch.tensor(list(first), device=self.device)
            self.end_B[hit] = torch.tensor(list(first.values()), device=self.device)
            self.live_B[hit] = False

    def read_out(self, idx: list[int], t_end: int) -> None:
        """Move batch rows `idx` (tokens up to step `t_end`) into `results` as Samples."""
        toks, lps = self.tok_BT[idx, :t_end].tolist(), self.lp_BT[idx, :t_end].tolist()
        ends = self.end_B[idx].tolist()
        sups = self.sup_BT[idx, :t_end].tolist() if self.sup_BT is not None else None
        tops = (self.top_BTK[idx, :t_end].tolist(), self.top_ids_BTK[idx, :t_end].tolist()) if self.top_k else None
        for j, i in enumerate(idx):
            n = ends[j]
            hit = self.stop_hit.get(self.rows[i])
            support = tuple(sups[j][:n]) if sups is not None and any(sups[j][:n]) else ()
            k = self.requests[self.req_of[self.rows[i]]].top_logprobs
            top = tuple(tuple(zip(ids[:k], lps_k[:k])) for lps_k, ids in zip(tops[0][j][:n], tops[1][j][:n])) \
                if tops is not None and k else ()
            self.results[self.rows[i]] = Sample(
                tuple(toks[j][:n]), tuple(lps[j][:n]),
                "stop" if hit is not None or toks[j][n - 1] in self.stop_sets[self.req_of[self.rows[i]]] else "length",
                hit, support, top)

    def by_request(self) -> list[list[Sample]]:
        results, offsets = self.results, self.offsets
        return [results[offsets[i]:offsets[i + 1]] for i in range(len(self.requests))]  # type: ignore[misc]
