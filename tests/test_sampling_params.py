"""Top-k / top-p / min-p truncation, stop strings, and the learner recomputing the sampler's logprobs."""

from __future__ import annotations

import copy
import math
import re
from dataclasses import asdict

import pytest
import torch

from tinker_pipelines.config import ConfigError, config_from_dict
from tinker_pipelines.training.learner import Learner, LearnerConfig, pad_datums
from tinker_pipelines.models import stop_token_ids
from tinker_pipelines.rollout.sampler import Sampler, SampleRequest, completion_text, sample_tokens
from tinker_pipelines.rollout.truncation import keep_mask, target_logprobs
from tinker_pipelines.types import Datum

BELOW_ONE = float(torch.nextafter(torch.tensor(1.0), torch.tensor(0.0)))  # the largest float32 below 1


def _reference_keep(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> set[int]:
    """The kept set by the definition in `rollout.truncation`, in float64 Python."""
    z = [x / temperature for x in logits]
    m = max(z)
    p = [math.exp(x - m) for x in z]
    s = sum(p)
    p = [x / s for x in p]
    keep = set(range(len(p)))
    if top_k:
        kth = sorted(p, reverse=True)[top_k - 1]
        keep = {i for i in keep if p[i] >= kth}
    if top_p < 1:
        mass = sum(p[i] for i in keep)
        q = sorted((p[i] / mass for i in keep), reverse=True)
        acc, cut = 0.0, q[-1]
        for x in q:
            acc += x
            if acc >= top_p:
                cut = x
                break
        keep = {i for i in keep if p[i] / mass >= cut}
    if min_p:
        keep = {i for i in keep if p[i] >= min_p * max(p)}
    return keep


@pytest.mark.parametrize("top_k,top_p,min_p", [(5, 1.0, 0.0), (0, 0.7, 0.0), (0, 1.0, 0.2), (8, 0.9, 0.05)])
def test_draws_stay_in_the_truncated_set_with_its_frequencies_and_logprobs(top_k, top_p, min_p):
    g = torch.Generator().manual_seed(0)
    V, N, T = 40, 20000, 0.8
    logits_V = torch.randn(V, generator=g) * 2
    keep = _reference_keep(logits_V.tolist(), T, top_k, top_p, min_p)
    assert 1 < len(keep) < V
    tokens_N, lp_N = sample_tokens(logits_V.expand(N, V), T, torch.Generator().manual_seed(1),
                                   top_k=top_k, top_p=top_p, min_p=min_p)
    assert set(tokens_N.tolist()) <= keep  # never outside the truncated set
    p_V = torch.softmax(logits_V.double() / T, dim=0)
    kept = torch.tensor(sorted(keep))
    renorm_K = p_V[kept] / p_V[kept].sum()
    counts_K = torch.bincount(tokens_N, minlength=V)[kept].double()
    # frequencies within 5 standard errors of the renormalized probabilities
    assert ((counts_K / N - renorm_K).abs() <= 5 * (renorm_K * (1 - renorm_K) / N).sqrt() + 1e-4).all()
    expected_V = torch.full((V,), -math.inf, dtype=torch.float64)
    expected_V[kept] = renorm_K.log()
    assert torch.allclose(lp_N.double(), expected_V[tokens_N], atol=1e-5)


def test_edge_uniforms_never_pick_a_token_without_mass():
    V = 12
    logits = torch.randn(V, generator=torch.Generator().manual_seed(2))
    masked = logits.clone()
    masked[:3] = -math.inf  # leading and trailing tokens without mass
    masked[-4:] = -math.inf
    cases = [(masked, {}), (logits, {"top_k": 3}), (logits, {"top_p": 0.5}), (logits, {"min_p": 0.3}),
             (masked, {"top_k": 2, "min_p": 0.1})]
    for row, kw in cases:
        lp = torch.log_softmax(row, dim=0)
        mass = keep_mask(lp[None], **kw)[0] & lp.isfinite()
        first, last = int(mass.nonzero()[0]), int(mass.nonzero()[-1])
        # 1.0 is outside torch.rand's range, but a device generator that returned it is handled too
        u = torch.tensor([0.0, BELOW_ONE, 1.0])
        tokens, lps = sample_tokens(row.expand(3, V), 1.0, uniforms_B=u, **kw)
        assert tokens.tolist() == [first, last, last], kw
        assert lps.isfinite().all()
        # per-row parameters (a mixed batch) take the same path
        tokens_t, _ = sample_tokens(row.expand(3, V), torch.tensor([1.0, 1.0, 1.0]), uniforms_B=u,
                                    **{k: torch.tensor([v] * 3) for k, v in kw.items()})
        assert tokens_t.tolist() == tokens.tolist()


def test_ties_at_the_boundaries_are_kept_together_whatever_the_order():
    # top-k = 2 with the 2nd, 3rd and 4th tied: all three kept; top-p reaching its mass inside a tie
    logits = torch.tensor([3.0, 1.0, 1.0, 1.0, 0.0, -1.0])
    lp = torch.log_softmax(logits, dim=0)
    assert keep_mask(lp[None], top_k=2)[0].tolist() == [True, True, True, True, False, False]
    p = lp.exp()
    top_p = float(p[0] + p[1] * 1.5)  # mass reached at the second of the tied tokens
    assert keep_mask(lp[None], top_p=top_p)[0].tolist() == [True, True, True, True, False, False]
    for perm in (torch.tensor([5, 3, 1, 0, 2, 4]), torch.tensor([2, 0, 4, 1, 5, 3])):
        for kw in ({"top_k": 2}, {"top_p": top_p}, {"min_p": float(p[1] / p[0])}):
            assert torch.equal(keep_mask(lp[perm][None], **kw)[0], keep_mask(lp[None], **kw)[0][perm])


def test_defaults_are_plain_sampling_bit_for_bit():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 300, generator=g)
    u = torch.rand(16, generator=g)
    a = sample_tokens(logits, 0.7, uniforms_B=u)
    b = sample_tokens(logits, 0.7, uniforms_B=u, top_k=0, top_p=1.0, min_p=0.0)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    lp = torch.log_softmax(logits / 0.7, dim=-1)  # the formula before truncation existed
    cdf = lp.exp().cumsum(dim=-1)
    old = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True).squeeze(1).clamp(max=299)
    assert torch.equal(a[0], old) and torch.equal(a[1], lp.gather(1, old[:, None]).squeeze(1))
    targets = torch.randint(0, 300, (2, 8), generator=g)
    logits_BKV = torch.randn(2, 8, 300, generator=g)
    plain = torch.log_softmax(logits_BKV / 0.7, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    assert torch.equal(target_logprobs(logits_BKV, targets, 0.7), plain)


def _datum(prompt: list[int], tokens: tuple[int, ...], support: tuple[int, ...] = ()) -> Datum:
    seq = list(prompt) + list(tokens)
    return Datum(tuple(seq[:-1]), tuple(seq[1:]), tuple([0.0] * (len(prompt) - 1) + [1.0] * len(tokens)),
                 support_sizes=tuple([0] * (len(prompt) - 1)) + support if support else ())


def _prompts(vocab: int, n: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(5, vocab, (3 + 2 * i,), generator=g).tolist() for i in range(n)]


SETTINGS = [dict(temperature=0.8, top_k=12, top_p=1.0, min_p=0.0), dict(temperature=1.0, top_k=0, top_p=0.8, min_p=0.0),
            dict(temperature=1.2, top_k=40, top_p=0.9, min_p=0.02)]


@pytest.mark.parametrize("lora", [False, True])
def test_learner_recomputes_the_samplers_logprobs(tiny, lora):
    """The random tiny model's next-token distributions are near-uniform: hundreds of tokens of
    almost equal probability sit at the top-p cut, where the sampler's and the learner's
    equivalent float computations (1e-6 apart) could keep different tokens. The sampler reports
    how many it kept (`Sample.support`) and the learner keeps as many of its own, so they agree
    all the same."""
    base, tok = tiny
    prompts = _prompts(len(tok))
    group = [p for p in prompts[:3] for _ in range(3)]  # shared prompts: the learner's prefix-sharing forward
    for s in SETTINGS:
        learner = Learner(copy.deepcopy(base), LearnerConfig(mode="lora" if lora else "full", **s), tok.pad_token_id,
                          init_seed=0)
        policy = learner.model
        sampler = Sampler(policy, tok.pad_token_id, stop_token_ids(tok))
        samples = sampler.sample(group, 12, s["temperature"], torch.Generator().manual_seed(4), top_k=s["top_k"],
                                 top_p=s["top_p"], min_p=s["min_p"])
        assert all(math.isfinite(x) for smp in samples for x in smp.logprobs)
        for smp in samples:  # one kept-set size per token, within what the parameters allow
            assert len(smp.support) == len(smp.tokens) and all(1 <= n < len(tok) for n in smp.support)
            assert s["top_k"] == 0 or max(smp.support) <= s["top_k"] + 2  # ties at the k-th are kept together
        datums = [_datum(p, smp.tokens, smp.support) for p, smp in zip(group, samples)]
        padded = pad_datums(datums, tok.pad_token_id)
        with torch.no_grad():
            lp_shared = learner._forward(policy, padded)[0]  # the training forward (prefix sharing on)
        lp_plain = learner.compute_logprobs(datums)
        for i, (p, smp) in enumerate(zip(group, samples)):
            n = len(smp.tokens)
            got = torch.tensor(lp_plain[i][len(p) - 1:len(p) - 1 + n])
            assert torch.allclose(got, torch.tensor(smp.logprobs), atol=1e-4, rtol=0), s
            assert torch.allclose(lp_shared[i, len(p) - 1:len(p) - 1 + n], torch.tensor(smp.logprobs),
                                  atol=1e-4, rtol=0), s


def test_mixed_requests_in_one_batch_equal_each_request_alone(tiny):
    model, tok = tiny
    prompts = _prompts(len(tok))
    sampler = Sampler(model, tok.pad_token_id, stop_token_ids(tok), tokenizer=tok)
    kinds = [dict(temperature=0.8, top_k=12), dict(temperature=1.0, top_p=0.8), dict(temperature=0.0),
             dict(temperature=1.0), dict(temperature=1.1, top_k=30, top_p=0.9, min_p=0.05, stop=("e",))]

    def requests():
        return [SampleRequest(prompts[i:i + 2], 10, generator=torch.Generator().manual_seed(10 + i), **kw)
                for i, kw in enumerate(kinds)]

    together = sampler.sample_requests(reqs := requests())
    states = [r.generator.get_state() for r in reqs]
    for i, (req, out) in enumerate(zip(requests(), together)):
        alone = sampler.sample_requests([req])[0]
        assert [s.tokens for s in alone] == [s.tokens for s in out]
        assert [s.stop_string for s in alone] == [s.stop_string for s in out]
        assert torch.equal(req.generator.get_state(), states[i])
        for a, b in zip(alone, out):
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)
        # and the learner's recompute of each request's rows, with that request's parameters
        kw = {k: v for k, v in kinds[i].items() if k != "stop"}
        if kw["temperature"] > 0:
            lcfg = LearnerConfig(mode="full", **kw)
            logits_ok = [_recompute(model, lcfg, p, s.tokens) for p, s in zip(req.prompts, out)]
            for got, s in zip(logits_ok, out):
                assert torch.allclose(got, torch.tensor(s.logprobs), atol=1e-4, rtol=0)


def test_top_logprobs_are_those_of_the_distribution_each_token_was_drawn_from(tiny):
    """`SampleRequest.top_logprobs`: per token, the k most likely tokens of the very distribution
    it was drawn from (temperature and truncation applied, greedy at temperature 1), recomputed
    here from a full forward; asking for them changes no token or logprob, and requests with
    different k (or none) share one batch."""
    model, tok = tiny
    prompts = _prompts(len(tok))
    sampler = Sampler(model, tok.pad_token_id, stop_token_ids(tok), tokenizer=tok, reuse_prompts=False)
    kinds = [dict(temperature=0.8, top_k=4, top_logprobs=6), dict(temperature=0.0, top_logprobs=3),
             dict(temperature=1.1, top_p=0.9, top_logprobs=5), dict(temperature=0.7), dict(temperature=1.0, top_logprobs=2)]

    def requests(top: bool):
        # requests 1 and 3 end early: their rows are pruned while the others decode on
        return [SampleRequest(prompts[i:i + 2], 8 if i % 2 == 0 else 2, generator=torch.Generator().manual_seed(20 + i),
                              **{k: v for k, v in kw.items() if top or k != "top_logprobs"}) for i, kw in enumerate(kinds)]

    with_top, without = sampler.sample_requests(requests(True)), sampler.sample_requests(requests(False))
    for i, (kw, out, plain) in enumerate(zip(kinds, with_top, without)):
        assert [s.tokens for s in out] == [s.tokens for s in plain] and [s.logprobs for s in out] == [s.logprobs for s in plain]
        k = kw.get("top_logprobs", 0)
        for prompt, s in zip(prompts[i:i + 2], out):
            assert len(s.top_logprobs) == (len(s.tokens) if k else 0)
            if not k:
                continue
            ids = torch.tensor([list(prompt) + list(s.tokens)])
            with torch.no_grad():
                logits_TV = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
            T = kw["temperature"] or 1.0
            dist_TV = torch.log_softmax(logits_TV / T, dim=-1)
            trunc = {x: kw[x] for x in ("top_k", "top_p") if x in kw}
            if trunc:
                keep_TV = keep_mask(dist_TV, trunc.get("top_k", 0), trunc.get("top_p", 1.0), 0.0)
                dist_TV = torch.where(keep_TV, dist_TV - torch.logsumexp(dist_TV.masked_fill(~keep_TV, -math.inf), -1,
                                                                         keepdim=True), -math.inf)
            want_TK = dist_TV.topk(k, dim=-1)
            for t, (token, lp, alts) in enumerate(zip(s.tokens, s.logprobs, s.top_logprobs)):
                n = int(want_TK.values[t].isfinite().sum())  # past the kept set, any order of no-mass tokens
                assert [a for a, _ in alts][:n] == want_TK.indices[t, :n].tolist() and len(alts) == k
                assert [v for _, v in alts] == pytest.approx(want_TK.values[t].tolist(), abs=1e-4)
                assert dict(alts).get(token, lp) == lp  # the sampled token's own logprob, exactly
                if trunc:  # outside the kept set: no mass
                    assert all(v == -math.inf for a, v in alts if not keep_TV[t, a])


def test_top_logprobs_of_a_bf16_model_are_fp32_and_agree_with_the_sampled_logprob():
    from tinker_pipelines.models import load_model

    model, tok = load_model("tiny", dtype="bfloat16")
    sampler = Sampler(model, tok.pad_token_id, stop_token_ids(tok), tokenizer=tok)
    (s,) = sampler.sample([[5, 6, 7, 8]], 6, 0.8, torch.Generator().manual_seed(0), top_k=5, top_logprobs=4)
    for token, lp, alts in zip(s.tokens, s.logprobs, s.top_logprobs):
        assert dict(alts)[token] == lp and [v for _, v in alts] == sorted((v for _, v in alts), reverse=True)
    # bf16 logits, logprobs computed in fp32 (values no bf16 number equals)
    values = [v for alts in s.top_logprobs for _, v in alts]
    assert any(torch.tensor(v).bfloat16().float().item() != v for v in values) and not torch.cuda.is_initialized()


def _recompute(model, lcfg: LearnerConfig, prompt, tokens) -> torch.Tensor:
    ids = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, len(prompt) - 1:-1]
    return target_logprobs(logits, torch.tensor([list(tokens)]), lcfg.temperature, lcfg.top_k, lcfg.top_p,
                           lcfg.min_p)[0]


def test_stop_strings_end_rows_and_others_continue(tiny):
    model, tok = tiny
    prompts = _prompts(len(tok))
    sampler = Sampler(model, tok.pad_token_id, [], tokenizer=tok)
    free = sampler.sample(prompts, 24, 0.0)
    texts = [tok.decode(list(s.tokens), skip_special_tokens=True) for s in free]
    # stop strings that occur in some rows' text, at different places
    stops = tuple(dict.fromkeys(t[8:10] for t in texts[:2] if len(t) >= 10))
    assert stops
    stopped = sampler.sample(prompts, 24, 0.0, stop=stops)
    n_stopped = 0
    for f, s in zip(free, stopped):
        ends = [n for n in range(1, len(f.tokens) + 1)
                if any(x in tok.decode(list(f.tokens[:n]), skip_special_tokens=True) for x in stops)]
        if not ends:
            assert s.tokens == f.tokens and s.stop_reason == "length" and s.stop_string is None
            continue
        n_stopped += 1
        n = ends[0]  # the token that completes the first stop string is the last one kept
        assert s.tokens == f.tokens[:n] and s.stop_reason == "stop" and s.stop_string in stops
        assert s.logprobs == pytest.approx(f.logprobs[:n], abs=1e-6)
        full = tok.decode(list(s.tokens), skip_special_tokens=True)
        text = completion_text(tok, s)
        assert s.stop_string not in text and full.startswith(text + s.stop_string)
    assert 1 <= n_stopped < len(prompts)
    with pytest.raises(ValueError, match="tokenizer"):
        Sampler(model, tok.pad_token_id, []).sample(prompts, 4, stop=("x",))
    with pytest.raises(ValueError, match="top_p"):
        sampler.sample(prompts, 4, top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        sampler.sample(prompts, 4, top_k=-1)


def test_episode_actions_end_before_the_stop_string(tiny):
    from tinker_pipelines.envs import Env
    from tinker_pipelines.rollout.episodes import RolloutConfig, run_episodes
    from tinker_pipelines.types import StepResult

    seen = []

    class Echo(Env):
        def reset(self, seed=None):
            return [{"role": "user", "content": f"Say {seed}."}]

        def step(self, action):
            seen.append(action)
            return StepResult([], 0.0, True, {})

    model, tok = tiny
    sampler = Sampler(model, tok.pad_token_id, stop_token_ids(tok), tokenizer=tok)
    free = run_episodes(sampler, tok, [Echo() for _ in range(6)], list(range(6)), RolloutConfig(16, 0.0))
    stop = next(a[3:5] for a in seen if len(a) >= 5)
    seen.clear()
    cut = run_episodes(sampler, tok, [Echo() for _ in range(6)], list(range(6)), RolloutConfig(16, 0.0, stop=(stop,)))
    hits = 0
    for f, c, action in zip(free, cut, seen):
        turn = c.turns[0]
        full = tok.decode(list(turn.sampled_tokens), skip_special_tokens=True)
        if stop in full:
            hits += 1
            assert action == full[:full.index(stop)]
            assert turn.sampled_tokens == f.turns[0].sampled_tokens[:len(turn.sampled_tokens)]
        else:
            assert turn.sampled_tokens == f.turns[0].sampled_tokens
    assert hits >= 1


def test_worker_engine_equals_in_process(tiny):
    from tinker_pipelines.worker.engine import Engine, EngineConfig

    pristine, tok = tiny
    prompts = _prompts(len(tok))
    kinds = [dict(temperature=0.9, top_k=20, top_p=0.85, stop=["e"]), dict(temperature=1.0, min_p=0.05)]
    results = {}
    for batching in (True, False):
        engine = Engine(copy.deepcopy(pristine), tok.pad_token_id, stop_token_ids(tok), "tiny", EngineConfig(batching=batching),
                        tokenizer=tok)
        for name in ("a", "b"):
            engine.create(1, name, asdict(LearnerConfig(**{k: v for k, v in kinds[0 if name == "a" else 1].items()
                                                           if k != "stop"})), seed=5, base_name="tiny")
        reqs = [{"adapter": n, "prompts": prompts, "max_new_tokens": 10,
                 "generator_state": torch.Generator().manual_seed(i).get_state().numpy().tobytes(), **kw}
                for i, (n, kw) in enumerate(zip(("a", "b"), kinds))]
        results[batching] = engine.sample(reqs)
    # in-process: the same parameters through `Sampler.sample` on the bare base (fresh adapters are the identity)
    sampler = Sampler(pristine, tok.pad_token_id, stop_token_ids(tok), tokenizer=tok)
    for i, kw in enumerate(kinds):
        local = sampler.sample(prompts, 10, generator=torch.Generator().manual_seed(i),
                               **{**kw, "stop": tuple(kw.get("stop", ()))})
        for batching in (True, False):
            remote = results[batching][i]["samples"]
            assert [tuple(r[0]) for r in remote] == [s.tokens for s in local], (batching, kw)
            assert [r[3] for r in remote] == [s.stop_string for s in local]
            for r, s in zip(remote, local):
                assert r[1] == pytest.approx(s.logprobs, abs=1e-5)
                assert tuple(r[4]) == s.support  # the kept-set sizes travel
                # top_k 20 truncates every step; min_p 0.05 keeps all of the near-uniform vocabulary: nothing to record
                assert len(s.support) == (len(s.tokens) if "top_k" in kw else 0)
    assert any(s[3] for s in results[True][0]["samples"])  # the stop string ended some rows


@pytest.mark.parametrize("field,value,message", [
    ("top_p", 0.0, "training.top_p must be in (0, 1]"), ("top_p", 1.5, "training.top_p"),
    ("top_k", -1, "training.top_k must be >= 0"), ("top_k", 2.5, "training.top_k must be int"),
    ("min_p", 1.0, "training.min_p must be in [0, 1)"), ("stop", [""], "training.stop must be non-empty strings"),
    ("stop", "\n", "training.stop must be a list"), ("stop", [3], "training.stop"),
])
def test_config_errors_name_the_field(field, value, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_dict({"training": {field: value}})


def test_config_values_reach_the_sampler_and_learner():
    from tinker_pipelines.loops.experiment import Experiment

    cfg = config_from_dict({"training": {"top_k": 7, "top_p": 0.9, "min_p": 0.01, "stop": ["\n\n"]}})
    exp = Experiment(cfg)
    assert exp.rollout_cfg.sampling_kwargs() == {"top_k": 7, "top_p": 0.9, "min_p": 0.01, "stop": ("\n\n",)}
    lr = exp.start_rl()
    assert (lr.cfg.top_k, lr.cfg.top_p, lr.cfg.min_p) == (7, 0.9, 0.01)
    assert exp.sampler().tokenizer is exp.tokenizer
    dpo = Experiment(config_from_dict({"algorithm": {"name": "dpo"}, "training": {"top_p": 0.9, "group_size": 2}}))
    assert dpo.rollout_cfg.top_p == 0.9 and dpo.start_rl().cfg.top_p == 1.0  # DPO's loss: the untruncated model
    assert config_from_dict({}).training.stop == () and Experiment(config_from_dict({})).rollout_cfg.sampling_kwargs() == {}


@pytest.mark.e2e
def test_worker_process_serves_the_parameters(tiny, tmp_path):
    import os
    import signal

    from tinker_pipelines.worker.client import RemoteLearner, RemoteSampler, WorkerClient, start_worker

    model, tok = tiny
    prompts = _prompts(len(tok))
    proc = start_worker("tiny", tmp_path / "w.sock", device="cpu", dtype="float32", extra=["--threads", "1"], log=tmp_path / "log")
    try:
        client = WorkerClient(tmp_path / "w.sock")
        RemoteLearner(client, "e", LearnerConfig(top_p=0.8), seed=0, base_name="tiny")  # a fresh adapter: the base
        kw = dict(top_k=30, top_p=0.8, stop=("e",))
        remote = RemoteSampler(client, "e").sample(prompts, 10, 1.0, torch.Generator().manual_seed(6), **kw)
        local = Sampler(model, tok.pad_token_id, stop_token_ids(tok), tokenizer=tok).sample(
            prompts, 10, 1.0, torch.Generator().manual_seed(6), **kw)
        assert [s.tokens for s in remote] == [s.tokens for s in local]
        assert [s.stop_string for s in remote] == [s.stop_string for s in local]
        assert [s.support for s in remote] == [s.support for s in local] and all(s.support for s in local)
        assert any(s.stop_string for s in local)
        client.close()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def test_top_n_renormalization_has_the_masked_softmax_gradient():
    """Over a kept set of n tokens the learner's logprob and its gradient are those of
    log_softmax restricted to the set, whichever the set's size per position; a target the
    learner ranks just outside its top n (float error swapped it with the n-th) is renormalized
    over the top n - 1 and itself, as the sampler's set was."""
    from tinker_pipelines.rollout.truncation import top_n_logprobs

    g = torch.Generator().manual_seed(0)
    logits_BKV = torch.randn(2, 3, 50, generator=g, dtype=torch.float64, requires_grad=True)
    n_BK = torch.tensor([[1, 5, 17], [50, 2, 9]])
    lp_BKV = torch.log_softmax(logits_BKV, dim=-1)
    order_BKV = lp_BKV.detach().argsort(dim=-1, descending=True)
    ranks = torch.tensor([[0, 3, 16], [49, 2, 4]])  # the target's rank: [1, 1] is just outside its top 2
    targets_BK = order_BKV.gather(-1, ranks[..., None]).squeeze(-1)
    target_BK = lp_BKV.gather(-1, targets_BK[..., None]).squeeze(-1)
    got_BK = top_n_logprobs(lp_BKV, target_BK, n_BK)
    keep_BKV = torch.zeros_like(lp_BKV, dtype=torch.bool)
    for b in range(2):
        for k in range(3):
            n, top = int(n_BK[b, k]), order_BKV[b, k].tolist()
            kept = top[:n] if ranks[b, k] < n else top[:n - 1] + [int(targets_BK[b, k])]
            keep_BKV[b, k, kept] = True
    want_BK = target_BK - torch.logsumexp(lp_BKV.masked_fill(~keep_BKV, -math.inf), dim=-1)
    assert torch.allclose(got_BK, want_BK, atol=1e-12)
    assert got_BK[0, 0].detach().item() == pytest.approx(0.0, abs=1e-12)  # a set of one: probability 1
    w_BK = torch.randn(2, 3, generator=g, dtype=torch.float64)
    (grad_got,) = torch.autograd.grad((got_BK * w_BK).sum(), logits_BKV, retain_graph=True)
    (grad_want,) = torch.autograd.grad((want_BK * w_BK).sum(), logits_BKV)
    assert torch.allclose(grad_got, grad_want, atol=1e-12)


def test_episode_datums_carry_the_kept_set_sizes(tiny):
    from tinker_pipelines.loops.datums import trajectory_to_datum
    from tinker_pipelines.envs import Env
    from tinker_pipelines.rollout.episodes import RolloutConfig, run_episodes
    from tinker_pipelines.tracking.codec import decode, encode
    from tinker_pipelines.types import StepResult

    class Twice(Env):  # two turns: the second turn's sizes land after the environment's tokens
        def reset(self, seed=None):
            self.turn = 0
            return [{"role": "user", "content": f"Count from {seed}."}]

        def step(self, action):
            self.turn += 1
            return StepResult([{"role": "user", "content": "More."}] if self.turn < 2 else [], 0.0, self.turn >= 2)

    model, tok = tiny
    sampler = Sampler(model, tok.pad_token_id, stop_token_ids(tok), tokenizer=tok)
    trajs = run_episodes(sampler, tok, [Twice() for _ in range(3)], [1, 2, 3],
                         RolloutConfig(6, 1.0, max_turns=2, top_p=0.8), torch.Generator().manual_seed(0))
    for t in trajs:
        d = trajectory_to_datum(t, 1.0)
        assert len(d.support_sizes) == len(d.input_tokens)
        for turn in t.turns:
            assert len(turn.sampled_support) == len(turn.sampled_tokens)
            start = len(turn.prompt_tokens) - 1
            assert d.support_sizes[start:start + len(turn.sampled_tokens)] == turn.sampled_support
        assert all(n == 0 for n, w in zip(d.support_sizes, d.weights) if w == 0)
        assert decode(encode(d)) == d  # artifacts keep them
    plain = run_episodes(sampler, tok, [Twice()], [1], RolloutConfig(6, 1.0, max_turns=2), torch.Generator().manual_seed(0))
    assert trajectory_to_datum(plain[0], 1.0).support_sizes == ()  # untruncated: nothing to record
