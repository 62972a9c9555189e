"""Decode without a host sync per token on a GPU: finished rows and stop strings are checked every
few steps there (the same samples as a check after every step), uniforms drawn on the device; the
CPU keeps checking every step and drawing on the CPU."""

from __future__ import annotations

import pytest
import torch

from tinker_pipelines.rollout.decode_rows import DEVICE_CHECK_EVERY, check_interval, uniforms_on_device
from tinker_pipelines.rollout.sampler import Sampler, SampleRequest


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(4, vocab, (int(n),), generator=g).tolist() for n in torch.randint(3, 12, (6,), generator=g)]


def _requests(prompts: list[list[int]], stops: tuple[str, ...]) -> list[SampleRequest]:
    return [SampleRequest(prompts[:2], 10, 0.8, torch.Generator().manual_seed(5), top_p=0.9, stop=stops),
            SampleRequest(prompts[2:5], 20, 0.0, stop=stops),
            SampleRequest(prompts[5:], 24, 1.2, torch.Generator().manual_seed(6), min_p=0.05, top_k=15),
            SampleRequest(prompts, 24, 0.9, torch.Generator().manual_seed(7), stop=stops),
            SampleRequest(prompts[:1], 24, 0.0, stop=stops)]


def _flat(results):
    return [s for samples in results for s in samples]


@pytest.mark.parametrize("lean", [True, False])
@pytest.mark.parametrize("every", [3, DEVICE_CHECK_EVERY])
def test_checking_every_few_steps_gives_the_samples_of_checking_every_step(tiny, lean, every):
    """Stop tokens, stop strings (one also the text of a stop token: where the token completes it,
    the token wins) and lengths end each row at the same token, with the same reason and string;
    logprobs differ only by the float rounding of other batch sizes (rows are pruned later)."""
    model, tok = tiny
    prompts = _prompts(len(tok))
    free = Sampler(model, tok.pad_token_id, [], tokenizer=tok).sample(prompts, 24, 0.0)
    texts = [tok.decode(list(s.tokens), skip_special_tokens=True) for s in free]
    stop_ids = sorted({free[0].tokens[3], free[2].tokens[9], free[4].tokens[15]})
    both = tok.decode([free[0].tokens[3]], skip_special_tokens=True)  # a stop token's own text
    assert both
    stops = tuple(dict.fromkeys([both] + [t[8:10] for t in texts[:3] if len(t) >= 10]))
    runs = []
    for check in (None, every):
        sampler = Sampler(model, tok.pad_token_id, stop_ids, tokenizer=tok, lean=lean)
        sampler.check_every = check
        runs.append(_flat(sampler.sample_requests(_requests(prompts, stops))))
    each, batched = runs
    token_won = each[-1]  # greedy: it ends on a stop token whose text is a stop string
    assert token_won.tokens[-1] == free[0].tokens[3] and both in tok.decode(list(token_won.tokens))
    assert token_won.stop_reason == "stop" and token_won.stop_string is None
    assert sum(s.stop_string is not None for s in each) >= 2 and sum(s.stop_reason == "stop" for s in each) >= 4
    for a, b in zip(each, batched):
        assert (a.tokens, a.stop_reason, a.stop_string, a.support) == (b.tokens, b.stop_reason, b.stop_string, b.support)
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_stop_strings_are_scanned_once_per_check_not_per_step(tiny, monkeypatch):
    """With checks every 8 steps, 24 steps scan stop strings 3 times, in one decode call each."""
    model, tok = tiny
    prompts = _prompts(len(tok))
    calls = []
    decode = tok.batch_decode

    def counting(*args, **kwargs):
        calls.append(len(args[0]))
        return decode(*args, **kwargs)

    monkeypatch.setattr(tok, "batch_decode", counting)
    sampler = Sampler(model, tok.pad_token_id, [], tokenizer=tok)
    sampler.sample(prompts, 24, 0.0, stop=("\x00never",))
    assert len(calls) == 24 and calls[0] == len(prompts)  # the CPU checks after every step
    calls.clear()
    sampler.check_every = 8
    sampler.sample(prompts, 24, 0.0, stop=("\x00never",))
    assert calls == [8 * len(prompts)] * 3


def test_which_device_draws_and_how_often_python_looks():
    assert check_interval(torch.device("cpu")) == 1
    assert check_interval(torch.device("cuda", 0)) == DEVICE_CHECK_EVERY > 1
    assert check_interval(torch.device("cuda", 0), 2) == 2
    with pytest.raises(ValueError, match="check_every"):
        check_interval(torch.device("cpu"), 0)
    assert uniforms_on_device(torch.device("cuda", 0)) and not uniforms_on_device(torch.device("cpu"))
    assert not uniforms_on_device(torch.device("cuda", 0), False)
    assert not torch.cuda.is_initialized()


def test_device_uniforms_keep_a_request_independent_of_its_batch(tiny):
    """Uniforms drawn on the model's device (here the CPU, forced) from each request's generator:
    a request's samples are those it gets alone, whatever else shares the batch."""
    model, tok = tiny
    prompts = _prompts(len(tok))
    sampler = Sampler(model, tok.pad_token_id, [])
    sampler.device_uniforms, sampler.check_every = True, 4
    alone = sampler.sample(prompts[:3], 12, 1.0, torch.Generator().manual_seed(1))
    together = sampler.sample_requests([SampleRequest(prompts[3:], 5, 0.7, torch.Generator().manual_seed(2)),
                                        SampleRequest(prompts[:3], 12, 1.0, torch.Generator().manual_seed(1))])[1]
    assert [s.tokens for s in alone] == [s.tokens for s in together]
    for a, b in zip(alone, together):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


@pytest.mark.parametrize("temps", [[0.0, 0.7, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [0.5, 1.3, 0.7, 2.0]])
def test_host_temperatures_take_the_branches_the_device_values_take(temps):
    """Per-row temperatures known on the host give bit for bit the draw that reading them from
    the device gives (the decode loop passes them, so telling greedy rows apart needs no sync)."""
    from tinker_pipelines.rollout.draw import sample_tokens

    g = torch.Generator().manual_seed(0)
    logits_BV = torch.randn(4, 300, generator=g) * 2
    u_B = torch.rand(4, generator=g)
    temp_B = torch.tensor(temps)
    for kw in ({}, {"top_k": 20, "top_p": 0.9}):
        want = sample_tokens(logits_BV, temp_B, uniforms_B=u_B, with_support=True, **kw)
        got = sample_tokens(logits_BV, temp_B, uniforms_B=u_B, with_support=True, host_temperatures=temp_B.tolist(), **kw)
        assert all(torch.equal(a, b) for a, b in zip(want, got))


def test_host_temperatures_are_what_the_draw_reads():
    """The branch follows the host values (here deliberately all greedy while the tensor says 1):
    the device values were not read; a list of the wrong length is refused."""
    from tinker_pipelines.rollout.draw import sample_tokens

    logits_BV = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    tokens_B, _ = sample_tokens(logits_BV, torch.ones(3), uniforms_B=torch.zeros(3), host_temperatures=[0.0] * 3)
    assert torch.equal(tokens_B, logits_BV.argmax(dim=-1))
    with pytest.raises(ValueError, match="host_temperatures"):
        sample_tokens(logits_BV, torch.ones(3), uniforms_B=torch.zeros(3), host_temperatures=[0.0])


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check)")


@CUDA
def test_cuda_decode_checks_every_few_steps_with_device_uniforms(tiny):
    """On CUDA: uniforms from device generators seeded by the requests' own, rows checked every
    `DEVICE_CHECK_EVERY` steps; the same seed gives the same samples, alone or batched, and the
    same samples as checking after every step."""
    model, tok = tiny
    model.to("cuda")
    prompts = _prompts(len(tok))
    stop_ids = [tok.eos_token_id]
    sampler = Sampler(model, tok.pad_token_id, stop_ids, tokenizer=tok)
    assert sampler.check_every is None and check_interval(torch.device("cuda", 0)) == DEVICE_CHECK_EVERY

    def run(check, with_other):
        sampler.check_every = check
        reqs = [SampleRequest(prompts[:3], 20, 1.0, torch.Generator().manual_seed(1), stop=(" d",))]
        if with_other:
            reqs.append(SampleRequest(prompts[3:], 7, 0.0))
        return sampler.sample_requests(reqs)[0]

    base = run(None, False)
    for other in (run(None, True), run(1, False)):
        assert [(s.tokens, s.stop_reason, s.stop_string) for s in other] == \
               [(s.tokens, s.stop_reason, s.stop_string) for s in base]
        for a, b in zip(base, other):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_chunked_logprobs_match_the_unchunked_ones(dtype):
    from tinker_pipelines.rollout.truncation import target_logprobs, target_logprobs_unchunked

    g = torch.Generator().manual_seed(0)
    logits_BKV = (torch.randn(2, 300, 5000, generator=g) * 3).to("cuda", dtype)
    targets_BK = torch.randint(0, 5000, (2, 300), generator=g).to("cuda")
    for kw in ({}, {"top_k": 50, "top_p": 0.9}):
        got, want = [], []
        for fn, out in ((target_logprobs, got), (target_logprobs_unchunked, want)):
            x = logits_BKV.clone().requires_grad_(True)
            lp = fn(x, targets_BK, 0.8, **kw, **({"chunk_rows": 64} if fn is target_logprobs else {}))
            lp.sum().backward()
            out += [lp.detach(), x.grad.float()]
        assert torch.allclose(got[0], want[0], atol=1e-5)
        assert torch.allclose(got[1], want[1], atol=1e-5, rtol=2 ** -7)


@CUDA
def test_cuda_micro_batch_peak_is_below_the_unchunked_one():
    from benchmarks.ready_logprobs import micro_batch_peaks

    peaks = micro_batch_peaks("cuda")
    assert peaks["peak_logprob_mb_150k_vocab"] < 2 * peaks["logits_mb"] + 3 * 67.2 < peaks["peak_logprob_mb_150k_vocab_old"]
