"""DPO: the loss on hand-computed inputs, pairs from scored rollouts, a short DPO run on the tiny
model (LoRA and full), the LoRA reference, and the `dpo` job on a real Dagster instance."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import dagster as dg
import pytest
import torch
from dagster_env import materializations, metadata, tracker

from tinker_pipelines.algorithms.dpo import dpo_loss, dpo_sigmoid_loss
from tinker_pipelines.algorithms.losses import LossBatch, LossConfig
from tinker_pipelines.algorithms.registry import get_algorithm
from tinker_pipelines.config import ConfigError, config_from_dict
from tinker_pipelines.loops.dpo import pair_metrics, preference_pairs, run_dpo
from tinker_pipelines.training.learner import Learner, pad_datums
from tinker_pipelines.loops.preferences import PreferencePair, pair_datums, pairs_from_groups
from tinker_pipelines.tracking import registered_model_name
from tinker_pipelines.loops.train import Experiment, train
from tinker_pipelines.types import Trajectory, TrajectoryGroup, Turn

DPO_SMALL = {
    "seed": 3,
    "model": {"name": "tiny", "dtype": "float32"},
    "env": {"path": "arithmetic", "kwargs": {"max_operand": 3}},
    "algorithm": {"name": "dpo"},
    "training": {"mode": "lora", "learning_rate": 5e-3, "max_new_tokens": 4, "micro_batch_size": 8},
    # A short SFT makes the tiny model right on some samples and wrong on others: informative groups.
    "sft": {"steps": 40, "batch_size": 16, "examples": 64, "learning_rate": 3e-3},
    "dpo": {"pairs": 16, "group_size": 4, "steps": 10, "batch_size": 8, "beta": 0.1},
    "eval": {"every": 100, "num_tasks": 8},
}
LOG2 = math.log(2)


# -- the loss ---------------------------------------------------------------------------------
def test_sigmoid_loss_matches_hand_computed_values():
    chosen, rejected = torch.tensor([-1.0, -4.0], requires_grad=True), torch.tensor([-3.0, -2.0])
    losses, rc, rr = dpo_sigmoid_loss(chosen, rejected, torch.tensor([-2.0, -3.0]), torch.tensor([-2.0, -3.0]), 0.5)
    # pair 0: margin of log-ratios 1 - (-1) = 2 -> -log sigmoid(1); pair 1: -1 - 1 = -2 -> -log sigmoid(-1)
    assert losses.tolist() == pytest.approx([math.log1p(math.exp(-1)), math.log1p(math.exp(1))], abs=1e-6)
    assert rc.tolist() == [0.5, -0.5] and rr.tolist() == [-0.5, 0.5]
    assert not rc.requires_grad
    losses.sum().backward()
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    # d/d chosen of -log sigmoid(beta * m) = -beta * sigmoid(-beta * m)
    assert chosen.grad.tolist() == pytest.approx([-0.5 * sig(-1), -0.5 * sig(1)], abs=1e-6)


def test_dpo_loss_sums_weighted_tokens_of_interleaved_pairs():
    # rows: chosen 0, rejected 0, chosen 1, rejected 1; the first column is prompt (weight 0)
    w = torch.tensor([[0, 1, 1], [0, 1, 0], [0, 1, 1], [0, 1, 1]], dtype=torch.float)
    lp = torch.tensor([[-9.0, -0.5, -0.5], [-9.0, -2.0, -7.0], [-9.0, -1.0, -1.0], [-9.0, -0.5, -0.5]])
    ref = torch.full((4, 3), -1.0)
    loss, m = dpo_loss(lp, LossBatch(w, ref_logprobs_BT=ref), LossConfig(beta=1.0))
    # sequence sums: chosen (-1, -2), rejected (-2, -1); reference sums (-2, -2), (-1, -2)
    expected, rc, rr = dpo_sigmoid_loss(torch.tensor([-1.0, -2.0]), torch.tensor([-2.0, -1.0]),
                                        torch.tensor([-2.0, -2.0]), torch.tensor([-1.0, -2.0]), 1.0)
    assert loss.item() == pytest.approx(expected.mean().item())
    assert rc.tolist() == [1.0, 0.0] and rr.tolist() == [-1.0, 1.0]
    assert m == pytest.approx({"dpo/accuracy": 0.5, "dpo/margin": 0.5, "dpo/chosen_reward": 0.5,
                               "dpo/rejected_reward": 0.0})
    with pytest.raises(ValueError, match="pairs"):
        dpo_loss(lp[:3], LossBatch(w[:3], ref_logprobs_BT=ref[:3]), LossConfig())
    with pytest.raises(ValueError, match="reference"):
        dpo_loss(lp, LossBatch(w), LossConfig())


def test_registered_and_config_checked():
    algo = get_algorithm("dpo")
    assert algo.pairwise and algo.needs_reference and algo.advantages is None
    for field, value in (("beta", 0.0), ("group_size", 1), ("pairs", 0)):
        with pytest.raises(ConfigError, match=f"dpo.{field}"):
            config_from_dict({**DPO_SMALL, "dpo": {field: value}})


# -- pairs from scored rollouts ----------------------------------------------------------------
def _traj(task: str, prompt: tuple[int, ...], sampled: tuple[int, ...], reward: float) -> Trajectory:
    return Trajectory((Turn(prompt, sampled, (-0.1,) * len(sampled), reward, ""),), 0.0, task)


def test_pairs_pick_first_best_and_first_worst_and_skip_uniform_groups():
    p = (1, 2, 3)
    g1 = TrajectoryGroup((_traj("a", p, (4,), 0.5), _traj("a", p, (5,), 1.0), _traj("a", p, (6,), 0.0),
                          _traj("a", p, (7,), 1.0), _traj("a", p, (8,), 0.0)))
    g2 = TrajectoryGroup((_traj("b", p, (4,), 1.0), _traj("b", p, (5,), 1.0)))
    (pair,) = pairs_from_groups([g1, g2])
    assert (pair.task_id, pair.chosen.turns[0].sampled_tokens, pair.rejected.turns[0].sampled_tokens) == ("a", (5,), (6,))
    assert pair.reward_gap == 1.0
    chosen, rejected = pair_datums([pair])
    assert chosen.input_tokens + chosen.target_tokens[-1:] == (1, 2, 3, 5)
    assert chosen.weights == (0.0, 0.0, 1.0) and rejected.target_tokens[-1] == 6
    with pytest.raises(ValueError, match="not above"):
        PreferencePair("a", g1.trajectories[2], g1.trajectories[1])


@pytest.fixture(scope="module")
def sft_start():
    """(config, SFT-warm-started tiny model, tokenizer, pairs sampled from it)."""
    cfg = config_from_dict(DPO_SMALL)
    exp = Experiment(cfg)
    exp.sft()
    pairs, tasks = preference_pairs(exp)
    assert tasks >= len(pairs)
    return cfg, copy.deepcopy(exp.base_model), exp.tokenizer, pairs


def test_pairs_from_scored_rollouts_are_token_exact_and_deterministic(sft_start):
    cfg, model, tok, pairs = sft_start
    assert len(pairs) == cfg.dpo.pairs
    for p in pairs:
        assert p.chosen.total_reward > p.rejected.total_reward
        assert p.chosen.task_id == p.rejected.task_id == p.task_id
        for traj, datum in zip((p.chosen, p.rejected), pair_datums([p])):
            turn = traj.turns[0]
            tokens = turn.prompt_tokens + turn.sampled_tokens
            assert datum.input_tokens == tokens[:-1] and datum.target_tokens == tokens[1:]
            trained = tuple(t for t, w in zip(datum.target_tokens, datum.weights) if w)
            assert trained == turn.sampled_tokens  # exactly the sampled tokens carry loss
    # the same seed gives the same pairs
    again, _ = preference_pairs(Experiment(cfg, model=copy.deepcopy(model), tokenizer=tok))
    assert [(p.chosen, p.rejected) for p in again] == [(p.chosen, p.rejected) for p in pairs]


# -- training -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode,lr", [("lora", 5e-3), ("full", 3e-4)])
def test_short_dpo_run_improves_margin_and_accuracy_on_its_pairs(sft_start, mode, lr):
    cfg, model, tok, pairs = sft_start
    cfg = config_from_dict({**DPO_SMALL, "training": {**DPO_SMALL["training"], "mode": mode, "learning_rate": lr}})
    exp = Experiment(cfg, model=copy.deepcopy(model), tokenizer=tok)
    learner = exp.start_rl()
    before = pair_metrics(learner, pairs, cfg.dpo.beta)
    assert before["pairs/dpo_margin"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at the start
    assert before["pairs/dpo_loss"] == pytest.approx(LOG2)
    history = run_dpo(exp, pairs, evaluate=False)
    after = history[-1]
    assert len(history) == cfg.dpo.steps
    assert after["pairs/dpo_margin"] > 0.05 and after["pairs/dpo_accuracy"] >= 0.7
    assert after["pairs/dpo_loss"] < LOG2 - 0.02
    assert (learner.reference is None) == (mode == "lora")  # LoRA keeps no second copy


def test_reference_logprobs_computed_once_train_as_computed_every_step(sft_start, monkeypatch):
    """With pairs drawn 5 times each, the reference runs once per pair instead of once per draw
    (and the final `pairs/dpo_*` metrics reuse it), and the run matches the one that recomputes
    it in every step."""
    cfg, model, tok, pairs = sft_start
    rows, original = [], Learner.reference_logprobs
    monkeypatch.setattr(Learner, "reference_logprobs", lambda self, p: rows.append(p.inputs_BT.shape[0]) or original(self, p))
    runs = {}
    for precompute in (None, False):
        rows.clear()
        exp = Experiment(cfg, model=copy.deepcopy(model), tokenizer=tok)
        runs[precompute] = run_dpo(exp, pairs, evaluate=False, precompute_reference=precompute)
        runs[precompute, "rows"] = sum(rows)
    pair_rows = 2 * len(pairs)
    assert runs[None, "rows"] == pair_rows
    assert runs[False, "rows"] == 2 * cfg.dpo.steps * cfg.dpo.batch_size + pair_rows  # + the final metrics
    for a, b in zip(runs[None], runs[False]):
        for k in ("dpo/loss", "dpo/margin", "grad_norm", "pairs/dpo_margin"):
            if k in b:
                assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k


def test_lora_reference_is_the_adapter_disabled_base(sft_start):
    cfg, model, tok, pairs = sft_start
    pristine = copy.deepcopy(model)
    exp = Experiment(cfg, model=copy.deepcopy(model), tokenizer=tok)
    run_dpo(exp, pairs[:4], evaluate=False)
    padded = pad_datums(pair_datums(pairs[:4]), tok.pad_token_id)
    ref = exp.learner.reference_logprobs(padded)
    with torch.no_grad():
        logits = pristine(input_ids=padded.inputs_BT, attention_mask=padded.mask_BT).logits
    base = torch.log_softmax(logits, -1).gather(-1, padded.targets_BT[..., None]).squeeze(-1)
    w = padded.fields["weights"].bool()
    assert torch.allclose(ref[w], base[w], atol=1e-5)
    policy = torch.tensor([lp for d in exp.learner.compute_logprobs(pair_datums(pairs[:4])) for lp in d])
    assert (policy - base[padded.mask_BT.bool()]).abs().max() > 1e-3  # the adapter did change the policy


def test_odd_micro_batch_is_rounded_so_pairs_stay_whole(sft_start):
    cfg, model, tok, pairs = sft_start
    grads = []
    for mb in (3, 64):
        c = config_from_dict({**DPO_SMALL, "training": {**DPO_SMALL["training"], "micro_batch_size": mb}})
        exp = Experiment(c, model=copy.deepcopy(model), tokenizer=tok)
        learner = exp.start_rl()
        assert learner.cfg.micro_batch_size == (2 if mb == 3 else 64)
        torch.manual_seed(0)
        for p in learner.params:
            p.data.normal_(0, 0.02)  # non-zero LoRA B, so that the loss is not exactly log 2
        m = learner.forward_backward(pair_datums(pairs[:6]), exp.algorithm.loss, LossConfig(beta=0.1))
        grads.append((m["loss"], torch.cat([p.grad.flatten() for p in learner.params])))
    assert grads[0][0] == pytest.approx(grads[1][0], abs=1e-6)
    assert torch.allclose(grads[0][1], grads[1][1], atol=1e-6)


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_dpo_logprobs_are_the_models_own_at_any_sampling_temperature(tiny, mode):
    """Pairs are sampled at training.temperature, but DPO compares the policy's and the
    reference's likelihoods of them: log_softmax(logits), at temperature 1, for both."""
    from tinker_pipelines.loops.datums import sft_datum

    model, tok = tiny
    cfg = config_from_dict({**DPO_SMALL, "sft": {"steps": 0},
                            "training": {**DPO_SMALL["training"], "mode": mode, "temperature": 0.5}})
    exp = Experiment(cfg, model=model, tokenizer=tok)
    assert exp.rollout_cfg.temperature == 0.5  # the pairs' rollouts still sample at 0.5
    learner = exp.start_rl()
    torch.manual_seed(0)
    for p in learner.params:
        p.data.add_(torch.randn_like(p) * 0.02)  # the policy now differs from the reference
    msgs = [{"role": "user", "content": "2 + 3 = ?"}]
    datums = [sft_datum(tok, msgs, reply) for reply in ("5", "the answer is 7")]
    seen = {}

    def spy(logprobs_BT, batch, loss_cfg):
        seen["policy_B"] = (logprobs_BT * batch.weights_BT).sum(-1).detach()
        seen["reference_B"] = (batch.ref_logprobs_BT * batch.weights_BT).sum(-1)
        return exp.algorithm.loss(logprobs_BT, batch, loss_cfg)

    learner.forward_backward(datums, spy, LossConfig(beta=0.1))
    padded = pad_datums(datums, tok.pad_token_id)

    def sequence_logprobs_B(net):
        with torch.no_grad():
            logits_BTV = net(input_ids=padded.inputs_BT, attention_mask=padded.mask_BT).logits
        lp_BT = torch.log_softmax(logits_BTV.float(), -1).gather(-1, padded.targets_BT[..., None]).squeeze(-1)
        return (lp_BT * padded.fields["weights"]).sum(-1)

    learner.activate()
    policy_B = sequence_logprobs_B(learner.model)
    if mode == "lora":
        with learner.model.disable_adapter():
            reference_B = sequence_logprobs_B(learner.model)
    else:
        reference_B = sequence_logprobs_B(learner.reference)
    assert (policy_B - reference_B).abs().max() > 1e-2
    assert torch.allclose(seen["policy_B"], policy_B, atol=1e-4)
    assert torch.allclose(seen["reference_B"], reference_B, atol=1e-4)


# -- the plain loop and the Dagster job ------------------------------------------------------------
@pytest.fixture(scope="module")
def dpo_job_run():
    from assets.launch import run_sft
    from assets.definitions import dpo_job

    with dg.instance_for_test() as instance:
        assert run_sft(instance, "dpo-job", DPO_SMALL)
        with dg.execute_job(dg.reconstructable(dpo_job), instance,
                            run_config={"ops": {"preference_pairs": {"config": DPO_SMALL}}},
                            tags={"dagster/partition": "dpo-job"}, raise_on_error=True) as result:
            assert result.success
        yield instance


@pytest.mark.e2e
def test_dpo_job_materializes_pairs_and_a_registered_evaluated_version(dpo_job_run, tmp_path):
    (pairs_rec,) = materializations(dpo_job_run, "preference_pairs", "dpo-job")
    pm = metadata(pairs_rec)
    assert pm["pairs"] == 16 and pm["reward_gap_mean"] > 0 and Path(pm["path"]).exists()
    (ckpt_rec,) = materializations(dpo_job_run, "dpo_checkpoint", "dpo-job")
    md = metadata(ckpt_rec)
    assert (Path(md["path"]) / "adapter_model.safetensors").exists()
    assert md["after_pairs_dpo_margin"] > 0.05 and md["before_pairs_dpo_margin"] == pytest.approx(0.0, abs=1e-6)
    t = tracker()
    mv = t.client.get_model_version(registered_model_name("dpo-job"), md["model_version"])
    assert mv.tags["algorithm"] == "dpo" and mv.tags["content_hash"] == md["content_hash"]
    assert float(mv.tags["eval_score"]) == md["score"]
    events = dpo_job_run.all_logs(ckpt_rec.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION)
    assert [(e.dagster_event.event_specific_data.check_name, e.dagster_event.event_specific_data.passed)
            for e in events] == [("adapter_loads", True)]
    # the `evaluate` job loads the registered DPO version (SFT base + checkpoint) and scores it the same
    from assets.definitions import evaluate_job

    cfg = {"ops": {"evaluate_adapter": {"config": {"model_name": registered_model_name("dpo-job"),
                                                   "version": md["model_version"], "promote": False}}}}
    with dg.execute_job(dg.reconstructable(evaluate_job), dpo_job_run, run_config=cfg) as res:
        assert res.success and res.output_for_node("evaluate_adapter")["score"] == md["score"]
    # the plain loop gives the same numbers
    history = train(config_from_dict({**DPO_SMALL, "output_dir": str(tmp_path)}))
    assert md["after_pairs_dpo_margin"] == history[-1]["pairs/dpo_margin"]
    assert md["after_eval_exact_rate"] == history[-1]["eval/exact_rate"]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["iteration"] == -1 and lines[0]["data/pairs"] == 16 and len(lines) == 11
    assert (tmp_path / "checkpoints" / "dpo" / "adapter_model.safetensors").exists()
