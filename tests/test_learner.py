"""Learner, sampler and checkpoint behaviour on the tiny model."""

import copy

import pytest
import torch
from peft import PeftModel

from tinker_pipelines.algorithms import LossConfig, get_algorithm
from tinker_pipelines.loops.datums import rl_datums, sft_datum
from tinker_pipelines.envs import EnvSpec
from tinker_pipelines.training.learner import Learner, LearnerConfig
from tinker_pipelines.models import stop_token_ids
from tinker_pipelines.rollout.episodes import RolloutConfig, run_groups
from tinker_pipelines.rollout.sampler import Sampler

GRPO = get_algorithm("grpo")


def _rollout(model, tok, env="arithmetic", seeds=(1, 2, 3, 4), G=4, seed=0, **cfg):
    sampler = Sampler(model, tok.pad_token_id, stop_token_ids(tok))
    gen = torch.Generator().manual_seed(seed)
    return run_groups(sampler, tok, EnvSpec(env), list(seeds), G, RolloutConfig(**cfg), gen)


def _informative_datums(model, tok, **kw):
    # a random model rarely answers right: give it credit for any reply length so groups differ
    groups = _rollout(model, tok, **kw)
    from tinker_pipelines.types import TrajectoryGroup, Trajectory

    shaped = [TrajectoryGroup(tuple(Trajectory(t.turns, float(len(t.turns[-1].sampled_tokens)), t.task_id)
                                    for t in g.trajectories)) for g in groups]
    datums = rl_datums(shaped, "group_normalized")
    assert datums, "rollouts gave no informative group"
    return datums


def test_lora_gradients_reach_only_adapter_parameters(tiny):
    model, tok = tiny
    learner = Learner(model, LearnerConfig(mode="lora", learning_rate=1e-2), tok.pad_token_id)
    base_before = {n: p.detach().clone() for n, p in learner.model.named_parameters() if "lora_" not in n}
    datums = _informative_datums(learner.model, tok)
    learner.forward_backward(datums, GRPO.loss)
    with_grad = {n for n, p in learner.model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
    assert with_grad and all("lora_" in n for n in with_grad)
    assert any("lora_B" in n for n in with_grad)  # B starts at zero, so A gets no gradient yet
    learner.optim_step()
    for n, p in learner.model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, base_before[n]), n


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_parameters_change_after_a_step(tiny, mode):
    model, tok = tiny
    learner = Learner(model, LearnerConfig(mode=mode, learning_rate=1e-2), tok.pad_token_id)
    before = [p.detach().clone() for p in learner.params]
    datums = _informative_datums(learner.model, tok)
    for _ in range(2):  # LoRA's B starts at zero, so A moves from the second step on
        learner.forward_backward(datums, GRPO.loss)
        learner.optim_step()
    changed = sum(not torch.equal(a, b) for a, b in zip(before, learner.params))
    assert changed == len(before)


@pytest.mark.parametrize("env,turns", [("arithmetic", 1), ("guess_number", 4)])
def test_sampler_logprobs_match_learner(tiny, env, turns):
    model, tok = tiny
    learner = Learner(model, LearnerConfig(mode="lora"), tok.pad_token_id)
    groups = _rollout(learner.model, tok, env=env, max_turns=turns, max_new_tokens=8)
    datums = rl_datums(groups, "group_normalized", skip_uniform=False)
    recomputed = learner.compute_logprobs(datums)
    worst = 0.0
    for d, lp in zip(datums, recomputed):
        for w, b, r in zip(d.weights, d.behaviour_logprobs, lp):
            if w:
                worst = max(worst, abs(b - r))
    assert worst < 1e-4


def test_env_tokens_carry_no_loss(tiny):
    model, tok = tiny
    groups = _rollout(model, tok, env="guess_number", max_turns=4, max_new_tokens=4)
    multi = [t for g in groups for t in g.trajectories if len(t.turns) > 1]
    assert multi, "expected multi-turn episodes"
    traj = multi[0]
    from tinker_pipelines.loops.datums import trajectory_to_datum

    d = trajectory_to_datum(traj, 1.0)
    assert sum(d.weights) == traj.num_sampled_tokens
    # the env's reply ("Higher."/"Lower.") lies between turns and has weight 0
    t0, t1 = traj.turns[0], traj.turns[1]
    env_start = len(t0.prompt_tokens) + len(t0.sampled_tokens)
    env_span = range(env_start - 1, len(t1.prompt_tokens) - 1)
    assert len(env_span) > 0 and all(d.weights[i] == 0 for i in env_span)
    assert "er." in tok.decode(t1.prompt_tokens[env_start:])
    # each turn's context extends the previous turn's context plus its sample, token for token
    assert t1.prompt_tokens[: env_start] == t0.prompt_tokens + t0.sampled_tokens


def test_lora_reference_is_the_adapter_disabled_base(tiny):
    model, tok = tiny
    base_copy = copy.deepcopy(model)
    learner = Learner(model, LearnerConfig(mode="lora", learning_rate=5e-2, needs_reference=True), tok.pad_token_id)
    datums = _informative_datums(learner.model, tok)
    learner.forward_backward(datums, GRPO.loss, LossConfig(kl_coef=0.1))
    learner.optim_step()
    from tinker_pipelines.training.learner import pad_datums

    padded = pad_datums(datums, tok.pad_token_id)
    ref = learner.reference_logprobs(padded)
    expected = Learner(base_copy, LearnerConfig(mode="full"), tok.pad_token_id)._logprobs(base_copy, padded)
    assert torch.allclose(ref, expected.detach(), atol=1e-5)
    assert learner.reference is None  # no second copy of the model under LoRA


def test_sft_learns_a_fixed_reply(tiny):
    model, tok = tiny
    learner = Learner(model, LearnerConfig(mode="full", learning_rate=3e-3), tok.pad_token_id)
    datum = sft_datum(tok, [{"role": "user", "content": "2 + 2 = ?"}], "4")
    losses = []
    for _ in range(30):
        losses.append(learner.forward_backward([datum], get_algorithm("sft").loss)["loss"])
        learner.optim_step()
    assert losses[-1] < 0.1 * losses[0]


def test_save_load_next_step_identical(tiny, tmp_path):
    model, tok = tiny
    model_b = copy.deepcopy(model)
    cfg = LearnerConfig(mode="lora", learning_rate=1e-2)
    a = Learner(model, cfg, tok.pad_token_id, base_name="tiny")
    datums = _informative_datums(a.model, tok)
    a.forward_backward(datums, GRPO.loss)
    a.optim_step()
    a.save_state(tmp_path / "ck", {"iteration": 1})
    b = Learner(model_b, cfg, tok.pad_token_id, base_name="tiny")
    record = b.load_state(tmp_path / "ck")
    assert record["iteration"] == 1 and record["content_hash"]
    ma = a.forward_backward(datums, GRPO.loss)
    a.optim_step()
    mb = b.forward_backward(datums, GRPO.loss)
    b.optim_step()
    assert ma == mb
    for pa, pb in zip(a.params, b.params):
        assert torch.equal(pa, pb)


def test_lora_checkpoint_loads_with_peft(tiny, tmp_path):
    model, tok = tiny
    pristine = copy.deepcopy(model)
    learner = Learner(model, LearnerConfig(mode="lora", learning_rate=5e-2), tok.pad_token_id)
    learner.forward_backward(_informative_datums(learner.model, tok), GRPO.loss)
    learner.optim_step()
    learner.save_state(tmp_path / "ck")
    loaded = PeftModel.from_pretrained(pristine, str(tmp_path / "ck")).eval()
    x = torch.tensor([[1, 5, 9, 12]])
    with torch.no_grad():
        assert torch.allclose(loaded(x).logits, learner.model(x).logits, atol=1e-6)


def test_corrupt_checkpoint_is_refused(tiny, tmp_path):
    model, tok = tiny
    learner = Learner(model, LearnerConfig(mode="lora"), tok.pad_token_id)
    learner.save_state(tmp_path / "ck")
    f = tmp_path / "ck" / "adapter_model.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="corrupt"):
        learner.load_state(tmp_path / "ck")


def test_two_adapters_share_one_base(tiny, tmp_path):
    model, tok = tiny
    pristine = copy.deepcopy(model)
    cfg = LearnerConfig(mode="lora", learning_rate=5e-2, needs_reference=True)
    a = Learner(model, cfg, tok.pad_token_id, adapter_name="agent_a")
    b = Learner(a.model, cfg, tok.pad_token_id, adapter_name="agent_b")
    assert a.model is b.model and not set(map(id, a.params)) & set(map(id, b.params))
    datums = _informative_datums(a.model, tok)
    b_before = [p.detach().clone() for p in b.params]
    for _ in range(2):
        a.forward_backward(datums, GRPO.loss)
        a.optim_step()
    assert all(torch.equal(x, y) for x, y in zip(b_before, b.params))  # training A leaves B alone
    assert a.compute_logprobs(datums) != b.compute_logprobs(datums)
    a.save_state(tmp_path / "a")
    loaded = PeftModel.from_pretrained(pristine, str(tmp_path / "a")).eval()
    x = torch.tensor([[1, 5, 9, 12]])
    a.activate()
    with torch.no_grad():
        assert torch.allclose(loaded(x).logits, a.model(x).logits, atol=1e-6)


def test_non_finite_loss_drops_the_gradient_already_accumulated(tiny):
    """A failed forward_backward must not leave its earlier micro-batches' gradient behind for the
    next optim_step to apply."""
    import math

    import pytest
    import torch

    from tinker_pipelines.training.learner import Learner, LearnerConfig
    from tinker_pipelines.types import Datum

    model, tok = tiny
    learner = Learner(model, LearnerConfig(mode="lora", micro_batch_size=1), tok.pad_token_id)
    datums = [Datum(input_tokens=(5, 6, 7, 8), target_tokens=(6, 7, 8, 9), weights=(0.0, 1.0, 1.0, 1.0))
              for _ in range(3)]
    calls = []

    def loss_fn(lp_BT, batch, cfg):
        calls.append(1)
        loss = -(lp_BT * batch.weights_BT).sum()
        return (loss * math.nan if len(calls) == 3 else loss), {}

    with pytest.raises(FloatingPointError, match="non-finite loss"):
        learner.forward_backward(datums, loss_fn)
    assert all(p.grad is None or not torch.any(p.grad) for p in learner.params)


def _sft_grad(model, tok, datums, micro_batch_size):
    learner = Learner(copy.deepcopy(model), LearnerConfig(mode="full", micro_batch_size=micro_batch_size),
                      tok.pad_token_id)
    learner.forward_backward(datums, get_algorithm("sft").loss)
    return torch.cat([p.grad.flatten() for p in learner.params])


def test_sft_gradient_is_a_token_mean_whatever_the_micro_batch_size(tiny):
    """SFT is a mean over every trained token of the batch: a one-token reply weighs one token,
    not as much as a reply of forty, however the batch is split into micro-batches."""
    model, tok = tiny
    replies = ["4", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20", "yes", "the answer is 12 plus 7"]
    datums = [sft_datum(tok, [{"role": "user", "content": f"question {i}"}], r) for i, r in enumerate(replies)]
    lengths = [sum(d.weights) for d in datums]
    assert max(lengths) > 10 * min(lengths)
    # by hand: summed token logprobs of each datum over the batch's total token count
    hand = copy.deepcopy(model)
    nll = 0.0
    for d in datums:
        logits_T = hand(input_ids=torch.tensor([d.input_tokens])).logits[0]
        lp_T = torch.log_softmax(logits_T.float(), -1).gather(-1, torch.tensor(d.target_tokens)[:, None])[:, 0]
        nll = nll - (lp_T * torch.tensor(d.weights)).sum()
    (nll / sum(lengths)).backward()
    expected = torch.cat([p.grad.flatten() for p in hand.parameters()])
    for mb in (1, 2, len(datums)):
        got = _sft_grad(model, tok, datums, mb)
        assert ((got - expected).norm() / expected.norm()).item() < 1e-6, mb  # fp32 rounding only


def _untied(model):
    from transformers import LlamaForCausalLM

    config = copy.deepcopy(model.config)
    config.tie_word_embeddings = False
    torch.manual_seed(0)
    untied = LlamaForCausalLM(config).eval()
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    return untied


def test_missing_untied_output_layer_is_an_error(tiny, tmp_path):
    """Only a tied output layer may be absent from a full checkpoint: an untied one missing would
    leave the loaded model with whatever output layer it had."""
    from safetensors.torch import load_file, save_file

    from tinker_pipelines import checkpoint as ckpt

    model, tok = tiny
    untied = _untied(model)
    learner = Learner(untied, LearnerConfig(mode="full"), tok.pad_token_id)
    record = learner.save_state(tmp_path / "ck")
    weights = tmp_path / "ck" / "model.safetensors"
    state = load_file(str(weights))
    del state["lm_head.weight"]
    save_file(state, str(weights), metadata={"format": "pt"})
    # re-hash, so the missing tensor, not a changed file, is what loading finds
    ckpt.write_record(tmp_path / "ck", {k: v for k, v in record.items() if k not in ("content_hash", "files")})
    fresh = Learner(_untied(model), LearnerConfig(mode="full"), tok.pad_token_id)
    with pytest.raises(ckpt.CheckpointError, match=r"no tensor 'lm_head\.weight' in model\.safetensors"):
        fresh.load_state(tmp_path / "ck")
    assert learner.verify_checkpoint(tmp_path / "ck", [1, 2, 3])["missing"] == ["lm_head.weight"]
    # a tied model's checkpoint leaves lm_head.weight out and loads
    tied = Learner(model, LearnerConfig(mode="full"), tok.pad_token_id)
    tied.save_state(tmp_path / "tied")
    assert "lm_head.weight" not in load_file(str(tmp_path / "tied" / "model.safetensors"))
    Learner(copy.deepcopy(model), LearnerConfig(mode="full"), tok.pad_token_id).load_state(tmp_path / "tied")
    assert tied.verify_checkpoint(tmp_path / "tied", [1, 2, 3])["missing"] == []


def test_untied_checkpoint_into_a_tied_model_is_an_error(tiny, tmp_path):
    """A tied model holds one tensor for both names: loading an untied model's two different
    ones would keep whichever loads last, a policy that was never trained."""
    from tinker_pipelines import checkpoint as ckpt

    model, tok = tiny
    untied = Learner(_untied(model), LearnerConfig(mode="full"), tok.pad_token_id)
    untied.save_state(tmp_path / "untied")
    tied = Learner(copy.deepcopy(model), LearnerConfig(mode="full"), tok.pad_token_id)
    before = {k: v.clone() for k, v in tied.model.state_dict().items()}
    with pytest.raises(ckpt.CheckpointError, match=r"'lm_head\.weight' different from 'model\.embed_tokens\.weight'.*ties"):
        tied.load_state(tmp_path / "untied")
    assert all(torch.equal(before[k], v) for k, v in tied.model.state_dict().items())  # nothing changed
