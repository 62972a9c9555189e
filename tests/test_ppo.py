"""PPO with a learned value head: GAE, the value head in the learner, and the loop end to end."""

import copy
import math
from dataclasses import replace

import pytest
import torch
from peft import PeftModel

from tinker_pipelines.algorithms import LossConfig, get_algorithm
from tinker_pipelines.algorithms.gae import gae, gae_over_weighted
from tinker_pipelines.config import ConfigError, config_from_dict
from tinker_pipelines.loops.datums import CriticDatum, critic_datums, trajectory_to_datum, with_reference_logprobs
from tinker_pipelines.envs import EnvSpec
from tinker_pipelines.training.learner import Learner, LearnerConfig
from tinker_pipelines.training.learner_checkpoint import VALUE_HEAD_FILE
from tinker_pipelines.models import stop_token_ids
from tinker_pipelines.rollout.episodes import RolloutConfig, run_groups
from tinker_pipelines.rollout.sampler import Sampler
from tinker_pipelines.loops.train import Experiment, deterministic_metrics, train
from tinker_pipelines.types import Trajectory, TrajectoryGroup

PPO = get_algorithm("ppo")
LOSS_CFG = LossConfig(vf_coef=0.5)


def _reference_gae(rewards, values, gamma, lam):
    """Textbook GAE, written out: delta_t, then the discounted sum of future deltas."""
    N = len(rewards)
    deltas = [rewards[t] + gamma * (values[t + 1] if t + 1 < N else 0.0) - values[t] for t in range(N)]
    adv = [sum((gamma * lam) ** (k - t) * deltas[k] for k in range(t, N)) for t in range(N)]
    return adv, [a + v for a, v in zip(adv, values)]


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.95), (0.9, 0.5), (0.99, 0.0)])
def test_gae_matches_a_hand_written_loop(gamma, lam):
    g = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(7, generator=g, dtype=torch.float64), torch.randn(7, generator=g, dtype=torch.float64)
    adv, ret = gae(rewards, values, gamma, lam)
    ref_adv, ref_ret = _reference_gae(rewards.tolist(), values.tolist(), gamma, lam)
    assert adv.tolist() == pytest.approx(ref_adv, abs=1e-12)
    assert ret.tolist() == pytest.approx(ref_ret, abs=1e-12)


def test_gae_skips_prompt_and_env_positions():
    weights = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    rewards = torch.tensor([5.0, 5.0, 0.0, 0.3, 5.0, 5.0, 1.0, 5.0])
    values = torch.tensor([7.0, 7.0, 0.1, 0.2, 7.0, 7.0, 0.4, 7.0])
    adv, ret = gae_over_weighted(rewards, values, weights, 0.9, 0.8)
    ref_adv, ref_ret = _reference_gae([0.0, 0.3, 1.0], [0.1, 0.2, 0.4], 0.9, 0.8)
    assert adv[[2, 3, 6]].tolist() == pytest.approx(ref_adv) and ret[[2, 3, 6]].tolist() == pytest.approx(ref_ret)
    assert adv[weights == 0].abs().sum() == 0 and ret[weights == 0].abs().sum() == 0


def _groups(model, tok, env="arithmetic", seeds=(1, 2, 3, 4), G=4, **cfg):
    sampler = Sampler(model, tok.pad_token_id, stop_token_ids(tok))
    groups = run_groups(sampler, tok, EnvSpec(env), list(seeds), G, RolloutConfig(**cfg), torch.Generator().manual_seed(0))
    # A random model rarely answers right: reward reply length so returns vary.
    return [TrajectoryGroup(tuple(Trajectory(t.turns, float(len(t.turns[-1].sampled_tokens)) / 8, t.task_id)
                                  for t in g.trajectories)) for g in groups]


def _ppo_learner(model, tok, mode="lora", lr=1e-2):
    return Learner(model, LearnerConfig(mode=mode, learning_rate=lr, value_head=True), tok.pad_token_id, base_name="tiny")


def test_critic_datums_put_rewards_on_each_turns_last_token(tiny):
    model, tok = tiny
    learner = _ppo_learner(model, tok)
    groups = _groups(learner.model, tok, env="guess_number", seeds=(1, 2), max_turns=4, max_new_tokens=4)
    datums = critic_datums(groups, learner.compute_values, 1.0, 1.0, whiten_advantages=False)
    trajs = [t for g in groups for t in g.trajectories]
    assert len(datums) == len(trajs) and all(isinstance(d, CriticDatum) for d in datums)
    multi = [(d, t) for d, t in zip(datums, trajs) if len(t.turns) > 1]
    assert multi, "expected multi-turn episodes"
    for d, t in multi:
        assert d.weights == trajectory_to_datum(t, 0.0).weights
        assert sum(d.rewards) == pytest.approx(t.total_reward)
        assert all(w or not r for w, r in zip(d.weights, d.rewards))  # rewards sit on actions only
        # gamma = lambda = 1 with a zero-initialised critic: every action's return is the reward to go
        first = d.weights.index(1.0)
        assert d.returns[first] == pytest.approx(t.total_reward) and d.advantages[first] == pytest.approx(t.total_reward)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_value_head_resumes_bit_for_bit(tiny, tmp_path, mode):
    model, tok = tiny
    model_b = copy.deepcopy(model)
    a = _ppo_learner(model, tok, mode, lr=1e-3)
    datums = critic_datums(_groups(a.model, tok), a.compute_values, 1.0, 0.95)
    a.forward_backward(datums, PPO.loss, LOSS_CFG)
    a.optim_step()
    a.save_state(tmp_path / "ck", {"iteration": 1})
    assert (tmp_path / "ck" / VALUE_HEAD_FILE).exists()
    b = _ppo_learner(model_b, tok, mode, lr=1e-3)
    b.load_state(tmp_path / "ck")
    for pa, pb in zip(a.value_head.parameters(), b.value_head.parameters()):
        assert torch.equal(pa, pb) and pa.abs().sum() > 0
    assert a.compute_values(datums) == b.compute_values(datums)
    ma, mb = a.forward_backward(datums, PPO.loss, LOSS_CFG), b.forward_backward(datums, PPO.loss, LOSS_CFG)
    a.optim_step()
    b.optim_step()
    assert ma == mb
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.params, b.params))


def test_checkpoint_without_value_head_is_refused_by_a_ppo_learner(tiny, tmp_path):
    model, tok = tiny
    Learner(copy.deepcopy(model), LearnerConfig(mode="lora"), tok.pad_token_id).save_state(tmp_path / "ck")
    with pytest.raises(ValueError, match=VALUE_HEAD_FILE):
        _ppo_learner(model, tok).load_state(tmp_path / "ck")


def test_ppo_lora_trains_value_head_and_adapter_and_loads_with_peft(tiny, tmp_path):
    model, tok = tiny
    pristine = copy.deepcopy(model)
    assert Learner(copy.deepcopy(model), LearnerConfig(mode="lora"), tok.pad_token_id).value_head is None
    learner = _ppo_learner(model, tok)
    base_before = {n: p.detach().clone() for n, p in learner.model.named_parameters() if "lora_" not in n}
    adapter_before = [p.detach().clone() for p in learner.params[:-2]]
    head_before = [p.detach().clone() for p in learner.value_head.parameters()]
    datums = critic_datums(_groups(learner.model, tok), learner.compute_values, 1.0, 0.95)
    for _ in range(2):  # LoRA's B starts at zero, so A moves from the second step on
        learner.forward_backward(datums, PPO.loss, LOSS_CFG)
        learner.optim_step()
    assert all(not torch.equal(a, b) for a, b in zip(head_before, learner.value_head.parameters()))
    assert all(not torch.equal(a, b) for a, b in zip(adapter_before, learner.params[:-2]))
    for n, p in learner.model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, base_before[n]), n
    learner.save_state(tmp_path / "ck")
    loaded = PeftModel.from_pretrained(pristine, str(tmp_path / "ck")).eval()
    x = torch.tensor([[1, 5, 9, 12]])
    with torch.no_grad():
        assert torch.allclose(loaded(x).logits, learner.model(x).logits, atol=1e-6)


def test_value_loss_decreases_on_a_fixed_batch(tiny):
    model, tok = tiny
    learner = _ppo_learner(model, tok, lr=3e-3)
    datums = critic_datums(_groups(learner.model, tok), learner.compute_values, 1.0, 1.0)
    cfg = LossConfig(vf_coef=1.0, value_clip=0.0)
    history = []
    for _ in range(15):
        history.append(learner.forward_backward(datums, PPO.loss, cfg))
        learner.optim_step()
    assert history[-1]["value_loss"] < 0.5 * history[0]["value_loss"]
    assert history[-1]["explained_variance"] > history[0]["explained_variance"]


SMALL_PPO = {
    "seed": 5,
    "model": {"name": "tiny", "dtype": "float32"},
    "env": {"path": "arithmetic", "kwargs": {"max_operand": 3}},
    "algorithm": {"name": "ppo", "kl_coef": 0.05, "kl_estimator": "k1"},
    "training": {"mode": "lora", "iterations": 3, "learning_rate": 5e-3, "groups_per_batch": 2,
                 "group_size": 4, "max_new_tokens": 4},
    "sft": {"steps": 20, "batch_size": 16, "examples": 64, "learning_rate": 3e-3},
    "eval": {"every": 3, "num_tasks": 4},
}


def test_ppo_train_is_finite_and_resumes_identically(tmp_path):
    full = config_from_dict({**SMALL_PPO, "output_dir": str(tmp_path / "full")})
    reference = [deterministic_metrics(m) for m in train(full)]
    for m in reference:
        for k in ("loss", "policy_loss", "value_loss", "explained_variance", "kl", "grad_norm"):
            assert math.isfinite(m[k]), (k, m)
    assert (tmp_path / "full" / "checkpoints" / "iter_00002" / VALUE_HEAD_FILE).exists()
    part = config_from_dict({**SMALL_PPO, "output_dir": str(tmp_path / "part")})
    train(replace(part, training=replace(part.training, iterations=2)))
    rest = [deterministic_metrics(m) for m in train(part, resume=True)]
    assert rest == reference[2:]


def test_score_gives_every_algorithm_its_datums(tiny):
    model, tok = tiny
    base = {k: v for k, v in SMALL_PPO.items() if k != "sft"}
    groups = None
    for name in ("ppo", "dr_grpo", "grpo", "rloo", "importance_sampling"):
        cfg = config_from_dict({**base, "algorithm": {"name": name}})
        exp = Experiment(cfg, copy.deepcopy(model), tok)
        exp.start_rl()  # seeded in Experiment(): the twin must start its adapter from the same RNG state
        twin = Experiment(cfg, copy.deepcopy(model), tok)
        twin.start_rl()
        groups = groups or _groups(exp.policy, tok)
        datums = exp.score(groups)
        assert datums and all(isinstance(d, CriticDatum) == (name == "ppo") for d in datums)
        metrics = deterministic_metrics(exp.train_step(groups, datums))
        assert math.isfinite(metrics["loss"]) and ("value_loss" in metrics) == (name == "ppo")
        assert deterministic_metrics(twin.train_step(groups)) == metrics  # scoring inside or before: one step


@pytest.mark.parametrize("field,value", [("gamma", 1.5), ("gae_lambda", -0.1), ("vf_coef", -1.0),
                                         ("value_clip", float("nan")), ("value_learning_rate", -1e-3)])
def test_bad_ppo_hyper_parameters_name_the_field(field, value):
    with pytest.raises(ConfigError, match=f"algorithm.{field}"):
        config_from_dict({"algorithm": {"name": "ppo", field: value}})


def test_ppo_tiny_config_loads():
    from pathlib import Path

    from tinker_pipelines.config import load_config

    cfg = load_config(Path(__file__).parent.parent / "configs" / "ppo_tiny.yaml")
    assert cfg.algorithm.name == "ppo" and get_algorithm(cfg.algorithm.name).value_head


def test_value_head_has_its_own_learning_rate(tiny):
    model, tok = tiny
    learner = Learner(model, LearnerConfig(mode="full", learning_rate=1e-4, value_head=True, value_learning_rate=3e-3),
                      tok.pad_token_id)
    policy_group, head_group = learner.optimizer.param_groups
    assert policy_group["lr"] == 1e-4 and head_group["lr"] == 3e-3
    assert {id(p) for p in head_group["params"]} == {id(p) for p in learner.value_head.parameters()}


# -- PPO proper: several epochs over one rollout, the clips active, truncation bootstraps ----------

def _trajectory(stop_reason, sampled=(7, 8, 9), reward=0.0):
    from tinker_pipelines.types import Turn

    turn = Turn((1, 2, 3), tuple(sampled), (-1.0,) * len(sampled), reward, "x")
    return Trajectory((turn,), 0.0, "t", stop_reason)


@pytest.mark.parametrize("stop_reason", ["done", "max_turns", "context_overflow"])
def test_truncated_episode_bootstraps_from_its_value_a_terminated_one_from_zero(stop_reason):
    seen = []

    def values_fn(datums):  # V = 0.5 everywhere, 2.0 at the state after the last sampled token
        seen.extend(datums)
        return [[0.5] * 5 + [2.0] * (len(d.input_tokens) - 5) for d in datums]

    (d,) = critic_datums([TrajectoryGroup((_trajectory(stop_reason, reward=1.0),))], values_fn, 0.9, 1.0,
                         whiten_advantages=False)
    T = len(d.input_tokens)
    truncated = stop_reason != "done"
    assert len(seen[0].input_tokens) == T + truncated  # one extra position only when it is needed
    # last action: delta = r + gamma * V(s_T) - V(s_{T-1}), V(s_T) = 2.0 when cut, 0 when the env ended it
    bootstrap = 2.0 if truncated else 0.0
    assert d.advantages[T - 1] == pytest.approx(1.0 + 0.9 * bootstrap - 0.5)
    assert d.returns[T - 1] == pytest.approx(1.0 + 0.9 * bootstrap)
    assert d.old_values[T - 1] == 0.5  # the extra position never becomes a trained value


def _epochs_setup(tiny, lr=3e-2):
    from tinker_pipelines.loops.experiment import train_epochs  # noqa: F401  (the function under test)

    model, tok = tiny
    learner = _ppo_learner(model, tok, lr=lr)
    datums = critic_datums(_groups(learner.model, tok), learner.compute_values, 1.0, 0.95)
    return learner, datums


def _loss_batch_of(learner, datums):
    from tinker_pipelines.training.learner import loss_batch, pad_datums

    padded = pad_datums(datums, learner.pad_token_id)
    return padded, loss_batch(padded.fields, None, None)


def test_second_epoch_clips_and_a_clipped_token_gets_no_gradient(tiny):
    from tinker_pipelines.loops.experiment import train_epochs

    learner, datums = _epochs_setup(tiny)
    cfg = replace(LOSS_CFG, value_clip=0.01)
    history = train_epochs(learner, datums, PPO.loss, cfg, epochs=2, minibatches=1)
    (first,), (second,) = history
    # epoch 1 sees the weights that sampled: ratio 1 (up to sampler/learner numerics), nothing clipped
    assert first["clip_fraction"] == 0.0 and first["value_clip_fraction"] == 0.0
    assert abs(first["ratio_mean"] - 1) < 1e-4 and first["approx_kl"] < 1e-8
    # epoch 2 sees the same behaviour logprobs and old values after one step: both clips act
    assert second["clip_fraction"] > 0 and second["value_clip_fraction"] > 0 and second["approx_kl"] > 0

    # which tokens: the current ratio outside the band on the side their advantage pushes
    padded, batch = _loss_batch_of(learner, datums)
    lp_BT = torch.zeros_like(batch.weights_BT)
    for i, lp in enumerate(learner.compute_logprobs(datums)):
        lp_BT[i, :len(lp)] = torch.tensor(lp)
    lp_BT.requires_grad_(True)
    ratio_BT = (lp_BT - batch.behaviour_logprobs_BT).exp().detach()
    adv_BT, w_BT = batch.advantages_BT, batch.weights_BT != 0
    high, low = w_BT & (ratio_BT > 1.2) & (adv_BT > 0), w_BT & (ratio_BT < 0.8) & (adv_BT < 0)
    wrong_side = w_BT & (((ratio_BT > 1.2) & (adv_BT < 0)) | ((ratio_BT < 0.8) & (adv_BT > 0)))
    assert (high | low).any() and wrong_side.any(), "the step should push ratios out on both sides"
    surrogate = get_algorithm("grpo").loss  # the same clipped surrogate, without the value head
    loss, m = surrogate(lp_BT, batch, replace(cfg, normalization="token"))
    loss.backward()
    assert lp_BT.grad[high | low].abs().max() == 0  # clipped: no gradient
    assert (lp_BT.grad[wrong_side] != 0).all()  # outside the band the other way: still pushed back
    assert m["clip_fraction"] == pytest.approx(((high | low).sum() / w_BT.sum()).item())


def test_kl_early_stop_stops_the_epochs():
    from tinker_pipelines.loops.experiment import summarize_epochs, train_epochs

    class FakeLearner:  # approx_kl grows with every optimizer step
        steps = 0

        def forward_backward(self, datums, loss_fn, loss_cfg):
            return {"approx_kl": 0.01 * self.steps, "trained_tokens": float(len(datums))}

        def optim_step(self):
            self.steps += 1
            return {"grad_norm": 1.0}

    datums = list(range(8))
    history = train_epochs(FakeLearner(), datums, None, LOSS_CFG, epochs=4, minibatches=2, target_kl=0.025)
    assert [len(e) for e in history] == [2, 2]  # KL 0, 0.01 | 0.02, 0.03 > 0.025: stop after that step
    summary = summarize_epochs(history)
    assert summary["optim_steps"] == 4 and summary["epochs"] == 2 and summary["trained_tokens"] == 8
    assert [len(e) for e in train_epochs(FakeLearner(), datums, None, LOSS_CFG, 4, 2)] == [2] * 4


def test_minibatches_are_shuffled_per_epoch_from_the_seed():
    from tinker_pipelines.loops.experiment import train_epochs

    class Recorder:
        def __init__(self):
            self.seen = []

        def forward_backward(self, datums, loss_fn, loss_cfg):
            self.seen.append(tuple(datums))
            return {}

        def optim_step(self):
            return {}

    a, b, c = Recorder(), Recorder(), Recorder()
    for rec, seed in ((a, 1), (b, 1), (c, 2)):
        train_epochs(rec, list(range(10)), None, LOSS_CFG, epochs=3, minibatches=3, seed=seed)
    assert a.seen == b.seen != c.seen
    assert [len(s) for s in a.seen] == [3, 3, 4] * 3
    for epoch in range(3):  # every datum once per epoch, each minibatch in rollout order
        parts = a.seen[3 * epoch:3 * epoch + 3]
        assert sorted(sum(parts, ())) == list(range(10)) and all(list(p) == sorted(p) for p in parts)
    assert a.seen[:3] != a.seen[3:6]
    one = Recorder()
    train_epochs(one, list(range(10)), None, LOSS_CFG, epochs=1, minibatches=1, seed=5)
    assert one.seen == [tuple(range(10))]  # one pass, one minibatch: the plain step, order kept


def test_ppo_defaults_to_four_epochs_and_grpo_to_one(tiny):
    model, tok = tiny
    base = {k: v for k, v in SMALL_PPO.items() if k != "sft"}
    groups = _groups(model, tok)
    for name, epochs in (("ppo", 4), ("grpo", 1)):
        exp = Experiment(config_from_dict({**base, "algorithm": {"name": name}}), copy.deepcopy(model), tok)
        metrics = exp.train_step(groups)
        assert metrics["epochs"] == epochs and metrics["optim_steps"] == epochs and exp.learner.steps == epochs
    exp = Experiment(config_from_dict({**base, "algorithm": {"name": "ppo", "ppo_epochs": 2, "minibatches": 3}}),
                     copy.deepcopy(model), tok)
    metrics = exp.train_step(groups)
    assert metrics["optim_steps"] == 6 and metrics["trained_tokens"] == sum(sum(d.weights) for d in exp.score(groups))
    assert metrics["clip_fraction"] > 0  # the last epoch's


@pytest.mark.parametrize("field,value", [("ppo_epochs", 0), ("minibatches", 0), ("target_kl", -0.1),
                                         ("target_kl", float("inf"))])
def test_bad_epoch_settings_name_the_field(field, value):
    with pytest.raises(ConfigError, match=f"algorithm.{field}"):
        config_from_dict({"algorithm": {"name": "ppo", field: value}})


def test_dr_grpo_refuses_another_normalization():
    with pytest.raises(ConfigError, match="algorithm.normalization must be 'constant' or unset for dr_grpo"):
        config_from_dict({"algorithm": {"name": "dr_grpo", "normalization": "token"}})
    cfg = config_from_dict({"algorithm": {"name": "dr_grpo"}, "training": {"max_new_tokens": 6, "max_turns": 2}})
    assert cfg.algorithm.normalization is None


def test_datums_with_their_reference_logprobs_train_exactly_as_without(tiny):
    """`compute_reference_logprobs` gives what `forward_backward` computes in its own micro-batches,
    so datums carrying them leave the loss, the KL and every gradient bit for bit the same."""
    model, tok = tiny
    groups = _groups(model, tok)
    cfg = LearnerConfig(mode="lora", learning_rate=1e-2, micro_batch_size=3, needs_reference=True)
    grads, metrics = [], []
    for cached in (False, True):
        torch.manual_seed(0)  # the adapter's initialization
        learner = Learner(copy.deepcopy(model), cfg, tok.pad_token_id)
        with torch.no_grad():  # a trained adapter, so the policy is not the reference
            for p in learner.params:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
        datums = critic_datums(groups, lambda ds: [[0.0] * len(d.input_tokens) for d in ds], 1.0, 0.95)
        if cached:
            datums = with_reference_logprobs(datums, learner.compute_reference_logprobs)
        metrics.append(learner.forward_backward(datums, get_algorithm("grpo").loss, LossConfig(kl_coef=0.1)))
        grads.append([p.grad.clone() for p in learner.params])
    assert metrics[0] == metrics[1] and metrics[0]["kl"] > 0
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    with pytest.raises(ValueError, match="reference_logprobs has length 1"):
        replace(datums[0], reference_logprobs=(0.0,))


def test_several_epochs_run_the_reference_forward_once(tiny, monkeypatch):
    """PPO's passes reuse the reference logprobs scored once per rollout: the reference forward
    runs over each datum once, not once per epoch, and the run matches computing it every pass."""
    model, tok = tiny
    groups = _groups(model, tok)
    base = {k: v for k, v in SMALL_PPO.items() if k != "sft"}
    cfg = config_from_dict({**base, "algorithm": {"name": "ppo", "ppo_epochs": 3, "minibatches": 2, "kl_coef": 0.2}})
    rows = []
    original = Learner.reference_logprobs

    def counting(self, padded):
        rows.append(padded.inputs_BT.shape[0])
        return original(self, padded)

    monkeypatch.setattr(Learner, "reference_logprobs", counting)
    exp = Experiment(cfg, copy.deepcopy(model), tok)
    cached = exp.train_step(groups)
    n = len(exp.score(groups))
    assert sum(rows) == 2 * n  # the train step's scoring, then the `score` call above: once each
    rows.clear()
    scored = Experiment.score  # the same run with the datums stripped of them: computed every pass
    monkeypatch.setattr(Experiment, "score", lambda self, g: [replace(d, reference_logprobs=()) for d in scored(self, g)])
    exp = Experiment(cfg, copy.deepcopy(model), tok)
    fresh = exp.train_step(groups)
    assert sum(rows) == n + 3 * n  # scored (then dropped), and again in every pass
    assert cached["optim_steps"] == fresh["optim_steps"] == 6 and cached["kl"] > 0
    for k in ("loss", "kl", "clip_fraction", "approx_kl", "grad_norm"):
        assert cached[k] == pytest.approx(fresh[k], rel=1e-4, abs=1e-6), k
