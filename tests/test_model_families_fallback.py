"""Every family a user names samples and trains, on the lean decoder where it can, else through
its own forward, loudly.

Qwen3.5 (hybrid: Gated DeltaNet linear-attention layers with a conv and a recurrent state, one
full-attention layer in four) takes the lean decoder (`rollout/delta_net.py`): greedy tokens equal
`generate`'s, logprobs equal the forward's, rows are pruned and repeated with their linear-attention
states, LoRA adapters (on the DeltaNet projections too) share one mixed batch, and a user's
directory round-trips through the Tinker service. A mixture-of-experts model (Qwen3-MoE) runs
through `hf_decoder` instead, printing one `warning:` line per model naming why and what it
costs; `Sampler.decode_path` / the worker's stats say which path ran.
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

from tinker_pipelines.models import load_model
from tinker_pipelines.rollout.sampler import Sampler, SampleRequest

QUESTIONS = ["What is 3 + 4 ?", "Guess a number", "You are helpful . Repeat this", "Guess a number"]


@pytest.fixture(scope="module")
def qwen35():
    """A random tiny Qwen3.5 (layers: linear, linear, linear, full) and the tiny tokenizer."""
    model, tok = load_model("tiny", arch="qwen3_5", hidden_size=64)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    return model, tok


def _sampler(model, tok) -> Sampler:
    return Sampler(model, tok.pad_token_id, [tok.eos_token_id], tokenizer=tok)


def _generate(model, prompt: list[int], n: int) -> list[int]:
    """HF `generate`'s greedy continuation of one unpadded prompt, `n` tokens, no stop token."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                         pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def _forward_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + completion])
    logits_TV = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits_TV, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def _check_against_hf(model, prompts: list[list[int]], samples, tol: float) -> None:
    for p, s in zip(prompts, samples):
        assert list(s.tokens) == _generate(model, p, len(s.tokens))
        diff = (_forward_logprobs(model, p, list(s.tokens)) - torch.tensor(s.logprobs)).abs().max().item()
        assert diff <= tol, diff


def test_qwen35_greedy_equals_generate_through_prune_and_repeat(qwen35, recwarn):
    """Left-padded rows of different lengths, a repeated prompt (its cache row copied), and a
    request that ends after 3 tokens (its rows pruned from the cache, states included)."""
    model, tok = qwen35
    prompts = [tok.encode(q) for q in QUESTIONS]
    sampler = _sampler(model, tok)
    short, long = sampler.sample_requests([SampleRequest(prompts[:2], 3, 0.0),
                                           SampleRequest(prompts[2:], 12, 0.0)])
    assert [len(s.tokens) for s in short + long] == [3, 3, 12, 12]
    _check_against_hf(model, prompts, short + long, tol=1e-5)
    assert sampler.decode_path == "lean"
    assert not [w for w in recwarn.list if "off the fast path" in str(w.message)]


def test_qwen35_bf16_greedy_equals_generate(qwen35):
    model, tok = qwen35
    bf16 = load_model("tiny", arch="qwen3_5", hidden_size=64, dtype=torch.bfloat16)[0]
    prompt = tok.encode(QUESTIONS[0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (s,) = _sampler(bf16, tok).sample([prompt], 8, temperature=0.0)
    assert list(s.tokens) == _generate(bf16, prompt, 8)
    # decode (the recurrent step) and the forward (the chunked rule) round differently in bf16;
    # tests/test_bf16.py's measured sampler-learner agreement bounds it
    assert (_forward_logprobs(bf16, prompt, list(s.tokens)) - torch.tensor(s.logprobs)).abs().max() <= 4e-3


def _two_adapters(model):
    """`model` with LoRA adapters `one` and `two` of random (nonzero) weights on attention and MLP."""
    import copy

    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "in_proj_qkv"]
    peft = None
    for i, name in enumerate(("one", "two")):
        cfg = LoraConfig(r=4, lora_alpha=16, target_modules=targets, init_lora_weights=False)
        torch.manual_seed(i)
        if peft is None:
            peft = get_peft_model(copy.deepcopy(model), cfg, adapter_name=name)
        else:
            peft.add_adapter(name, cfg)
    return peft.eval()


def test_qwen35_adapters_decode_in_one_mixed_batch_as_generate_does(qwen35):
    model, tok = qwen35
    peft = _two_adapters(model)
    prompts = [tok.encode(q) for q in QUESTIONS[:2]]
    sampler = _sampler(peft, tok)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got_a, got_b = sampler.sample_requests([SampleRequest(prompts, 6, 0.0, adapter="one"),
                                                SampleRequest(prompts, 6, 0.0, adapter="two")])
    assert sampler.supports_mixed_adapters() and sampler.decode_path == "lean"
    for name, got in (("one", got_a), ("two", got_b)):
        peft.set_adapter(name)
        _check_against_hf(peft, prompts, got, tol=1e-5)
    assert [s.tokens for s in got_a] != [s.tokens for s in got_b]  # each row ran its own adapter


def test_qwen35_lora_trains_and_samples_what_it_learned(qwen35):
    """The learner's forward_backward and optimizer step on Qwen3.5 (LoRA on its full-attention
    and MLP projections); the sampler then gives the trained policy's logprobs."""
    from tinker_pipelines.algorithms import get_algorithm
    from tinker_pipelines.training.learner import Learner, LearnerConfig
    from tinker_pipelines.types import Datum

    model, tok = qwen35
    learner = Learner(__import__("copy").deepcopy(model), LearnerConfig(mode="lora", learning_rate=5e-2, lora_rank=4),
                      tok.pad_token_id, init_seed=0)
    ids = tok.encode("What is 3 + 4 ? 7")
    datum = Datum(tuple(ids[:-1]), tuple(ids[1:]), tuple([0.0] * (len(ids) - 3) + [1.0, 1.0]))
    before = learner.compute_logprobs([datum])[0]
    metrics = learner.forward_backward([datum], get_algorithm("sft").loss)
    assert np.isfinite(metrics["loss"])
    grads = [p.grad for p in learner.params if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)
    learner.optim_step()
    after = learner.compute_logprobs([datum])[0]
    assert after[-1] > before[-1]  # the trained target got likelier
    prompt = ids[:-1]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        (s,) = _sampler(learner.model, tok).sample([prompt], 4, temperature=0.0)
    _check_against_hf(learner.model, [prompt], [s], tol=1e-5)


def test_a_mixture_of_experts_model_falls_back_loudly_and_llama_stays_lean(recwarn):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tinker_pipelines.models.tiny import build_tokenizer

    tok = build_tokenizer()
    cfg = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=256)
    torch.manual_seed(0)
    moe = Qwen3MoeForCausalLM(cfg).eval()
    prompts = [tok.encode(q) for q in QUESTIONS[:3]]
    sampler = _sampler(moe, tok)
    samples = sampler.sample(prompts, 5, temperature=0.0)
    _check_against_hf(moe, prompts, samples, tol=1e-5)
    assert sampler.decode_path.startswith("hf: ") and "Qwen3MoeForCausalLM" in sampler.decode_path
    (w,) = [w for w in recwarn.list if "off the fast path" in str(w.message)]
    assert "Qwen3MoeForCausalLM" in str(w.message) and "one adapter at a time" in str(w.message)

    llama, _ = load_model("tiny", hidden_size=64, num_layers=2)
    lean = _sampler(llama, tok)
    lean.sample(prompts, 3, temperature=0.0)
    assert lean.decode_path == "lean"
    assert len([w for w in recwarn.list if "off the fast path" in str(w.message)]) == 1


def test_a_user_qwen35_directory_round_trips_through_the_tinker_service(tmp_path):
    """`tinker serve --model DIR` on a Qwen3.5 directory a user made (no record.json): create,
    forward_backward, optim_step, sample; the sampled tokens' logprobs are what the service's
    forward computes for them, and the worker's stats say the lean decoder ran."""
    import shutil

    import tinker
    from tinker import types

    from tinker_pipelines import cli
    from tinker_pipelines.serving.tinker.launch import start_service
    from tinker_pipelines.worker.client import WorkerClient

    written = tmp_path / "written"
    assert cli.main(["model-dir", "tiny", "--arch", "qwen3_5", "--out", str(written),
                     "--model-kwargs", '{"hidden_size": 64}']) == 0
    user = tmp_path / "my-qwen35"
    shutil.copytree(written, user)
    (user / "record.json").unlink()  # not ours any more: its identity is its content hash
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    handle = start_service(str(user), home=tmp_path / "service", device="cpu", dtype="float32",
                           worker_args=["--threads", str(torch.get_num_threads())])
    try:
        sc = tinker.ServiceClient(base_url=handle.url, api_key="tml-local")
        tc = sc.create_lora_training_client(str(user), rank=4, seed=1).result()
        ids = load_model(str(user))[1].encode("What is 3 + 4 ? 7")
        datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs={
            "target_tokens": types.TensorData.from_numpy(np.asarray(ids[1:], np.int64)),
            "weights": types.TensorData.from_numpy(np.ones(len(ids) - 1, np.float32))})
        out = tc.forward_backward([datum], "cross_entropy").result()
        assert np.isfinite(out.metrics["loss:sum"])
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        sampler = tc.save_weights_and_get_sampling_client().result()
        prompt = types.ModelInput.from_ints(ids[:5])
        res = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)).result()
        assert len(res.sequences) == 2 and all(0 < len(s.tokens) <= 6 for s in res.sequences)
        for seq in res.sequences:
            full = sampler.compute_logprobs(types.ModelInput.from_ints(ids[:5] + seq.tokens)).result()
            assert np.allclose(full[5:], seq.logprobs, atol=1e-4), (full[5:], seq.logprobs)
        stats = WorkerClient(tmp_path / "service" / "worker.sock").stats()
        assert stats["decode_path"] == "lean"
        assert stats["base"].startswith("sha256:")
        sc.close("success").result()
    finally:
        handle.stop()
