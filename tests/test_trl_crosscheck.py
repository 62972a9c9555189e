"""Our losses, KL and advantages against TRL's own code on identical inputs (within 1e-5).

TRL's trainers are built for real from the tiny model saved to a directory; their loss methods
are called on a batch we build, so both sides see the same tokens, masks and logprobs. Where the
definitions differ (TRL's advantage epsilon, Dr. GRPO's constant normaliser) the tests pin the
exact relation instead; docs/algorithms.md says why.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from datasets import Dataset
from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer

from tinker_pipelines.algorithms import ALGORITHMS, LossBatch, LossConfig, get_algorithm, kl_penalty, masked_mean
from tinker_pipelines.algorithms.advantages import group_centered, group_normalized
from tinker_pipelines.envs.arithmetic import prompt_messages
from tinker_pipelines.training.learner import Learner, LearnerConfig
from tinker_pipelines.models import encode_chat
from tinker_pipelines.types import Datum

ATOL = 1e-5
BETA = 0.04
TEMPERATURE = 0.7
MAX_COMPLETION = 7
# (our algorithm, TRL's loss_type, our normalisation) where the two coincide on one
# un-accumulated batch; `dr_grpo` divides by B x max_tokens whatever the normalisation says.
SAME_LOSS = [("grpo", trl, norm) for trl, norm in (("grpo", "sequence"), ("bnpo", "token"), ("dapo", "token"))]
SAME_LOSS += [("dr_grpo", "dr_grpo", norm) for norm in ("constant", "sequence") if "dr_grpo" in ALGORITHMS]


@pytest.fixture
def tiny_dir(tiny, tmp_path):
    """The tiny model and tokenizer saved as a Hugging Face directory (TRL loads its reference from it)."""
    model, tokenizer = tiny
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny", tokenizer


def _grpo_trainer(tiny_dir, tmp_path, **overrides) -> GRPOTrainer:
    """A real GRPOTrainer; TRL's KL importance weighting is off unless a test turns it on (our
    KL term has none: see `test_trl_default_kl_weighting_changes_only_the_gradient`)."""
    path, tokenizer = tiny_dir
    overrides = {"use_bias_correction_kl": False, **overrides}
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), beta=BETA, temperature=TEMPERATURE, epsilon=0.2,
                      max_completion_length=MAX_COMPLETION, num_generations=4, per_device_train_batch_size=8,
                      bf16=False, activation_checkpointing=False, use_cpu=True, report_to=[], **overrides)
    data = Dataset.from_dict({"prompt": [prompt_messages("1 + 2 = ?")] * 8, "reward": [0.0] * 8})
    trainer = GRPOTrainer(model=str(path), reward_funcs=_column_reward, args=args, train_dataset=data,
                          processing_class=tokenizer)
    trainer.model.eval()  # TRL's eval-mode loss: the same formula without gradient-accumulation scaling
    return trainer


def _column_reward(completions, reward, **_):
    """Reward read from the dataset row, so the test chooses every group's rewards."""
    return list(reward)


def _batch(trainer: GRPOTrainer, seed: int = 0) -> dict[str, torch.Tensor]:
    """A GRPO batch in TRL's layout: left-padded prompts, right-padded completions of varied
    length, mixed-sign advantages, and old/reference logprobs far enough off to clip and to give
    a non-trivial KL."""
    gen = torch.Generator().manual_seed(seed)
    tok = trainer.processing_class
    questions = ["1 + 2 = ?", "12 + 7 = ?", "What is 3 + 4?", "9 + 9 = ?", "0 + 5 = ?", "11 + 13 = ?"]
    prompts = [encode_chat(tok, prompt_messages(q)) for q in questions]
    B, P = len(prompts), max(map(len, prompts))
    prompt_ids = torch.full((B, P), tok.pad_token_id)
    prompt_mask = torch.zeros(B, P, dtype=torch.long)
    for i, p in enumerate(prompts):
        prompt_ids[i, P - len(p):] = torch.tensor(p)
        prompt_mask[i, P - len(p):] = 1
    lengths_B = torch.tensor([7, 3, 5, 1, 7, 4])
    completion_mask = (torch.arange(MAX_COMPLETION)[None] < lengths_B[:, None]).long()
    completion_ids = torch.randint(4, len(tok), (B, MAX_COMPLETION), generator=gen)
    completion_ids = completion_ids.masked_fill(completion_mask == 0, tok.pad_token_id)
    batch = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
             "completion_mask": completion_mask, "advantages": torch.randn(B, generator=gen),
             "num_items_in_batch": completion_mask.sum()}
    with torch.no_grad():
        lp_BC = _trl_logprobs(trainer, batch)
    batch["old_per_token_logps"] = lp_BC + 0.3 * torch.randn(lp_BC.shape, generator=gen)
    batch["ref_per_token_logps"] = lp_BC + 0.5 * torch.randn(lp_BC.shape, generator=gen)
    return batch


def _trl_logprobs(trainer: GRPOTrainer, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """TRL's per-token logprobs of the completion tokens, [B, C]."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    lp_BC, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, mask,
                                                              batch["completion_ids"].size(1))
    return lp_BC


def _ours(trainer: GRPOTrainer, batch: dict[str, torch.Tensor], normalization: str, name: str = "grpo"):
    """Our registered loss on the same logprobs and tensors ([B, C]: masked means ignore layout)."""
    lp_BC = _trl_logprobs(trainer, batch)
    C = lp_BC.size(1)
    loss_batch = LossBatch(weights_BT=batch["completion_mask"].float(),
                           behaviour_logprobs_BT=batch["old_per_token_logps"],
                           advantages_BT=batch["advantages"][:, None].expand(-1, C),
                           ref_logprobs_BT=batch["ref_per_token_logps"])
    cfg = LossConfig(clip_eps=0.2, kl_coef=BETA, kl_estimator="k3", normalization=normalization,
                     max_tokens=MAX_COMPLETION)
    return get_algorithm(name).loss(lp_BC, loss_batch, cfg)


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("name,trl_loss_type,normalization", SAME_LOSS)
def test_grpo_loss_and_gradient_match_trl(tiny_dir, tmp_path, name, trl_loss_type, normalization):
    trainer = _grpo_trainer(tiny_dir, tmp_path, loss_type=trl_loss_type)
    batch = _batch(trainer)
    ratio_BC = (_trl_logprobs(trainer, batch) - batch["old_per_token_logps"]).exp().detach()
    clipped = ((ratio_BC - 1).abs() > 0.2)[batch["completion_mask"].bool()].float().mean()
    assert 0.2 < clipped < 0.8, "the batch must exercise both the clipped and the unclipped branch"

    trl_loss = trainer.compute_loss(trainer.model, batch)
    trl_loss.backward()
    trl_grads = _grads(trainer.model)
    ours, metrics = _ours(trainer, batch, normalization, name)
    ours.backward()
    our_grads = _grads(trainer.model)

    assert ours.item() == pytest.approx(trl_loss.item(), abs=ATOL)
    assert trl_grads.keys() == our_grads.keys() and len(trl_grads) > 10
    for name, g in trl_grads.items():
        torch.testing.assert_close(our_grads[name], g, atol=ATOL, rtol=1e-4, msg=name)
    # TRL reports the KL as a token mean over the batch, whatever its loss normalisation.
    trl_kl = trainer._metrics["eval"]["kl"][-1]
    ours_kl = masked_mean(kl_penalty(_trl_logprobs(trainer, batch).detach(), batch["ref_per_token_logps"], "k3"),
                          batch["completion_mask"].float(), "token")
    assert ours_kl.item() == pytest.approx(trl_kl, abs=ATOL) and trl_kl > 0.05
    if normalization == "token":
        assert metrics["kl"] == pytest.approx(trl_kl, abs=ATOL)
    # clip_fraction counts the tokens whose clip is active for their advantage's sign, as TRL's region mean does
    assert metrics["clip_fraction"] == pytest.approx(trainer._metrics["eval"]["clip_ratio/region_mean"][-1], abs=ATOL)


def test_trl_default_kl_weighting_changes_only_the_gradient(tiny_dir, tmp_path):
    """TRL multiplies the per-token KL by the (differentiable) importance ratio by default
    (`use_bias_correction_kl`). On policy the ratio is 1, so the loss values agree, but the
    gradient gains a beta * KL * grad(logp) term that our plain k3 penalty does not have."""
    trainer = _grpo_trainer(tiny_dir, tmp_path, loss_type="grpo", use_bias_correction_kl=True)
    batch = _batch(trainer)
    batch["old_per_token_logps"] = _trl_logprobs(trainer, batch).detach()
    trl_loss = trainer.compute_loss(trainer.model, batch)
    trl_loss.backward()
    trl_grads = _grads(trainer.model)
    ours, _ = _ours(trainer, batch, "sequence")
    ours.backward()
    our_grads = _grads(trainer.model)
    assert ours.item() == pytest.approx(trl_loss.item(), abs=ATOL)
    assert max((our_grads[n] - g).abs().max().item() for n, g in trl_grads.items()) > 100 * ATOL


def test_grpo_sequence_and_token_normalisation_really_differ_here(tiny_dir, tmp_path):
    """Guards the test above: with varied completion lengths the two normalisations give
    different numbers, so matching TRL's 'grpo' and 'dapo' is two separate facts."""
    trainer = _grpo_trainer(tiny_dir, tmp_path, loss_type="grpo")
    batch = _batch(trainer)
    with torch.no_grad():
        seq, _ = _ours(trainer, batch, "sequence")
        tok, _ = _ours(trainer, batch, "token")
    assert abs(seq.item() - tok.item()) > 100 * ATOL


def test_trl_dr_grpo_is_token_mean_rescaled_by_max_completion_length(tiny_dir, tmp_path):
    """TRL's 'dr_grpo' (and ours) divides the token sum by B * max_completion_length, a constant,
    where `grpo` with token normalisation divides by the number of completion tokens actually in
    the batch: the two differ by exactly that factor."""
    trainer = _grpo_trainer(tiny_dir, tmp_path, loss_type="dr_grpo")
    batch = _batch(trainer)
    with torch.no_grad():
        trl_loss = trainer.compute_loss(trainer.model, batch)
        ours, _ = _ours(trainer, batch, "token", "grpo")
        n_tokens, B = batch["completion_mask"].sum().item(), batch["completion_mask"].size(0)
        assert ours.item() * n_tokens / (B * MAX_COMPLETION) == pytest.approx(trl_loss.item(), abs=ATOL)
        assert abs(ours.item() - trl_loss.item()) > 100 * ATOL  # not the same number
        if "dr_grpo" in ALGORITHMS:
            assert _ours(trainer, batch, "token", "dr_grpo")[0].item() == pytest.approx(trl_loss.item(), abs=ATOL)


def test_token_logprobs_match_trl(tiny_dir, tmp_path, tiny):
    """Our learner's logprobs (right-padded datums, temperature-scaled) equal TRL's (left-padded
    prompts, fused LM head) on the same tokens."""
    trainer = _grpo_trainer(tiny_dir, tmp_path)
    batch = _batch(trainer)
    with torch.no_grad():
        trl_BC = _trl_logprobs(trainer, batch)
    learner = Learner(copy.deepcopy(tiny[0]), LearnerConfig(mode="full", temperature=TEMPERATURE),
                      trainer.processing_class.pad_token_id)
    datums = []
    for i in range(trl_BC.size(0)):
        prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
        completion = batch["completion_ids"][i][batch["completion_mask"][i].bool()].tolist()
        tokens = prompt + completion
        weights = [0.0] * (len(prompt) - 1) + [1.0] * len(completion)
        datums.append(Datum(tuple(tokens[:-1]), tuple(tokens[1:]), tuple(weights)))
    ours = learner.compute_logprobs(datums)
    for i, d in enumerate(datums):
        n = int(batch["completion_mask"][i].sum())
        torch.testing.assert_close(torch.tensor(ours[i][-n:]), trl_BC[i, :n], atol=ATOL, rtol=0)


@pytest.mark.parametrize("scale_rewards,ours", [("group", group_normalized), ("none", group_centered)])
def test_advantages_match_trl(tiny_dir, tmp_path, scale_rewards, ours):
    """TRL's advantages from its own generate-and-score step (real sampling, our rewards) equal
    ours per group; TRL adds 1e-4 to the std where we add 1e-6, so we pass its epsilon."""
    trainer = _grpo_trainer(tiny_dir, tmp_path, scale_rewards=scale_rewards)
    rewards = [1.0, 0.0, 0.0, 1.0, 0.2, 0.9, 0.5, 0.5]
    rows = [{"prompt": prompt_messages(q), "reward": r} for q, r in zip(["3 + 4 = ?"] * 4 + ["8 + 1 = ?"] * 4, rewards)]
    trl_adv = trainer._generate_and_score_completions(rows)["advantages"]
    rewards_GG = torch.tensor(rewards).view(2, 4)
    kwargs = {"eps": 1e-4} if ours is group_normalized else {}
    expected = torch.cat([ours(r, **kwargs) for r in rewards_GG])
    torch.testing.assert_close(trl_adv, expected, atol=ATOL, rtol=0)
    if ours is group_normalized:  # our default epsilon is a measurable difference at this tolerance
        assert (torch.cat([ours(r) for r in rewards_GG]) - trl_adv).abs().max() > ATOL


def test_dpo_sigmoid_loss_and_rewards_match_trl(tiny_dir, tmp_path):
    """DPO: TRL's sigmoid loss (no label smoothing) and its implicit rewards beta * (logp -
    ref_logp), computed by TRL one pair at a time, equal ours on the same sequence logprobs."""
    from tinker_pipelines.algorithms.dpo import dpo_sigmoid_loss

    path, tok = tiny_dir
    pairs = [("1 + 2 = ?", "3", "4"), ("5 + 5 = ?", "10", "The answer is 10."), ("7 + 1 = ?", "8 8 8", "8")]
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": q}] for q, _, _ in pairs],
                              "chosen": [[{"role": "assistant", "content": c}] for _, c, _ in pairs],
                              "rejected": [[{"role": "assistant", "content": r}] for _, _, r in pairs]})
    beta = 0.3
    args = DPOConfig(output_dir=str(tmp_path / "dpo"), beta=beta, loss_type=["sigmoid"], label_smoothing=0.0,
                     precompute_ref_log_probs=True, per_device_train_batch_size=1, bf16=False,
                     activation_checkpointing=False, use_cpu=True, report_to=[])
    trainer = DPOTrainer(model=str(path), args=args, train_dataset=data, processing_class=tok)
    trainer.model.eval()
    loader = trainer.get_train_dataloader()
    gen = torch.Generator().manual_seed(1)
    trl_losses, trl_chosen, trl_rejected, policy, ref = [], [], [], [], []
    for inputs in loader:
        # Reference logprobs of our choosing (TRL reads them from the batch when precomputed).
        inputs["ref_chosen_logps"] = inputs["ref_chosen_logps"] + torch.randn(1, generator=gen)
        inputs["ref_rejected_logps"] = inputs["ref_rejected_logps"] + torch.randn(1, generator=gen)
        with torch.no_grad():
            trl_losses.append(trainer.compute_loss(trainer.model, inputs).item())
        trl_chosen.append(trainer._metrics["eval"]["rewards/chosen"][-1])
        trl_rejected.append(trainer._metrics["eval"]["rewards/rejected"][-1])
        policy.append((trainer._metrics["eval"]["logps/chosen"][-1], trainer._metrics["eval"]["logps/rejected"][-1]))
        ref.append((inputs["ref_chosen_logps"].item(), inputs["ref_rejected_logps"].item()))
    chosen_B, rejected_B = (torch.tensor(x, dtype=torch.float64) for x in zip(*policy))
    ref_chosen_B, ref_rejected_B = (torch.tensor(x, dtype=torch.float64) for x in zip(*ref))
    losses_B, chosen_rewards_B, rejected_rewards_B = dpo_sigmoid_loss(chosen_B, rejected_B, ref_chosen_B,
                                                                      ref_rejected_B, beta)
    assert len(trl_losses) == len(pairs)
    torch.testing.assert_close(losses_B, torch.tensor(trl_losses, dtype=torch.float64), atol=ATOL, rtol=0)
    torch.testing.assert_close(chosen_rewards_B, torch.tensor(trl_chosen, dtype=torch.float64), atol=ATOL, rtol=0)
    torch.testing.assert_close(rejected_rewards_B, torch.tensor(trl_rejected, dtype=torch.float64), atol=ATOL, rtol=0)
    # The registered loss (pairs in rows 2i / 2i + 1, sequence logprobs as weighted sums) gives TRL's mean.
    interleave = lambda a, b: torch.stack([a, b], 1).reshape(-1, 1)  # noqa: E731
    mean_loss, metrics = get_algorithm("dpo").loss(interleave(chosen_B, rejected_B),
                                                   LossBatch(torch.ones(2 * len(pairs), 1),
                                                             ref_logprobs_BT=interleave(ref_chosen_B, ref_rejected_B)),
                                                   LossConfig(beta=beta))
    assert mean_loss.item() == pytest.approx(sum(trl_losses) / len(pairs), abs=ATOL)
    assert len({round(x, 3) for x in trl_losses}) == len(pairs) and not any(math.isclose(x, math.log(2)) for x in trl_losses)
