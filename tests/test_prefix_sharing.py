"""The shared-prefix training forward equals the plain one: logprobs, values, gradients, reference."""

import copy
import math

import pytest
import torch

import tinker_pipelines.training.learner as learner_module
from tinker_pipelines.algorithms import LossConfig, get_algorithm
from tinker_pipelines.algorithms.losses import LossBatch, masked_mean
from tinker_pipelines.config import config_from_dict
from tinker_pipelines.training.learner import Learner, LearnerConfig, pad_datums
from tinker_pipelines.training.prefix_sharing import plan_prefix_sharing, shared_prefix_forward, supports_prefix_sharing
from tinker_pipelines.loops.train import deterministic_metrics, train
from tinker_pipelines.types import Datum

GRPO = get_algorithm("grpo")


def _datum(segments: list[tuple[list[int], bool]], advantage: float) -> Datum:
    """A datum from token segments, each sampled by the policy (weighted) or not (prompt, env)."""
    tokens, weighted = [], []
    for toks, w in segments:
        tokens += toks
        weighted += [w] * len(toks)
    weights = [1.0 if w else 0.0 for w in weighted[1:]]  # position t predicts token t + 1
    behaviour = [-2.0 * w for w in weights]
    return Datum(tuple(tokens[:-1]), tuple(tokens[1:]), tuple(weights), tuple(behaviour),
                 tuple(advantage * w for w in weights))


def _micro_batch(vocab: int) -> list[Datum]:
    """Groups with different prompt lengths and completion lengths, a multi-turn group whose
    second turn adds env tokens, a group of completions that share their first tokens, and a
    lone datum."""
    g = torch.Generator().manual_seed(7)

    def toks(n: int) -> list[int]:
        return torch.randint(5, vocab, (n,), generator=g).tolist()

    datums = []
    for prompt_len, comp_lens in ((23, (3, 7, 1, 5)), (11, (6, 2, 4))):
        prompt = toks(prompt_len)
        datums += [_datum([(prompt, False), (toks(n), True)], 0.5 - k / 3) for k, n in enumerate(comp_lens)]
    prompt, common = toks(17), toks(2)
    datums += [_datum([(prompt, False), (common + toks(n), True)], 1.0 - k) for k, n in enumerate((2, 4))]
    prompt = toks(15)
    for k, (first, env, second) in enumerate(((3, 4, 2), (5, 3, 4), (2, 6, 3))):
        datums.append(_datum([(prompt, False), (toks(first), True), (toks(env), False), (toks(second), True)],
                             0.7 - 0.6 * k))
    datums.append(_datum([(toks(9), False), (toks(4), True)], -0.3))
    return datums


def _learner(model, tok, mode: str, share: bool, seed: int = 0) -> Learner:
    torch.manual_seed(seed)  # the same LoRA A init on both sides
    learner = Learner(copy.deepcopy(model), LearnerConfig(mode=mode, share_prefix=share, value_head=True,
                                                          needs_reference=True), tok.pad_token_id)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # non-zero LoRA B and value head, so every path has a gradient
        for n, p in learner.model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            elif mode == "full":  # move the policy away from its frozen reference copy
                p.add_(torch.randn(p.shape, generator=g) * 0.02)
        for p in learner.value_head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return learner


def _grpo_and_value_loss(learner: Learner, padded) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    lp_BT, v_BT = learner._forward(learner.model, padded, values=True)
    f = padded.fields
    loss, _ = GRPO.loss(lp_BT, LossBatch(f["weights"], f["behaviour_logprobs"], f["advantages"]), LossConfig())
    loss = loss + masked_mean((v_BT - f["advantages"]) ** 2, f["weights"])
    loss.backward()
    return lp_BT.detach(), v_BT.detach(), loss.detach()


def test_plan_finds_runs_and_stops_before_the_first_weighted_position(tiny):
    model, tok = tiny
    datums = _micro_batch(len(tok))
    padded = pad_datums(datums, tok.pad_token_id)
    plan = plan_prefix_sharing(padded.inputs_BT, padded.mask_BT, padded.fields["weights"])
    assert plan is not None and supports_prefix_sharing(model)
    assert plan.run_B.tolist() == [0] * 4 + [1] * 3 + [2] * 2 + [3] * 3 + [4]
    # a prompt of n tokens: its last token's logit predicts the first sampled token, so n - 1 are shared
    assert plan.prefix_len_P.tolist() == [22, 10, 16, 14, 8]
    # distinct prompts: nothing to share
    distinct = pad_datums([datums[0], datums[4], datums[7], datums[-1]], tok.pad_token_id)
    assert plan_prefix_sharing(distinct.inputs_BT, distinct.mask_BT, distinct.fields["weights"]) is None


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_shared_forward_equals_the_plain_one(tiny, mode):
    model, tok = tiny
    padded = pad_datums(_micro_batch(len(tok)), tok.pad_token_id)
    w_BT = padded.fields["weights"].bool()
    out = {}
    for share in (True, False):
        learner = _learner(model, tok, mode, share)
        lp, v, loss = _grpo_and_value_loss(learner, padded)
        grads = {n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None}
        grads.update({f"value_head.{n}": p.grad.clone() for n, p in learner.value_head.named_parameters()})
        out[share] = (lp, v, loss, grads, learner.reference_logprobs(padded))
    (lp, v, loss, grads, ref), (lp0, v0, loss0, grads0, ref0) = out[True], out[False]
    assert lp[w_BT].abs().min() > 0 and v[w_BT].abs().max() > 0
    assert torch.allclose(lp[w_BT], lp0[w_BT], atol=1e-5)
    assert torch.allclose(v[w_BT], v0[w_BT], atol=1e-5)
    assert torch.allclose(ref[w_BT], ref0[w_BT], atol=1e-5)
    assert not torch.allclose(ref[w_BT], lp[w_BT], atol=1e-3)  # the reference is another function
    assert math.isclose(loss.item(), loss0.item(), rel_tol=1e-5)
    assert grads.keys() == grads0.keys() and any("k_proj" in n for n in grads)
    for n, g0 in grads0.items():
        scale = g0.abs().max().item()
        assert scale > 0, n
        assert (grads[n] - g0).abs().max().item() <= 1e-5 * scale + 1e-9, n


def test_k_and_v_gradients_flow_through_the_shared_prefix(tiny):
    # A loss on a completion depends on the prompt's keys and values: only the adapters on k/v
    # (and the layers below) carry that path; their gradients must not vanish or differ.
    model, tok = tiny
    padded = pad_datums(_micro_batch(len(tok))[:4], tok.pad_token_id)
    grads = []
    for share in (True, False):
        learner = _learner(model, tok, "lora", share)
        _grpo_and_value_loss(learner, padded)
        grads.append({n: p.grad for n, p in learner.model.named_parameters() if "v_proj.lora_A" in n})
    for n, g in grads[1].items():
        assert g.abs().max() > 0 and (grads[0][n] - g).abs().max() <= 1e-5 * g.abs().max(), n


def test_forward_backward_micro_batches_match(tiny):
    model, tok = tiny
    datums = _micro_batch(len(tok))
    metrics, grads = [], []
    for share in (True, False):
        learner = _learner(model, tok, "full", share)
        learner.cfg = LearnerConfig(mode="full", share_prefix=share, micro_batch_size=5, value_head=True)
        metrics.append(learner.forward_backward(datums, GRPO.loss, LossConfig()))
        grads.append(torch.cat([p.grad.flatten() for p in learner.params if p.grad is not None]))
    assert metrics[0].keys() == metrics[1].keys()
    assert all(math.isclose(metrics[0][k], metrics[1][k], rel_tol=1e-5, abs_tol=1e-7) for k in metrics[1])
    assert (grads[0] - grads[1]).abs().max() <= 1e-5 * grads[1].abs().max()


SMALL = {
    "seed": 3,
    "model": {"name": "tiny", "dtype": "float32"},
    "env": {"path": "arithmetic", "kwargs": {"max_operand": 3, "partial_credit": 0.5}},
    "algorithm": {"name": "grpo", "kl_coef": 0.05},
    "training": {"mode": "lora", "iterations": 2, "learning_rate": 5e-3, "groups_per_batch": 4,
                 "group_size": 4, "max_new_tokens": 4},
    "sft": {"steps": 20, "batch_size": 16, "examples": 64, "learning_rate": 3e-3},
    "eval": {"every": 2, "num_tasks": 4},
}


def test_train_gives_the_same_metrics_with_and_without_sharing(tmp_path, monkeypatch):
    runs, shared_calls = [], []

    def counted(*args, **kwargs):
        shared_calls.append(1)
        return shared_prefix_forward(*args, **kwargs)

    monkeypatch.setattr(learner_module, "shared_prefix_forward", counted)
    for share in (True, False):
        cfg = config_from_dict({**SMALL, "training": {**SMALL["training"], "share_prefix": share},
                                "output_dir": str(tmp_path / str(share))})
        runs.append([deterministic_metrics(m) for m in train(cfg)])
        calls = len(shared_calls)
        assert (calls > 0) if share else (calls == calls_with_sharing), calls
        calls_with_sharing = calls
    assert len(runs[0]) == 2 and runs[0][0]["informative_groups"] > 0
    for a, b in zip(*runs):
        assert a.keys() == b.keys()
        for k in b:
            assert math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=1e-6), (k, a[k], b[k])
