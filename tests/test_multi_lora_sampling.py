"""Rows of different LoRA adapters in one decode batch: each row gets exactly its own adapter."""

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
