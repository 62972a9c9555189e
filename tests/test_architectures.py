"""Every family of the fast path (Llama 3.x, Qwen2/2.5, Qwen3, Mistral, Qwen3.5), on tiny random configs
built from transformers' own config classes: greedy tokens and logprobs against Hugging Face,
mixed-adapter rows against solo, prompt-shared training against plain, and a Tinker service
round trip on a saved model directory. Each config carries its family's differences where short
sequences meet them: Llama 3's RoPE scaling over 32 positions, Qwen2's biases with a 12-token
window on its second layer, Qwen3's q/k norms with 32-wide heads and tied embeddings, Mistral's
12-token window everywhere, Qwen3.5's three Gated DeltaNet layers and one gated full-attention
layer with a quarter-head rotary; grouped-query ratios 4, 2, 2, 1 and 2."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import torch

from benchmarks.architectures import (PAD, Dims, add_adapters, against_hf, build_model, family_config,
                                      forward_logprobs, hf_greedy, mixed_and_solo, prompts, targets_for,
                                      tinker_datums, tinker_learner)
from tinker_pipelines.rollout.lean_decoder import LeanDecoder
from tinker_pipelines.rollout.sampler import Sampler
from tinker_pipelines.training.prefix_sharing import supports_prefix_sharing

VOCAB = 448  # the tiny tokenizer's: the service test saves it beside the weights
CASES = {
    "llama3": (Dims(hidden=64, layers=2, heads=4, kv_heads=1, intermediate=128, vocab=VOCAB),
               {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 32}}),
    "qwen2": (Dims(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=VOCAB),
              {"use_sliding_window": True, "sliding_window": 12, "max_window_layers": 1}),
    "qwen3": (Dims(hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128, vocab=VOCAB, head_dim=32), {}),
    "mistral": (Dims(hidden=64, layers=2, heads=4, kv_heads=4, intermediate=128, vocab=VOCAB),
                {"sliding_window": 12}),
    "qwen3_5": (Dims(hidden=64, layers=4, heads=4, kv_heads=2, intermediate=128, vocab=VOCAB, head_dim=32), {}),
}
FAMILIES = list(CASES)
SHARING = FAMILIES
"""Families whose training shares prompts (Qwen3.5's Gated DeltaNet layers take the prompt's
conv and recurrent states)."""
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BF16_LOGPROBS = 3e-2
"""bf16 bound against the HF forward (a bf16 logit moves by ~4e-3 of itself; measured <= 8e-3)."""


def _config(name: str, **extra):
    dims, overrides = CASES[name]
    return family_config(name, dims, **{**overrides, **extra})


def _model(name: str, dtype: str = "fp32", seed: int = 0, **extra):
    return build_model(_config(name, **extra), seed=seed, dtype=DTYPES[dtype])


def test_configs_carry_their_family_differences():
    qwen2, qwen3, mistral = _model("qwen2"), _model("qwen3"), _model("mistral")
    assert qwen2.model.layers[0].self_attn.q_proj.bias is not None
    assert qwen2.config.layer_types == ["full_attention", "sliding_attention"]
    assert qwen3.lm_head.weight is qwen3.model.embed_tokens.weight and qwen3.model.layers[0].self_attn.head_dim == 32
    assert mistral.config.sliding_window == 12
    assert _model("llama3").config.rope_parameters["rope_type"] == "llama3"
    qwen3_5 = _model("qwen3_5")
    assert qwen3_5.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert qwen3_5.model.layers[3].self_attn.q_proj.out_features == 2 * 4 * 32  # each head's query and gate
    assert qwen3_5.config.rope_parameters["partial_rotary_factor"] == 0.25


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_and_logprobs_match_hf(name, dtype):
    """Left-padded prompts of 1-20 tokens and 16 new ones (past every window), then the same
    prompts with their completions and two more tokens (the stored keys and values are reused)."""
    model = _model(name, dtype)
    assert LeanDecoder.why_not(model) is None
    equal, worst = against_hf(model)
    assert equal
    assert worst <= (1e-5 if dtype == "fp32" else BF16_LOGPROBS), worst
    sampler = Sampler(model, PAD, [])
    first = prompts(VOCAB)
    done = sampler.sample(first, 8, temperature=0.0)
    assert sampler.decode_path == "lean"
    longer = [p + list(s.tokens) + [7, 9] for p, s in zip(first, done)]
    assert sampler._store is not None and all(sampler._store.lookup(tuple(p)) for p in longer)
    again = sampler.sample(longer, 8, temperature=0.0)
    assert [list(s.tokens) for s in again] == hf_greedy(model, longer, 8)


def test_qwen3_5_decoding_leaves_the_stored_prompt_states_as_prefilled():
    """A decode step updates each row's recurrent state in place: the `PromptStore` a later,
    longer prompt starts from must keep the states at the prompts' ends, not the decoded ones."""
    model = _model("qwen3_5")
    rows = prompts(VOCAB)
    decoded = Sampler(model, PAD, [])
    decoded.sample(rows, 8, temperature=0.0)
    prefilled = Sampler(model, PAD, [])
    prefilled.sample(rows, 1, temperature=0.0)  # one token: no decode step runs
    for name in ("conv", "rec"):
        for a, b in zip(decoded._store.states[name], prefilled._store.states[name], strict=True):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("name", FAMILIES)
def test_a_shared_system_prompt_is_prefilled_once(name):
    """Prompts sharing 18 tokens: the start runs once and is copied into each row's cache."""
    model = _model(name)
    g = torch.Generator().manual_seed(4)
    system = torch.randint(5, VOCAB, (18,), generator=g).tolist()
    rows = [system + torch.randint(5, VOCAB, (n,), generator=g).tolist() for n in (1, 4, 6)]
    sampler = Sampler(model, PAD, [])
    samples = sampler.sample(rows, 10, temperature=0.0)
    assert sampler.decode_path == "lean"
    assert [list(s.tokens) for s in samples] == hf_greedy(model, rows, 10)
    for p, s in zip(rows, samples):
        assert (forward_logprobs(model, p, s.tokens) - torch.tensor(s.logprobs)).abs().max() <= 2e-5


@pytest.mark.parametrize("extra", [{"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
                                   {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4,
                                                        "original_max_position_embeddings": 32}}],
                         ids=["linear", "yarn"])
def test_other_static_rope_scalings(extra):
    model = build_model(family_config("llama", CASES["llama3"][0], **extra))
    assert LeanDecoder.why_not(model) is None
    equal, worst = against_hf(model)
    assert equal and worst <= 1e-5, worst


@pytest.mark.parametrize("name", ["qwen3", "mistral"])
def test_an_unmergeable_adapter_steps_through_the_modules(name):
    """DoRA cannot be merged into the fused weights: the step runs the model's own sub-modules,
    with the family's q/k norms and window."""
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(_model(name), LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                                   use_dora=True, lora_dropout=0.0))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for n, p in peft.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    peft.eval()
    assert LeanDecoder.why_not(peft) is None and LeanDecoder(peft).fused is None
    equal, worst = against_hf(peft)
    assert equal and worst <= 1e-5, worst


def test_an_unmergeable_adapter_on_qwen3_5_falls_back_loudly(recwarn):
    """The module step has no Gated DeltaNet layer: DoRA on Qwen3.5 decodes through the HF
    forward, with one warning naming why and `decode_path` saying so, and equals `generate`."""
    from peft import LoraConfig, get_peft_model

    from tinker_pipelines.rollout.lean_decoder import unwrap_causal_lm

    peft = get_peft_model(_model("qwen3_5"), LoraConfig(r=4, target_modules=["q_proj", "in_proj_qkv"],
                                                        use_dora=True, lora_dropout=0.0)).eval()
    reason = LeanDecoder.why_not(peft)
    assert reason is not None and "hybrid" in reason
    sampler = Sampler(peft, PAD, [])
    rows = prompts(VOCAB)
    for _ in range(2):
        samples = sampler.sample(rows, 6, temperature=0.0)
    assert sampler.decode_path == f"hf: {reason}"
    warned = [w for w in recwarn if "off the fast path" in str(w.message)]
    assert len(warned) == 1 and reason in str(warned[0].message)
    assert [list(s.tokens) for s in samples] == hf_greedy(unwrap_causal_lm(peft), rows, 6) or \
        [list(s.tokens) for s in samples] == hf_greedy(peft, rows, 6)


def test_what_the_decoder_cannot_run_is_refused_with_its_reason():
    dims = CASES["llama3"][0]
    dynamic = build_model(family_config("llama", dims, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                        "rope_theta": 1e4}))
    assert "dynamic" in LeanDecoder.why_not(dynamic) and not supports_prefix_sharing(dynamic)
    eager = _model("qwen3")
    eager.config._attn_implementation = "eager"
    assert "'eager'" in LeanDecoder.why_not(eager)
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64)).eval()
    assert "GPT2LMHeadModel" in LeanDecoder.why_not(gpt2) and not supports_prefix_sharing(gpt2)
    training = _model("mistral").train()
    assert "training" in LeanDecoder.why_not(training)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", FAMILIES)
def test_mixed_adapter_rows_equal_each_adapter_alone(name, dtype):
    """4 adapters of ranks 4-16 on every linear and the output layer (Tinker's train_unembed)."""
    peft = add_adapters(_model(name, dtype))
    sampler, mixed, alone = mixed_and_solo(peft, 4)
    assert sampler.supports_mixed_adapters()
    for m, a in zip(mixed, alone):
        assert [(s.tokens, s.logprobs) for s in m] == [(s.tokens, s.logprobs) for s in a]
    if dtype == "fp32":  # and they are each adapter's own function
        rows = prompts(VOCAB, lengths=(5, 9, 17, 4))
        peft.set_adapter("a3")
        for p, s in zip(rows[1:], mixed[3]):
            assert (forward_logprobs(peft, p, s.tokens) - torch.tensor(s.logprobs)).abs().max() <= 1e-5


def _lora_grads(learner) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None}


def _randomize_b(learner, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # a fresh B is zero: A would get no gradient to compare
        for n, p in learner.model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g).to(p.dtype) * 0.05)


def _tinker_step(name: str, dtype: str, share: bool, datums, loss, checkpointing: bool = False):
    learner = tinker_learner(_model(name, dtype), share_prefix=share, rank=4)
    learner.cfg = dataclasses.replace(learner.cfg, gradient_checkpointing=checkpointing)
    _randomize_b(learner)
    lp, metrics = learner.tinker_forward_backward(datums, loss)
    assert supports_prefix_sharing(learner.model) == (name in SHARING)
    grads = {n: g.float() for n, g in _lora_grads(learner).items()}
    return torch.tensor([x for row in lp for x in row]), metrics["loss:sum"], grads


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("name", SHARING)
def test_prefix_shared_tinker_step_equals_the_plain_one(name, dtype, monkeypatch):
    """Tinker's forward_backward (every position's logprob returned) over groups sharing a
    20-token prompt, prompt shared vs not: loss, every logprob and every LoRA gradient (on the
    output layer too). In fp32 they agree to 1e-5; in bf16 each of the two is as far from the
    fp32 step as the other (bf16 rounds activations: ~3e-2 of a gradient's scale, measured)."""
    import tinker_pipelines.training.learner as learner_module

    calls = []
    shared = learner_module.shared_prefix_forward
    monkeypatch.setattr(learner_module, "shared_prefix_forward", lambda *a, **k: calls.append(1) or shared(*a, **k))
    datums, loss = tinker_datums(VOCAB, groups=2, per_group=3, prompt_len=20)
    lp, loss_sum, grads = _tinker_step(name, dtype, True, datums, loss)
    assert calls
    calls.clear()
    lp0, loss0, grads0 = _tinker_step(name, dtype, False, datums, loss)
    assert not calls
    assert grads.keys() == grads0.keys() and any("lm_head" in n for n in grads) and any("k_proj" in n for n in grads)
    if dtype == "fp32":
        _assert_fp32_equal(lp, loss_sum, grads, lp0, loss0, grads0)
        return
    lp_ref, loss_ref, grads_ref = _tinker_step(name, "fp32", False, datums, loss)
    assert abs(loss_sum - loss_ref) <= 1.5 * abs(loss0 - loss_ref) + 1e-3 * abs(loss_ref)
    assert (lp - lp_ref).abs().max() <= 1.5 * (lp0 - lp_ref).abs().max() + 1e-3
    for n, ref in grads_ref.items():
        scale = ref.abs().max().item()
        err, err0 = (grads[n] - ref).abs().max().item(), (grads0[n] - ref).abs().max().item()
        assert err <= 1.5 * err0 + 1e-2 * scale, (n, err, err0, scale)


DECAY = ("in_proj_a", "A_log", "dt_bias")
"""A Gated DeltaNet layer's decay path: its gradient sums terms that nearly cancel, and
transformers' chunked form (fp32 whatever the model's dtype) rounds them by chunk: with the
chunk rule run in fp64, shared and plain agree to 2e-7 of each gradient, yet in fp32 the plain
step itself is 1.7e-2 of that gradient from the fp64 one (shared: 6e-3), measured on these configs."""


def _assert_fp32_equal(lp, loss_sum, grads, lp0, loss0, grads0):
    """fp32 agreement: loss to 1e-5 of itself, logprobs to 1e-5, each gradient to 1e-5 of its own
    scale; a DeltaNet decay gradient (`DECAY`) to 1e-5 of the largest gradient of any parameter."""
    assert abs(loss_sum - loss0) <= 1e-5 * abs(loss0)
    assert (lp - lp0).abs().max() <= 1e-5
    top = max(g.abs().max().item() for g in grads0.values())
    for n, g0 in grads0.items():
        scale = top if any(d in n for d in DECAY) else g0.abs().max().item()
        assert g0.abs().max().item() > 0 and (grads[n] - g0).abs().max().item() <= 1e-5 * scale, n


def test_qwen3_5_prompts_of_two_lengths_share_their_states_under_checkpointing(monkeypatch):
    """Two groups whose prompts differ in length (20 and 13 tokens) run one prefix pass per
    length (a padding column would move a DeltaNet state), each row continues from its own run's
    conv and recurrent states, and activation checkpointing replays those layers over the same
    states: the step equals the plain one, and the DeltaNet linears and the output layer train."""
    import tinker_pipelines.training.learner as learner_module
    import tinker_pipelines.training.prefix_sharing as sharing

    passes = []
    hybrid = sharing._hybrid_prefix_pass
    monkeypatch.setattr(sharing, "_hybrid_prefix_pass", lambda *a: passes.append(a[3].tolist()) or hybrid(*a))
    long, loss = tinker_datums(VOCAB, groups=1, per_group=3, prompt_len=20)
    short, _ = tinker_datums(VOCAB, groups=1, per_group=2, prompt_len=13, seed=1)
    datums = long + short
    lp, loss_sum, grads = _tinker_step("qwen3_5", "fp32", True, datums, loss, checkpointing=True)
    assert passes == [[19, 12]]  # both runs shared, each up to its first weighted position
    lp0, loss0, grads0 = _tinker_step("qwen3_5", "fp32", False, datums, loss)
    assert any("in_proj_qkv" in n for n in grads) and any("lm_head" in n for n in grads)
    assert grads.keys() == grads0.keys()
    _assert_fp32_equal(lp, loss_sum, grads, lp0, loss0, grads0)
    assert learner_module.supports_prefix_sharing(_model("qwen3_5"))


@pytest.mark.parametrize("name", FAMILIES)
def test_experiments_train_together_as_alone(name):
    """The worker's cross-experiment training pass: two adapters' rows in shared base passes
    (each run of a shared prompt planned per experiment) give each its solo gradients."""
    from tinker_pipelines.algorithms.tinker_losses import TinkerLossFn
    from tinker_pipelines.algorithms import LossConfig
    from tinker_pipelines.training.learner import Learner, LearnerConfig
    from tinker_pipelines.worker.batching import FBJob, forward_backward_together

    base = _model(name)
    learners = []
    for i in range(2):
        cfg = LearnerConfig(mode="lora", lora_rank=4 + 4 * i, lora_targets=tuple(targets_for(base.config)))
        learners.append(Learner(base, cfg, PAD, adapter_name=f"e{i}", init_seed=10 + i))
        base = learners[-1].model
    _randomize_b(learners[0])
    data = [tinker_datums(VOCAB, groups=2, per_group=3, prompt_len=20, seed=s) for s in (1, 2)]
    alone = []
    for lr, (datums, loss) in zip(learners, data):
        lr.activate()
        lr.tinker_forward_backward(datums, loss)
        alone.append([p.grad.clone() for p in lr.params])
        for p in lr.params:
            p.grad = None
    jobs = forward_backward_together([FBJob(lr, d, TinkerLossFn(loss), LossConfig()) for lr, (d, loss)
                                      in zip(learners, data)], max_rows=12)
    for job, grads in zip(jobs, alone):
        assert job.error is None
        for p, g in zip(job.learner.params, grads):
            torch.testing.assert_close(p.grad, g, atol=1e-6, rtol=1e-4)


# ---- a Tinker service round trip on a saved model directory of each family ----

KEY = "tml-arch-key"


def _write_dir(name: str, out) -> str:
    from tinker_pipelines.models.tiny import build_tokenizer

    tok = build_tokenizer()
    assert len(tok) == VOCAB
    model = _model(name)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    """A service per family (a worker process on its directory), started when a test first asks
    for it: a `-k` selection of one family starts one worker."""
    from tinker_pipelines.serving.tinker.launch import start_service

    os.environ.setdefault("TINKER_TELEMETRY", "0")
    handles = {}

    def start(name: str):
        if name not in handles:
            path = _write_dir(name, tmp_path_factory.mktemp(name))
            handles[name] = (path, start_service(path, home=tmp_path_factory.mktemp(f"svc-{name}"), api_key=KEY,
                                                 device="cpu", dtype="float32", gap_timeout_s=3.0,
                                                 worker_args=["--threads", "1"]))
        return handles[name]

    try:
        yield start
    finally:
        for _, handle in handles.values():
            handle.stop()


def _tinker_group_datums(seed: int):
    from tinker import types

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(2):
        prompt = rng.integers(5, VOCAB, 16).tolist()
        for _ in range(3):
            tokens = prompt + rng.integers(5, VOCAB, int(rng.integers(2, 5))).tolist()
            n = len(tokens) - 1
            out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
                "target_tokens": types.TensorData.from_numpy(np.asarray(tokens[1:], np.int64)),
                "logprobs": types.TensorData.from_numpy(np.asarray([0.0] * 15 + [-1.0] * (n - 15), np.float32)),
                "advantages": types.TensorData.from_numpy(
                    np.asarray([0.0] * 15 + [float(rng.choice([-0.5, 1.0]))] * (n - 15), np.float32))}))
    return out


@pytest.mark.e2e
@pytest.mark.parametrize("name", FAMILIES)
def test_tinker_round_trip(services, name):
    """create, forward_backward over shared prompts (equal to the in-process learner bit for bit,
    every position's logprob), optim_step, sample (equal to the in-process sampler of the same
    weights)."""
    import tinker
    from tinker import types

    from tinker_pipelines.algorithms.tinker_losses import datum_from_tinker, tinker_loss
    from tinker_pipelines.models import load_model, stop_token_ids
    from tinker_pipelines.serving.tinker.runtime import LoraShape
    from tinker_pipelines.training.learner import Learner, LearnerConfig

    path, handle = services(name)
    client = tinker.ServiceClient(base_url=handle.url, api_key=KEY)
    try:
        tc = client.create_lora_training_client(path, rank=4, seed=2).result()
        model, tok = load_model(path, dtype="float32")
        assert LeanDecoder.why_not(model) is None
        cfg = {k: tuple(v) if isinstance(v, list) else v for k, v in LoraShape(4, 2).learner().items()}
        assert "lm_head" in cfg["lora_targets"]
        local = Learner(model, LearnerConfig(**cfg), tok.pad_token_id, base_name=path, adapter_name="local",
                        init_seed=2)
        loss, adam = tinker_loss("importance_sampling"), types.AdamParams(learning_rate=1e-2)
        data = _tinker_group_datums(0)
        fb = tc.forward_backward(data, "importance_sampling").result()
        tc.optim_step(adam).result()
        mine = [datum_from_tinker(d.model_input.to_ints(), {k: v.to_torch() for k, v in d.loss_fn_inputs.items()},
                                  loss=loss) for d in data]
        lp, metrics = local.tinker_forward_backward(mine, loss)
        local.optim_step(adam.model_dump())
        assert fb.metrics["loss:sum"] == metrics["loss:sum"]
        assert [o["logprobs"].to_torch().tolist() for o in fb.loss_fn_outputs] == lp
        sc = tc.save_weights_and_get_sampling_client().result()
        prompt = [5, 9, 13, 21, 34, 55]
        got = sc.sample(types.ModelInput.from_ints(prompt), num_samples=2,
                        sampling_params=types.SamplingParams(max_tokens=8, temperature=1.0, seed=7)).result()
        want = Sampler(local.model, tok.pad_token_id, stop_token_ids(tok)).sample(
            [prompt] * 2, 8, 1.0, torch.Generator().manual_seed(7))
        assert [s.tokens for s in got.sequences] == [list(s.tokens) for s in want]
        for s, w in zip(got.sequences, want):
            assert s.logprobs == pytest.approx(list(w.logprobs), abs=1e-5)
    finally:
        client.close("success").result()


def test_the_benchmark_reports_every_figure(capsys):
    """`python -m benchmarks.architectures` on a one-layer Qwen3: every figure, the flags true,
    and the torch thread count it changes given back."""
    from benchmarks.architectures import main

    threads = torch.get_num_threads()

    result = main(["--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--intermediate", "64",
                   "--vocab", "128", "--families", "qwen3", "--reps", "1"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    q = result["qwen3"]
    assert q["greedy_equal"] and q["mixed_equal_solo"] and q["fast_path"] and q["logprobs_max_diff"] <= 1e-5
    assert q["speed_vs_llama"] > 0 and q["tinker_step_vs_llama"] > 0 and "greedy_equal_bf16" in q
    assert torch.get_num_threads() == threads


def test_qwen3_5_shared_forward_gives_values_as_the_plain_forward():
    """A value head (PPO) reads the continuation's last hidden states: over a shared prompt's
    DeltaNet states they equal the plain forward's at every continuation position (1e-5), and
    the prompt's own positions read 0, as for the attention families."""
    from tinker_pipelines.training.prefix_sharing import plan_prefix_sharing, shared_prefix_forward

    model = _model("qwen3_5")
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(5, VOCAB, (20,), generator=g)
    rows = [torch.cat([prompt, torch.randint(5, VOCAB, (n,), generator=g)]) for n in (9, 12, 5)]
    B, T = len(rows), max(len(r) for r in rows)
    inputs_BT, mask_BT = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.long)
    targets_BT, weights_BT = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T)
    for i, r in enumerate(rows):
        inputs_BT[i, :len(r)], mask_BT[i, :len(r)] = r, 1
        targets_BT[i, :len(r) - 1], weights_BT[i, 19:len(r) - 1] = r[1:], 1.0
    plan = plan_prefix_sharing(inputs_BT, mask_BT, weights_BT)
    assert plan is not None
    head = torch.nn.Linear(64, 1)
    with torch.no_grad():
        _, values_BT = shared_prefix_forward(model, plan, inputs_BT, targets_BT, weights_BT, 1.0,
                                             value_head=lambda h: head(h)[..., 0])
        plain_BT = head(model(input_ids=inputs_BT, attention_mask=mask_BT, output_hidden_states=True)
                        .hidden_states[-1])[..., 0]
    cont_BT = torch.arange(T)[None, :] >= plan.prefix_len_B[:, None]
    cont_BT &= mask_BT.bool()
    assert (values_BT - plain_BT)[cont_BT].abs().max() <= 1e-5
    assert values_BT[~cont_BT].abs().max() == 0
