"""The sampler against Hugging Face `generate` and a full forward pass, on the tiny model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model

from tinker_pipelines.models import stop_token_ids
from tinker_pipelines.rollout.lean_decoder import LeanDecoder
from tinker_pipelines.rollout.sampler import Sampler

LENGTHS = (3, 11, 7, 20, 1, 14)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in LENGTHS]


def _hf_greedy(model, prompts, pad_id, max_new_tokens):
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):] = torch.tensor(p)
        mask[i, L - len(p):] = 1
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                         min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id)
    return out[:, L:].tolist()


def _full_forward_logprobs(model, prompt, tokens, temperature):
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    lp = torch.log_softmax(logits / (temperature or 1.0), dim=-1)
    return lp.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)


def _lora(model, **kwargs):
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                         "up_proj", "down_proj"], lora_dropout=0.0, **kwargs)
    peft_model = get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # lora_B starts at zero: make the adapter change the function
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return peft_model.eval()


@pytest.mark.parametrize("lean", [True, False])
def test_greedy_matches_hf_generate(tiny, lean):
    model, tok = tiny
    prompts = _prompts(len(tok))
    sampler = Sampler(model, tok.pad_token_id, [], lean=lean)
    assert LeanDecoder.supports(model)
    ours = sampler.sample(prompts, 24, temperature=0.0)
    assert [list(s.tokens) for s in ours] == _hf_greedy(model, prompts, tok.pad_token_id, 24)
    assert all(s.stop_reason == "length" for s in ours)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_logprobs_match_full_forward(tiny, temperature):
    model, tok = tiny
    prompts = _prompts(len(tok))
    samples = Sampler(model, tok.pad_token_id, stop_token_ids(tok)).sample(
        prompts, 16, temperature, torch.Generator().manual_seed(0))
    for p, s in zip(prompts, samples):
        ref = _full_forward_logprobs(model, p, s.tokens, temperature)
        assert torch.allclose(torch.tensor(s.logprobs), ref, atol=1e-5, rtol=0), (s.logprobs, ref.tolist())


@pytest.mark.parametrize("use_dora", [False, True])  # DoRA can't be merged: the module-by-module step
def test_peft_lora_model(tiny, use_dora):
    model, tok = tiny
    prompts = _prompts(len(tok))
    base_greedy = Sampler(model, tok.pad_token_id, []).sample(prompts, 12, 0.0)
    peft_model = _lora(model, use_dora=use_dora)
    assert LeanDecoder.supports(peft_model)
    assert (LeanDecoder(peft_model).fused is None) == use_dora
    sampler = Sampler(peft_model, tok.pad_token_id, [])
    greedy = sampler.sample(prompts, 12, 0.0)
    assert [list(s.tokens) for s in greedy] == _hf_greedy(peft_model, prompts, tok.pad_token_id, 12)
    assert [s.tokens for s in greedy] != [s.tokens for s in base_greedy]  # the adapter is applied
    samples = sampler.sample(prompts, 12, 1.0, torch.Generator().manual_seed(0))
    for p, s in zip(prompts, samples):
        ref = _full_forward_logprobs(peft_model, p, s.tokens, 1.0)
        assert torch.allclose(torch.tensor(s.logprobs), ref, atol=1e-5, rtol=0)
    with peft_model.disable_adapter():  # the adapter switched off: the base model again
        assert [s.tokens for s in sampler.sample(prompts, 12, 0.0)] == [s.tokens for s in base_greedy]


def test_stop_tokens_end_rows(tiny):
    model, tok = tiny
    prompts = _prompts(len(tok))
    free = Sampler(model, tok.pad_token_id, []).sample(prompts, 24, 0.0)
    # stop on tokens that rows produce at different steps, so rows finish (and are pruned) unevenly
    stops = sorted({free[0].tokens[3], free[2].tokens[9], free[4].tokens[15]})
    stopped = Sampler(model, tok.pad_token_id, stops).sample(prompts, 24, 0.0)
    n_stopped = 0
    for f, s in zip(free, stopped):
        first = next((i for i, t in enumerate(f.tokens) if t in stops), None)
        if first is None:
            assert s.tokens == f.tokens and s.stop_reason == "length"
        else:
            n_stopped += 1
            assert s.tokens == f.tokens[: first + 1] and s.stop_reason == "stop"
            assert s.logprobs == pytest.approx(f.logprobs[: first + 1], abs=1e-6)
    assert n_stopped >= 3


def test_seeded_sampling_is_reproducible(tiny):
    model, tok = tiny
    prompts = _prompts(len(tok))
    sampler = Sampler(model, tok.pad_token_id, stop_token_ids(tok))
    a = sampler.sample(prompts, 16, 1.0, torch.Generator().manual_seed(7))
    b = sampler.sample(prompts, 16, 1.0, torch.Generator().manual_seed(7))
    c = sampler.sample(prompts, 16, 1.0, torch.Generator().manual_seed(8))
    assert a == b
    assert [s.tokens for s in a] != [s.tokens for s in c]
    hf_path = Sampler(model, tok.pad_token_id, stop_token_ids(tok), lean=False)
    d = hf_path.sample(prompts, 16, 1.0, torch.Generator().manual_seed(7))
    assert [s.tokens for s in d] == [s.tokens for s in a]  # both decode paths draw the same tokens


def test_bad_arguments(tiny):
    model, tok = tiny
    sampler = Sampler(model, tok.pad_token_id, [])
    assert sampler.sample([], 4) == []
    with pytest.raises(ValueError, match="temperature"):
        sampler.sample([[5]], 4, temperature=-1.0)
    with pytest.raises(ValueError, match="empty prompt"):
        sampler.sample([[5], []], 4)


def test_repeated_prompts_share_one_prefill(tiny):
    model, tok = tiny
    prompts = _prompts(len(tok))[:3]
    group = [p for p in prompts for _ in range(4)]  # GRPO-style groups of identical prompts
    sampler = Sampler(model, tok.pad_token_id, stop_token_ids(tok))
    greedy = sampler.sample(group, 10, 0.0)
    single = sampler.sample(prompts, 10, 0.0)
    assert [s.tokens for s in greedy] == [s.tokens for s in single for _ in range(4)]
    samples = sampler.sample(group, 10, 1.0, torch.Generator().manual_seed(0))
    assert len({s.tokens for s in samples[:4]}) > 1  # rows of a group still sample independently
    for p, s in zip(group, samples):
        ref = _full_forward_logprobs(model, p, s.tokens, 1.0)
        assert torch.allclose(torch.tensor(s.logprobs), ref, atol=1e-5, rtol=0)


def test_multi_turn_prompt_reuse_matches_fresh_prefill(tiny, monkeypatch):
    from tinker_pipelines.envs.guess_number import GuessNumberEnv
    from tinker_pipelines.rollout.episodes import RolloutConfig, run_episodes

    reused = []
    original = LeanDecoder.prefill_reusing
    monkeypatch.setattr(LeanDecoder, "prefill_reusing",
                        lambda self, *a, **k: reused.append(1) or original(self, *a, **k))
    model, tok = tiny
    cfg = RolloutConfig(max_new_tokens=8, temperature=1.0, max_turns=4)
    runs = {}
    for reuse in (True, False):
        sampler = Sampler(model, tok.pad_token_id, stop_token_ids(tok), reuse_prompts=reuse)
        envs = [GuessNumberEnv(max_guesses=2 + i % 3) for i in range(6)]
        runs[reuse] = run_episodes(sampler, tok, envs, list(range(6)), cfg, torch.Generator().manual_seed(0))
    assert sum(len(t.turns) for t in runs[True]) > 6
    assert len(reused) >= 2  # turns after the first reused the previous turn's prompt
    for a, b in zip(runs[True], runs[False]):
        for x, y in zip(a.turns, b.turns, strict=True):
            assert x.sampled_tokens == y.sampled_tokens
            assert x.sampled_logprobs == pytest.approx(y.sampled_logprobs, abs=1e-5)
            ref = _full_forward_logprobs(model, x.prompt_tokens, x.sampled_tokens, 1.0)
            assert torch.allclose(torch.tensor(x.sampled_logprobs), ref, atol=1e-5, rtol=0)


def test_reuse_is_dropped_when_weights_change(tiny):
    model, tok = tiny
    prompts = _prompts(len(tok))
    sampler = Sampler(model, tok.pad_token_id, [])
    first = sampler.sample(prompts, 6, 0.0)
    with torch.no_grad():  # an optimizer step in place
        model.model.layers[0].mlp.down_proj.weight.mul_(3.0)
    longer = [p + list(s.tokens) for p, s in zip(prompts, first)]
    reused = sampler.sample(longer, 6, 0.0)
    fresh = Sampler(model, tok.pad_token_id, [], reuse_prompts=False).sample(longer, 6, 0.0)
    assert [s.tokens for s in reused] == [s.tokens for s in fresh]
    flat = [x for s in reused for x in s.logprobs]
    assert flat == pytest.approx([x for s in fresh for x in s.logprobs], abs=1e-6)


def test_invalidate_after_edits_through_data(tiny):
    model, tok = tiny
    prompts = _prompts(len(tok))
    sampler = Sampler(model, tok.pad_token_id, [])
    sampler.sample(prompts, 4, 0.0)
    model.model.layers[1].self_attn.q_proj.weight.data.mul_(-2.0)  # no version bump: invisible
    sampler.invalidate()
    fresh = Sampler(model, tok.pad_token_id, [], reuse_prompts=False)
    assert [s.tokens for s in sampler.sample(prompts, 6, 0.0)] == [s.tokens for s in fresh.sample(prompts, 6, 0.0)]


@pytest.mark.parametrize("rows", [1, 5, 16, 64])
def test_blocked_output_layer_is_bitwise_the_plain_one(rows):
    """The decoder's output layer runs in column blocks on CPU (faster for a 49k vocabulary);
    every logit must be the very float `F.linear` gives, so greedy decoding and logprobs are
    unchanged. A vocabulary that is not a multiple of the block leaves a short last block."""
    from tinker_pipelines.rollout.linears import blocked_linear

    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g)
    weight, bias = torch.randn(5000, 96, generator=g) * 0.05, torch.randn(5000, generator=g)
    for b in (None, bias):
        got = blocked_linear(x, weight, b, block=512)
        assert got.shape == (rows, 5000) and torch.equal(got, torch.nn.functional.linear(x, weight, b))


@pytest.mark.parametrize("rows", [1, 5, 12, 16, 40, 64, 128, 200])
def test_streamed_linear_is_bitwise_the_plain_one(rows):
    """At decode row counts the lean decoder's linears compute `(W @ x^T)^T` on CPU (the weight
    streams as stored instead of being re-packed per call); every output must be the very float
    `F.linear` gives, for 2-D and 3-D inputs, with and without bias, at SmolLM2's layer shapes."""
    from tinker_pipelines.rollout.linears import blocked_linear, rows_linear

    g = torch.Generator().manual_seed(rows)

    def check(got, x, weight, b=None):
        assert torch.equal(got, torch.nn.functional.linear(x, weight, b))

    for n_out, n_in in ((960, 576), (3072, 576), (576, 1536)):
        weight, bias = torch.randn(n_out, n_in, generator=g) * 0.05, torch.randn(n_out, generator=g)
        x = torch.randn(rows, 1, n_in, generator=g)
        for b in (None, bias):
            check(rows_linear(x, weight, b), x, weight, b)
            check(rows_linear(x[:, 0], weight, b), x[:, 0], weight, b)
    head = torch.randn(5000, 576, generator=g) * 0.05
    x = torch.randn(rows, 576, generator=g)
    check(blocked_linear(x, head, block=1024), x, head)


def test_common_prompt_prefix_is_prefilled_once(tiny, monkeypatch):
    """Prompts that share a long start (a system prompt) prefill it once: the same greedy tokens
    as HF `generate` and as a full prefill, logprobs those of a full forward (1e-5), and fewer
    tokens through the layers."""
    import tinker_pipelines.rollout.shared_prefix as prefix_module

    model, tok = tiny
    system = torch.randint(5, len(tok), (24,), generator=torch.Generator().manual_seed(5)).tolist()
    prompts = [system + p for p in _prompts(len(tok))]
    assert prefix_module.shared_prefix_len([tuple(p) for p in prompts]) == 24
    seen = []
    real_prefill = LeanDecoder.prefill
    monkeypatch.setattr(LeanDecoder, "prefill",
                        lambda self, ids, *a: seen.append(tuple(ids.shape)) or real_prefill(self, ids, *a))
    shared = Sampler(model, tok.pad_token_id, [], reuse_prompts=False).sample(prompts, 12, temperature=0.0)
    assert seen == [(1, 24)]  # only the prefix runs through the model's own forward
    assert [list(s.tokens) for s in shared] == _hf_greedy(model, prompts, tok.pad_token_id, 12)
    for prompt, s in zip(prompts, shared):
        want = _full_forward_logprobs(model, prompt, s.tokens, 1.0)
        assert torch.allclose(torch.tensor(s.logprobs), want, atol=1e-5)
    monkeypatch.setattr(prefix_module, "SHARED_PREFIX_MIN", 10**6)
    full = Sampler(model, tok.pad_token_id, [], reuse_prompts=False).sample(prompts, 12, temperature=0.0)
    assert seen[-1] == (len(prompts), max(map(len, prompts)))
    assert [s.tokens for s in full] == [s.tokens for s in shared]


def test_invariant_linear_and_attention_do_not_depend_on_the_batch():
    """Row i's result is the same floats whatever the number of rows around it (1 to 300),
    for the decoder's layer shapes, LoRA factors and the one-query and prefill attention."""
    from tinker_pipelines.rollout.linears import attention, invariant_linear

    g = torch.Generator().manual_seed(0)
    for n_out, n_in in ((960, 576), (64, 64), (8, 576), (3072, 24)):
        w, x = torch.randn(n_out, n_in, generator=g) * 0.05, torch.randn(300, n_in, generator=g)
        want = invariant_linear(x[:1], w)
        assert all(torch.equal(invariant_linear(x[:m], w)[:1], want) for m in (2, 5, 11, 12, 13, 64, 300))
    # a row's base output plus its LoRA delta, with its adapter alone or beside others' (their
    # columns masked off) and with any number of rows: the mixed-adapter decoder relies on it
    for n_out, n_in, rank, adapters in ((576, 576, 8, 4), (3072, 576, 16, 3), (64, 64, 4, 6)):
        w, x = torch.randn(n_out, n_in, generator=g) * 0.05, torch.randn(200, n_in, generator=g)
        As = [torch.randn(rank, n_in, generator=g) * 0.05 for _ in range(adapters)]
        Bs = [torch.randn(n_out, rank, generator=g) * 0.05 for _ in range(adapters)]
        A_RH, B_NR, parts = torch.cat(As), torch.cat(Bs, dim=1), tuple(zip(As, Bs))
        own = slice(rank, 2 * rank)
        want = invariant_linear(x[:1], w, lora=(As[1], Bs[1], None))  # adapter 1 alone
        for m in (1, 5, 12, 40, 48, 64, 200):  # 200: past the decode row counts, padded to a multiple of 64
            mask_RB = torch.zeros(rank * adapters, m)
            mask_RB[own, 0] = 1
            mask_RB[:rank, 1:] = 1  # the other rows belong to adapter 0
            got = invariant_linear(x[:m], w, lora=(A_RH, B_NR, mask_RB, parts))
            assert torch.equal(got[:1], want)
            assert torch.allclose(got[1:], F.linear(x[1:m], w + Bs[0] @ As[0]), atol=1e-5)
    for queries in (1, 7):
        q = torch.randn(40, 3, queries, 64, generator=g)
        k, v = torch.randn(40, 3, 57, 64, generator=g), torch.randn(40, 3, 57, 64, generator=g)
        mask = torch.rand(40, 1, queries, 57, generator=g) > 0.2
        mask[..., -1] = True
        want = attention(q[:1], k[:1], v[:1], mask[:1], 0.125, True)
        assert torch.allclose(want, attention(q[:1], k[:1], v[:1], mask[:1], 0.125, False), atol=1e-6)
        assert all(torch.equal(attention(q[:b], k[:b], v[:b], mask[:b], 0.125, True)[:1], want) for b in (2, 9, 40))


def test_fast_linears_fall_back_where_this_cpu_sums_otherwise(monkeypatch):
    """The fast forms are used only for shapes whose first call gave the reference floats: a fast
    form that sums in another order (as MKL does on some CPUs at some row counts) is never
    returned, on its first call or later."""
    import tinker_pipelines.rollout.linears as linears

    monkeypatch.setattr(linears, "_VERIFIED", {})
    real = linears._streamed
    monkeypatch.setattr(linears, "_streamed", lambda x, w, b: real(x, w, b) * (1 + 1e-6))
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(960, 576, generator=g), torch.randn(16, 576, generator=g)
    for _ in range(2):
        assert torch.equal(linears.rows_linear(x, weight), F.linear(x, weight))
    assert list(linears._VERIFIED.values()) == [-1]
    monkeypatch.setattr(linears, "_streamed", real)  # a form with the same floats is kept
    monkeypatch.setattr(linears, "_VERIFIED", {})
    calls = []
    monkeypatch.setattr(linears, "_streamed", lambda *a: calls.append(1) or real(*a))
    for _ in range(3):
        linears.rows_linear(x, weight)
    assert list(linears._VERIFIED.values()) == [0 if torch.equal(real(x, weight, None), F.linear(x, weight)) else -1]
    assert len(calls) == 4 if list(linears._VERIFIED.values()) == [0] else len(calls) <= 2  # 1st call: real and probe
    # the batch-invariant form: a row's floats with 1 or 40 rows around it, whichever fast form
    # is perturbed: the one-call form (a batched per-chunk form, or the reference, takes over), or all
    real_product = linears._product
    g = torch.Generator().manual_seed(1)
    A, B = torch.randn(8, 576, generator=g) * 0.05, torch.randn(960, 8, generator=g) * 0.05
    x = torch.randn(48, 576, generator=g)
    reference = {"per_adapter": True}  # how `_chunked` calls it, on one chunk of rows at a time
    one_call = lambda a, kw: not kw.get("per_adapter")  # noqa: E731
    every_fast = lambda a, kw: kw != reference or a[0].shape[0] != linears.INVARIANT_ROWS  # noqa: E731
    for perturbed in (one_call, every_fast):
        monkeypatch.setattr(linears, "_VERIFIED", {})
        monkeypatch.setattr(linears, "_product", lambda *a, perturbed=perturbed, **kw:
                            real_product(*a, **kw) * (1 + 1e-6 * perturbed(a, kw)))
        for lora in (None, (A, B, None)):
            want = linears.invariant_linear(x[:1], weight, lora=lora)
            for m in (40, 48, 40, 48):  # first calls of each shape, then the kept form
                assert torch.equal(linears.invariant_linear(x[:m], weight, lora=lora)[:1], want)
        kept = set(linears._VERIFIED.values())
        assert 0 not in kept and (kept == {-1} or perturbed is one_call)
    # a fresh adapter's B is zero, so on its first call every form of its delta adds exact zeros:
    # the check must not keep a form that differs once B has trained
    monkeypatch.setattr(linears, "_VERIFIED", {})
    monkeypatch.setattr(linears, "_product", lambda *a, **kw: real_product(*a, **kw) * (
        1 + 1e-6 * (every_fast(a, kw) and a[3] is not None and bool(a[3][1].any()))))
    linears.invariant_linear(x[:40], weight, lora=(A, torch.zeros_like(B), None))
    assert set(linears._VERIFIED.values()) == {-1}
    trained = linears.invariant_linear(x[:40], weight, lora=(A, B, None))
    assert torch.equal(trained[:1], linears.invariant_linear(x[:1], weight, lora=(A, B, None)))