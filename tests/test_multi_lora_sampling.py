"""Rows of different LoRA adapters in one decode batch: each row gets exactly its own adapter."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from tinker_pipelines.models import load_model, stop_token_ids
from tinker_pipelines.rollout.sampler import BASE, Sampler, SampleRequest

ADAPTERS = ("exp1", "exp2", "exp3")


def _multi_adapter_model():
    model, tok = load_model("tiny", seed=0)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft = None
    for i, name in enumerate(ADAPTERS):
        cfg = LoraConfig(r=4 + 2 * i, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
        if peft is None:
            peft = get_peft_model(model, cfg, adapter_name=name)
        else:
            peft.add_adapter(name, cfg)
    with torch.no_grad():  # LoRA B starts at zero: give every adapter a real, distinct delta
        g = torch.Generator().manual_seed(3)
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return peft.eval(), tok


def _teacher_logprobs(model, adapter, prompt, tokens):
    model.set_adapter(adapter)
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    n = len(prompt)
    return [lp[n - 1 + j, t].item() for j, t in enumerate(tokens)]


def test_mixed_batch_matches_each_adapter_alone():
    model, tok = _multi_adapter_model()
    prompts = [tok.encode(f"<|im_start|>user\n{a} + {b} = ?<|im_end|>\n<|im_start|>assistant\n") for a, b in
               [(1, 2), (3, 4), (5, 6), (1, 2)]]
    sampler = Sampler(model, tok.pad_token_id, stop_token_ids(tok))
    assert sampler.supports_mixed_adapters()
    reqs = [SampleRequest(prompts[:3], 10, 1.0, torch.Generator().manual_seed(11), "exp2"),
            SampleRequest(prompts, 7, 0.0, None, "exp1"),
            SampleRequest(prompts[1:], 12, 0.7, torch.Generator().manual_seed(12), "exp3"),
            SampleRequest(prompts[:2], 5, 1.0, torch.Generator().manual_seed(13), BASE)]
    mixed = sampler.sample_requests(reqs)
    worst = 0.0
    for req, samples in zip(reqs, mixed):
        assert len(samples) == len(req.prompts)
        for prompt, s in zip(req.prompts, samples):
            assert 1 <= len(s.tokens) <= req.max_new_tokens
            temp = req.temperature or 1.0
            if req.adapter == BASE:
                with model.disable_adapter():
                    ids = torch.tensor([list(prompt) + list(s.tokens)])
                    with torch.no_grad():
                        lp = torch.log_softmax(model(input_ids=ids).logits[0].float() / temp, -1)
                ref = [lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(s.tokens)]
            else:
                model.set_adapter(req.adapter)
                ids = torch.tensor([list(prompt) + list(s.tokens)])
                with torch.no_grad():
                    lp = torch.log_softmax(model(input_ids=ids).logits[0].float() / temp, -1)
                ref = [lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(s.tokens)]
            worst = max(worst, max(abs(x - y) for x, y in zip(s.logprobs, ref)))
    assert worst < 1e-5, worst

    # and each request's rows are the ones it gets sampled alone with the same generator
    for i, req in enumerate(reqs):
        gen = torch.Generator().manual_seed({0: 11, 2: 12, 3: 13}[i]) if req.temperature else None
        alone = sampler.sample_requests([SampleRequest(req.prompts, req.max_new_tokens, req.temperature, gen,
                                                       req.adapter)])[0]
        assert [s.tokens for s in alone] == [s.tokens for s in mixed[i]]


def test_mixed_batch_advances_each_generator_as_alone():
    model, tok = _multi_adapter_model()
    prompts = [tok.encode("<|im_start|>user\nRepeat this<|im_end|>\n<|im_start|>assistant\n")] * 3
    sampler = Sampler(model, tok.pad_token_id, stop_token_ids(tok))
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    sampler.sample_requests([SampleRequest(prompts, 9, 1.0, g1, "exp1"), SampleRequest(prompts[:1], 4, 1.0, g2, "exp2")])
    h1, h2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)
    sampler.sample_requests([SampleRequest(prompts, 9, 1.0, h1, "exp1")])
    sampler.sample_requests([SampleRequest(prompts[:1], 4, 1.0, h2, "exp2")])
    assert torch.equal(g1.get_state(), h1.get_state()) and torch.equal(g2.get_state(), h2.get_state())


def test_unmergeable_adapter_falls_back_to_one_adapter_at_a_time():
    model, tok = load_model("tiny", seed=0)
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], use_dora=True), adapter_name="d")
    peft.add_adapter("e", LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    peft.eval()
    sampler = Sampler(peft, tok.pad_token_id, stop_token_ids(tok))
    prompt = tok.encode("<|im_start|>user\n1 + 1 = ?<|im_end|>\n<|im_start|>assistant\n")
    out = sampler.sample_requests([SampleRequest([prompt], 6, 0.0, None, "d"), SampleRequest([prompt], 6, 0.0, None, "e")])
    peft.set_adapter("d")
    alone = Sampler(peft, tok.pad_token_id, stop_token_ids(tok)).sample([prompt], 6, 0.0)
    assert out[0][0].tokens == alone[0].tokens


def test_mixed_batch_shares_each_adapters_prompt_prefix():
    """A common prompt prefix is prefilled once per adapter (LoRA changes its keys and values):
    every row still gets its own adapter's logprobs."""
    import tinker_pipelines.rollout.shared_prefix as prefix_module

    model, tok = _multi_adapter_model()
    system = tok.encode("<|im_start|>system\nYou add numbers and answer with the sum only.<|im_end|>\n")
    prompts = [system + tok.encode(f"<|im_start|>user\n{a} + {b} = ?<|im_end|>\n<|im_start|>assistant\n")
               for a, b in [(1, 2), (3, 4), (5, 6)]]
    assert prefix_module.shared_prefix_len([tuple(p) for p in prompts]) >= len(system)
    sampler = Sampler(model, tok.pad_token_id, stop_token_ids(tok))
    reqs = [SampleRequest(prompts, 8, 1.0, torch.Generator().manual_seed(i), name) for i, name in enumerate(ADAPTERS)]
    for req, samples in zip(reqs, sampler.sample_requests(reqs)):
        for prompt, s in zip(req.prompts, samples):
            want = _teacher_logprobs(model, req.adapter, prompt, s.tokens)
            assert max(abs(a - b) for a, b in zip(s.logprobs, want)) < 1e-5


def test_an_adapters_samples_do_not_depend_on_who_shares_the_batch():
    """On CPU the mixed-adapter decoder is batch-invariant: an experiment's rows sampled with
    other experiments' rows (more or fewer, other adapters, rows stopping at other times) are
    the very tokens and logprobs it samples alone, so co-tenants on a worker change nothing."""
    model, tok = _multi_adapter_model()
    prompts = [tok.encode(f"<|im_start|>user\n{a} + {b} = ?<|im_end|>\n<|im_start|>assistant\n") for a, b in
               [(1, 2), (3, 4), (5, 6), (7, 8), (2, 9)]]
    sampler = Sampler(model, tok.pad_token_id, stop_token_ids(tok))

    def request(name, rows, seed):
        return SampleRequest([prompts[i % len(prompts)] for i in range(rows)], 12, 1.0,
                             torch.Generator().manual_seed(seed), name)

    alone = sampler.sample_requests([request("exp1", 6, 7)])[0]
    for others in ([request("exp2", 20, 1)], [request("exp3", 3, 2), request("exp2", 40, 3)],
                   [request(BASE, 1, 4)]):
        shared = sampler.sample_requests([request("exp1", 6, 7), *others])[0]
        assert [(s.tokens, s.logprobs) for s in shared] == [(s.tokens, s.logprobs) for s in alone]


def _ranked_model(ranks):
    model, tok = load_model("tiny", seed=0)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft = None
    for r in ranks:
        cfg = LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, lora_dropout=0.0)
        peft = get_peft_model(model, cfg, adapter_name=f"r{r}") if peft is None else (peft.add_adapter(f"r{r}", cfg)
                                                                                      or peft)
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return peft.eval(), tok


@pytest.mark.parametrize("dispatch", [1e12, 0.0])
def test_adapters_of_mixed_ranks_equal_each_alone_through_prunes(monkeypatch, dispatch):
    """Adapters of ranks 4 to 64 in one batch: every row computes its own adapter's delta (in
    buckets of ranks padded to the largest when calls cost most, or one per rank when they cost
    nothing), and a
    request's tokens and logprobs are those it samples alone, also after rows of the others
    finished and were pruned from the batch."""
    import tinker_pipelines.rollout.mixed_lora as mixed_lora

    monkeypatch.setattr(mixed_lora, "DISPATCH_FLOPS", {"cpu": dispatch})
    ranks = (4, 8, 16, 64)
    model, tok = _ranked_model(ranks)
    prompts = [tok.encode(f"<|im_start|>user\n{a} + {b} = ?<|im_end|>\n<|im_start|>assistant\n") for a, b in
               [(1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (4, 4)]]
    sampler = Sampler(model, tok.pad_token_id, [])  # no stop tokens: rows end at their own max_new_tokens
    kept = []
    real_keep = mixed_lora.RowAdapters.keep
    monkeypatch.setattr(mixed_lora.RowAdapters, "keep", lambda self, rows: kept.append(len(rows)) or real_keep(self, rows))

    def requests():  # the short requests' rows finish early and are pruned while the long ones go on
        return [SampleRequest(prompts, 14, 1.0, torch.Generator().manual_seed(1), "r64"),
                SampleRequest(prompts[:2], 3, 1.0, torch.Generator().manual_seed(2), "r4"),
                SampleRequest(prompts[1:4], 4, 1.0, torch.Generator().manual_seed(3), "r8"),
                SampleRequest(prompts[:5], 12, 0.0, None, "r16"),
                SampleRequest(prompts[2:3], 2, 1.0, torch.Generator().manual_seed(4), BASE)]

    mixed = sampler.sample_requests(requests())
    batch = sum(len(r.prompts) for r in requests())
    assert any(0 < n < batch for n in kept), kept  # a prune happened
    adapters = sampler._mixed_decoder().adapters
    adapters.set_rows([0, 1, 2, 3, 4])  # a row of each (the call ended with the longest request's alone)
    buckets = adapters._buckets[0][0]
    assert sorted(k for b in buckets for k in b.ks) == [0, 1, 2, 3]  # every adapter has LoRA there
    # ranks 4 and 8 count as `MIN_RANK` (12): one bucket when calls cost most, else one per rank
    assert len(buckets) == (1 if dispatch else 3)
    for req, got in zip(requests(), mixed):
        alone = sampler.sample_requests([req])[0]
        assert [(s.tokens, s.logprobs) for s in got] == [(s.tokens, s.logprobs) for s in alone]
    # and the logprobs are each adapter's own policy's
    for req, samples in zip(requests()[:4], mixed[:4]):
        temp = req.temperature or 1.0
        model.set_adapter(req.adapter)
        for prompt, s in zip(req.prompts, samples):
            ids = torch.tensor([list(prompt) + list(s.tokens)])
            with torch.no_grad():
                lp = torch.log_softmax(model(input_ids=ids).logits[0].float() / temp, -1)
            ref = [lp[len(prompt) - 1 + j, t].item() for j, t in enumerate(s.tokens)]
            assert max(abs(a - b) for a, b in zip(s.logprobs, ref)) < 1e-5


def test_row_adapters_cost_own_rank_and_keep_layouts():
    """`RowAdapters` on SmolLM2's q|k|v shape: a row's delta is its own adapter's (to float
    rounding against float64), the same floats alone, with 1 to 5 rows of its adapter and after
    a prune; a bf16 base output gains the fp32 delta rounded once; the stacked factors are built
    once per set of adapters and a batch composition's row layout once."""
    from tinker_pipelines.rollout.mixed_lora import MIN_RANK, RowAdapters

    g = torch.Generator().manual_seed(0)
    I, O = 576, 960
    ranks = [4, 8, 12, 16, 24, 32, 48, 64]
    lora = [[[(torch.randn(r, I, generator=g) * 0.05, torch.randn(O, r, generator=g) * 0.05)]] for r in ranks]
    lora.append([[None]])  # the bare base
    rows = sorted(i % len(lora) for i in range(40))
    x = torch.randn(len(rows), 1, I, generator=g)
    y0 = torch.randn(len(rows), 1, O, generator=g)

    def delta(k, x_I):
        A, B = lora[k][0][0]
        return (x_I.double() @ A.double().t() @ B.double().t()).float()

    adapters = RowAdapters(lora, rows, invariant=True)
    y = y0.clone()
    adapters.add_delta(y, x, 0, 0)
    want = torch.stack([y0[i] + delta(k, x[i]) if lora[k][0][0] else y0[i] for i, k in enumerate(rows)])
    assert torch.allclose(y, want, atol=1e-5) and torch.equal(y[rows.index(8):], y0[rows.index(8):])
    stacked = [(b.A_nRI.shape[1], {r for rk in b.ranks for r in rk}) for b in adapters._buckets[0][0]]
    assert sum(b.A_nRI.shape[0] for b in adapters._buckets[0][0]) == len(ranks)
    assert max(R for R, _ in stacked) == 64
    assert min(r for _, rs in stacked for r in rs) == MIN_RANK  # ranks 4 and 8 count as 12
    for k in range(len(ranks)):
        own = [i for i, a in enumerate(rows) if a == k]
        for sub in (own, own[:1], own[1:4]):
            alone = y0[sub].clone()
            RowAdapters(lora, [k] * len(sub), invariant=True).add_delta(alone, x[sub], 0, 0)
            assert torch.equal(alone, y[sub]), (k, len(sub))
    # a prune: the same factors, a new layout; back to a composition seen before: its layout again
    A_before, layout_before = [b.A_nRI for b in adapters._buckets[0][0]], adapters._layout
    keep = [i for i in range(len(rows)) if i % 3]
    adapters.keep(keep)
    assert [b.A_nRI for b in adapters._buckets[0][0]] == A_before and adapters._layout is not layout_before
    pruned = y0[keep].clone()
    adapters.add_delta(pruned, x[keep], 0, 0)
    assert torch.equal(pruned, y[keep])
    adapters.set_rows(rows)
    assert adapters._layout is layout_before
    # adapters in fp32 on a bf16 base output: base + delta summed in fp32, rounded once (`dtypes.add_lora`)
    y_bf, x_bf = y0.bfloat16(), x.bfloat16()
    out, out32 = y_bf.clone(), y_bf.float()
    adapters.add_delta(out, x_bf, 0, 0)
    adapters.add_delta(out32, x_bf.float(), 0, 0)
    assert torch.equal(out, out32.bfloat16()) and not torch.equal(out, y_bf)
    assert torch.equal(out[-1], y_bf[-1])  # a base row: untouched


@pytest.mark.parametrize("ranks", [(16, 32, 64), (4, 8, 8)])
def test_block_diagonal_and_per_module_b_give_the_same_floats(monkeypatch, ranks):
    """A q|k|v group's B factors as one block-diagonal product per bucket (few calls) or one
    product per module (no zeros): every row's delta is the same floats either way, and alone."""
    import tinker_pipelines.rollout.mixed_lora as mixed_lora

    g = torch.Generator().manual_seed(1)
    I, outs = 576, (576, 192, 192)
    lora = [[[tuple((O, (torch.randn(r, I, generator=g) * 0.05, torch.randn(O, r, generator=g) * 0.05))
                    for O in outs)]] for r in ranks]
    rows = [0, 0, 1, 2, 2, 2, 1]
    x = torch.randn(len(rows), 1, I, generator=g)
    y0 = torch.randn(len(rows), 1, sum(outs), generator=g)
    got = {}
    for dispatch in (1e12, 0.0):
        monkeypatch.setattr(mixed_lora, "DISPATCH_FLOPS", {"cpu": dispatch})
        adapters = mixed_lora.RowAdapters(lora, rows, invariant=True)
        blocks = {b.B_nOR is not None for b in adapters._buckets[0][0]}
        assert blocks == {bool(dispatch)}
        got[dispatch] = y0.clone()
        adapters.add_delta(got[dispatch], x, 0, 0)
        alone = y0[rows.index(1):rows.index(1) + 1].clone()
        mixed_lora.RowAdapters(lora, [1], invariant=True).add_delta(alone, x[rows.index(1):rows.index(1) + 1], 0, 0)
        assert torch.equal(alone, got[dispatch][rows.index(1):rows.index(1) + 1])
    assert torch.equal(got[1e12], got[0.0])
    A, B = zip(*(f for _, f in lora[2][0][0]))
    want = torch.cat([x[3, 0] @ a.t() @ b.t() for a, b in zip(A, B)])
    assert torch.allclose(got[0.0][3, 0] - y0[3, 0], want, atol=1e-5)
