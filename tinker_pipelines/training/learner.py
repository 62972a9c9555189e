"""The learner: one training client over a model, LoRA (PEFT) or full-parameter.

`forward_backward(datums, loss)` accumulates gradients, `optim_step()` applies them,
`save_state` / `load_state` write and restore a checkpoint that resumes bit-for-bit.
Algorithms with a critic (PPO) get a value head: a linear map from the last layer's hidden state
to one value per position, computed in the same forward as the logprobs and trained by the
same optimizer; it is saved as `value_head.safetensors` next to the adapter or weights.
Under LoRA the KL reference is the same base with the adapter disabled, never a second copy;
full-parameter training keeps a frozen copy only when a KL penalty needs one.
Full-parameter training of a bf16 model steps fp32 master weights (`master_weights`); float16
weights are refused (no loss scaling).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import PreTrainedModel

from tinker_pipelines.training import learner_checkpoint
from tinker_pipelines.training.activation_checkpointing import checkpointed_layers
from tinker_pipelines.algorithms.losses import LossConfig, LossFn
from tinker_pipelines.algorithms.tinker_losses import TinkerLoss, TinkerLossFn, tinker_forward_metrics
from tinker_pipelines.training.lora_linear import adapters_disabled, fuse_lora_layers
from tinker_pipelines.training.master_weights import MasterWeights, refuse_float16, release
from tinker_pipelines.training.padding import _Padded, loss_batch, pad_datums
from tinker_pipelines.training.prefix_sharing import (PrefixPlan, plan_prefix_sharing, shared_prefix_forward,
                                             supports_prefix_sharing)
from tinker_pipelines.rollout.truncation import target_logprobs
from tinker_pipelines.training.rules import adam_settings, check_learner_settings
from tinker_pipelines.training.gradient import (Account, LossSpan, Pass, Positions, accumulate_gradients,
                                                micro_batches, own_metrics, pass_positions)
from tinker_pipelines.types import Datum


@dataclass(frozen=True)
class LearnerConfig:
    """How parameters are trained."""

    mode: str = "lora"
    """'lora' (a PEFT adapter on a frozen base) or 'full' (every parameter)."""
    learning_rate: float = 1e-4
    """Adam learning rate."""
    lora_rank: int = 8
    """LoRA rank r."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator (the update is scaled by alpha / r)."""
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """Module names that get adapters."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""
    temperature: float = 1.0
    """Sampling temperature: logits are divided by it so logprobs match the sampler's."""
    top_k: int = 0
    """The sampler's top-k (0: off): logprobs are those of the same truncated, renormalized
    distribution (`rollout.truncation.target_logprobs`)."""
    top_p: float = 1.0
    """The sampler's top-p (1.0: off), likewise."""
    min_p: float = 0.0
    """The sampler's min-p (0.0: off), likewise."""
    micro_batch_size: int = 64
    """Sequences per forward pass; gradients accumulate across micro-batches."""
    micro_batch_tokens: int = 0
    """Padded tokens (rows x longest) per forward pass at most, beside `micro_batch_size` (0: no
    bound): a pass's activations grow with its tokens, whatever their rows."""
    needs_reference: bool = False
    """Whether losses get reference logprobs (a KL penalty is on)."""
    value_head: bool = False
    """Train a value head beside the policy (the algorithm is registered with value_head=True)."""
    value_learning_rate: float = 0.0
    """Adam learning rate of the value head (0: `learning_rate`)."""
    share_prefix: bool = True
    """Run a prefix shared by consecutive datums (a group's prompt) once per micro-batch run (same result)."""
    gradient_checkpointing: bool = False
    """Keep one hidden state per decoder layer and recompute the rest in backward (same gradient,
    far less activation memory, about one more forward of compute: `activation_checkpointing`)."""

    def __post_init__(self) -> None:
        check_learner_settings(mode=self.mode, learning_rate=self.learning_rate, lora_rank=self.lora_rank,
                               lora_alpha=self.lora_alpha, micro_batch_size=self.micro_batch_size,
                               micro_batch_tokens=self.micro_batch_tokens,
                               temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
                               value_learning_rate=self.value_learning_rate)


@contextlib.contextmanager
def _seeded(seed: int | None, device: torch.device):
    """Run the block from the global RNG seeded with `seed`, restoring it afterwards (no-op for None)."""
    if seed is None:
        yield
        return
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


class ValueHead(torch.nn.Module):
    """One scalar per position from the policy's final hidden state. Starts at zero, so the first
    values are 0 whatever the seed and the critic learns from the returns it sees."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.zeros_(self.linear.weight)
        torch.nn.init.zeros_(self.linear.bias)

    def forward(self, hidden_BTH: torch.Tensor) -> torch.Tensor:
        # fp32 here; bf16 only under DeepSpeed's `bf16`, which casts every trained parameter
        w = self.linear.weight
        return self.linear(hidden_BTH.to(w.dtype)).float().squeeze(-1)


class Learner:
    """Trains one policy; `model` is what the sampler should use (the adapter applied)."""

    def __init__(self, base_model: PreTrainedModel, cfg: LearnerConfig, pad_token_id: int,
                 base_name: str = "", adapter_path: str | Path | None = None, adapter_name: str = "default",
                 init_seed: int | None = None):
        """`base_model` may already be a `PeftModel`: the learner then adds its own adapter
        `adapter_name` to it, so several policies (e.g. two agents) share one resident base.
        With `init_seed`, a new adapter is initialised from that seed alone (not from the global
        RNG), so it is the same whichever adapters were created before it in this process."""
        self.cfg, self.pad_token_id, self.base_name = cfg, pad_token_id, base_name
        self.adapter_name = adapter_name
        self.reference: PreTrainedModel | None = None
        self.device = next(base_model.parameters()).device
        refuse_float16(base_model)
        with _seeded(init_seed, self.device):
            self._build(base_model, cfg, adapter_path, adapter_name)
        self.model.eval()  # no dropout: sampling and training see the same function
        self.value_head: ValueHead | None = None
        # full-parameter bf16: the optimizer steps fp32 masters (`master_weights`); fp32 and LoRA
        # (PEFT keeps adapters fp32) step the parameters themselves
        self.masters = MasterWeights.of(self.model) if cfg.mode == "full" else None
        self._stepped = list(self.masters.stepped if self.masters is not None else self.params)
        self._policy_stepped = list(self._stepped)
        groups = [{"params": list(self._stepped)}]
        if cfg.value_head:
            self.value_head = ValueHead(self.model.config.hidden_size).to(self.device)
            head = list(self.value_head.parameters())
            self.params += head
            self._stepped += head
            groups.append({"params": head, "lr": cfg.value_learning_rate or cfg.learning_rate})
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=cfg.betas,
                                           weight_decay=cfg.weight_decay)
        self.steps = 0

    def _build(self, base_model: PreTrainedModel, cfg: LearnerConfig, adapter_path: str | Path | None,
               adapter_name: str) -> None:
        if cfg.mode == "lora":
            lora = None
            if adapter_path is None:
                targets = [t for t in cfg.lora_targets if any(n.endswith(t) for n, _ in base_model.named_modules())]
                if not targets:
                    raise ValueError(f"training.lora_targets {list(cfg.lora_targets)} match no module of the model")
                lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=targets,
                                  lora_dropout=0.0, task_type="CAUSAL_LM")
            if isinstance(base_model, PeftModel):
                self.model = base_model
                if adapter_path is not None:
                    self.model.load_adapter(str(adapter_path), adapter_name=adapter_name, is_trainable=True)
                else:
                    self.model.add_adapter(adapter_name, lora)
                # PEFT keeps the previous active adapter (a stale name once it was deleted): make
                # this one active in every layer, or its forward would skip the adapter.
                self.model.set_adapter(adapter_name)
            elif adapter_path is not None:
                self.model = PeftModel.from_pretrained(base_model, str(adapter_path), adapter_name=adapter_name,
                                                       is_trainable=True)
            else:
                self.model = get_peft_model(base_model, lora, adapter_name=adapter_name)
            fuse_lora_layers(self.model)
            self.activate()
            marker = f".{adapter_name}."
            self.params = [p for n, p in self.model.named_parameters() if "lora_" in n and marker in n]
            for p in self.params:
                p.requires_grad_(True)
        else:
            self.model = base_model
            for p in self.model.parameters():
                p.requires_grad_(True)
            if cfg.needs_reference:
                self.reference = copy.deepcopy(base_model).eval().requires_grad_(False)
            self.params = [p for p in self.model.parameters() if p.requires_grad]

    def activate(self) -> None:
        """Make this learner's adapter the one the shared model applies (LoRA only)."""
        if self.cfg.mode == "lora" and self.model.active_adapter != self.adapter_name:
            self.model.set_adapter(self.adapter_name)

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the policy computes in (its base weights'; `TrainingClient.dtype`)."""
        return self.model.get_input_embeddings().weight.dtype

    def _logprobs(self, model: torch.nn.Module, padded: _Padded, positions: Positions = Positions.LOSS) -> torch.Tensor:
        """Logprobs of the targets, [B, T] (see `_forward`)."""
        return self._forward(model, padded, positions)[0]

    def _forward(self, model: torch.nn.Module, padded: _Padded, *args,
                 **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`_run_forward`, with the decoder layers checkpointed when `cfg.gradient_checkpointing`
        asks for it and gradients are on."""
        with checkpointed_layers(model, enabled=self.cfg.gradient_checkpointing and torch.is_grad_enabled()):
            # not self._run_forward: DeepSpeed's engine module calls this with itself as `self`
            return Learner._run_forward(self, model, padded, *args, **kwargs)

    def _run_forward(self, model: torch.nn.Module, padded: _Padded, positions: Positions = Positions.LOSS,
                     values: bool = False, *, temperature: float | torch.Tensor | None = None,
                     truncation: tuple | None = None,
                     head: Callable[[torch.Tensor], torch.Tensor] | None = None,
                     plan: PrefixPlan | None | str = "auto",
                     sampled_support: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprobs of the targets and, with `values`, the value head's values, both [B, T], at the
        `positions` asked for (`gradient.Positions`). Skipping what carries no loss pays: at a 49k
        vocabulary the output layer and its softmax are a large share of the step, and a group's
        prompt is most of each row. With `cfg.share_prefix`, a prompt shared by consecutive datums
        runs once per run of them (`prefix_sharing`, the same function); values read 0 there. A
        batch of several experiments' rows (`worker.batching`) passes a per-row `temperature`
        [B, 1, 1] and `truncation` (top_k, top_p, min_p) [B, 1], its own `head` and the prefix
        `plan` it made. Logprobs are of the sampling distribution: logits / temperature, truncated
        and renormalized as the sampler does (`target_logprobs`): over as many tokens as the
        sampler kept where the datums record it (`Datum.support_sizes`; the reference,
        `sampled_support=False`, recomputes its cut from the parameters)."""
        B, T = padded.inputs_BT.shape
        weights_BT = padded.fields["weights"]
        temperature = self.cfg.temperature if temperature is None else temperature
        if truncation is None:
            truncation = (self.cfg.top_k, self.cfg.top_p, self.cfg.min_p)
        head = (self.value_head if values else None) if head is None else head
        support_BT = padded.fields.get("support_sizes") if sampled_support else None
        if support_BT is not None and not bool(support_BT.any()):
            support_BT = None
        if positions is Positions.RETURNED and not bool(weights_BT.any()):
            with torch.no_grad():  # no position carries loss: nothing to differentiate
                return Learner._run_forward(self, model, padded, Positions.ALL, values, temperature=temperature,
                                            truncation=truncation, head=head, plan=None,
                                            sampled_support=sampled_support)
        if positions is not Positions.ALL and self.cfg.share_prefix and supports_prefix_sharing(model):
            if isinstance(plan, str):
                plan = plan_prefix_sharing(padded.inputs_BT, padded.mask_BT, weights_BT)
            if plan is not None:
                return shared_prefix_forward(model, plan, padded.inputs_BT, padded.targets_BT, weights_BT,
                                             temperature, head, truncation=truncation, support_BT=support_BT,
                                             every_position=positions is Positions.RETURNED)
        start = 0
        if positions is Positions.LOSS and bool(weights_BT.any()):
            start = int(weights_BT.ne(0).float().argmax(dim=1).min())
        out = model(input_ids=padded.inputs_BT, attention_mask=padded.mask_BT, logits_to_keep=T - start,
                    output_hidden_states=head is not None)
        lp_BK = target_logprobs(out.logits, padded.targets_BT[:, start:], temperature, *truncation,
                                support_BK=support_BT[:, start:] if support_BT is not None else None)
        v_BK = head(out.hidden_states[-1][:, start:]) if head is not None else None
        if start:
            lp_BK = torch.nn.functional.pad(lp_BK, (start, 0))
            v_BK = torch.nn.functional.pad(v_BK, (start, 0)) if v_BK is not None else None
        return lp_BK, v_BK

    @torch.no_grad()
    def reference_logprobs(self, padded: _Padded) -> torch.Tensor:
        """Logprobs of the targets under the reference policy."""
        if self.cfg.mode == "lora":
            self.activate()
            with adapters_disabled(self.model):
                return self._forward(self.model, padded, sampled_support=False)[0]
        if self.reference is None:
            raise RuntimeError("full-parameter learner was built without a reference (needs_reference=False)")
        return self._forward(self.reference, padded, sampled_support=False)[0]

    def micro_batches(self, datums: list[Datum]) -> list[list[Datum]]:
        """The forward passes a call over `datums` runs, in order (bounded by `cfg.micro_batch_size`
        and `cfg.micro_batch_tokens`)."""
        return micro_batches(datums, self.cfg.micro_batch_size, self.cfg.micro_batch_tokens)

    @torch.no_grad()
    def compute_reference_logprobs(self, datums: list[Datum]) -> list[list[float]]:
        """The reference policy's logprob of every target token, per datum (0 before the first
        weighted position of its micro-batch), in the micro-batches `forward_backward` would use
        on the same list: attach them to the datums (`Datum.reference_logprobs`) so that several
        passes over one batch run the reference forward once."""
        self.activate()
        out: list[list[float]] = []
        for chunk in self.micro_batches(datums):
            ref_BT = self.reference_logprobs(pad_datums(chunk, self.pad_token_id, self.device))
            out += [ref_BT[i, : len(d.input_tokens)].tolist() for i, d in enumerate(chunk)]
        return out

    @torch.no_grad()
    def compute_logprobs(self, datums: list[Datum]) -> list[list[float]]:
        """Current policy's logprob of every target token, per datum."""
        self.activate()
        padded = pad_datums(datums, self.pad_token_id, self.device)
        lp_BT = self._logprobs(self.model, padded, Positions.ALL)
        return [lp_BT[i, : len(d.input_tokens)].tolist() for i, d in enumerate(datums)]

    @torch.no_grad()
    def compute_values(self, datums: list[Datum]) -> list[list[float]]:
        """The value head's estimate at every position, per datum (0 before the first weighted
        position of the micro-batch)."""
        if self.value_head is None:
            raise RuntimeError("this learner has no value head (LearnerConfig.value_head=False)")
        self.activate()
        out: list[list[float]] = []
        for chunk in self.micro_batches(datums):
            _, v_BT = self._forward(self.model, pad_datums(chunk, self.pad_token_id, self.device), values=True)
            out += [v_BT[i, : len(d.input_tokens)].tolist() for i, d in enumerate(chunk)]
        return out

    def forward_backward(self, datums: list[Datum], loss_fn: LossFn,
                         loss_cfg: LossConfig = LossConfig()) -> dict[str, float]:
        """Accumulate the gradient of `loss_fn` over `datums`, one pass of `training.gradient` per
        micro-batch; returns the batch's metrics. A non-finite loss discards the call's gradient."""
        return self._accumulate(datums, loss_fn, loss_cfg, Account())

    def tinker_forward_backward(self, datums: list[Datum], loss: TinkerLoss,
                                forward_only: bool = False) -> tuple[list[list[float]], dict[str, float]]:
        """Tinker's `forward_backward` (or its forward, `forward_only`: no gradient work): each
        datum's target logprobs and Tinker's metrics (`loss:sum`). The datums are
        `algorithms.tinker_losses.datum_from_tinker`'s; the loss is a sum over their tokens, so the
        micro-batch size does not change the gradient."""
        if forward_only:
            logprobs = self.compute_logprobs(datums)
            return logprobs, tinker_forward_metrics(loss, datums, logprobs)
        tally = Account(logprobs=[])
        metrics = self._accumulate(datums, TinkerLossFn(loss), LossConfig(), tally)
        return tally.logprobs, metrics  # type: ignore[return-value]

    def _accumulate(self, datums: list[Datum], loss_fn: LossFn, loss_cfg: LossConfig,
                    tally: Account) -> dict[str, float]:
        if not datums:
            raise ValueError("forward_backward needs at least one datum")
        self.activate()
        total_w = sum(sum(d.weights) for d in datums)
        try:
            backpropagated = accumulate_gradients(self._passes(datums, loss_fn, loss_cfg, total_w, tally))
        except FloatingPointError:
            self.optimizer.zero_grad(set_to_none=True)
            raise
        if not backpropagated:  # no pass had a weighted position: the policy's gradient is 0, which
            for p in self._policy_stepped:  # Adam steps with (its moments move), unlike a missing one
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        if not own_metrics(loss_fn):
            tally.totals["trained_tokens"] = total_w
        return tally.totals

    def _passes(self, datums: list[Datum], loss_fn: LossFn, loss_cfg: LossConfig, total_w: float,
                tally: Account) -> Iterator[Pass]:
        """One pass per micro-batch, padded as it is reached (one micro-batch's tensors at a time)."""
        positions = pass_positions([tally])
        for chunk in self.micro_batches(datums):
            padded = pad_datums(chunk, self.pad_token_id, self.device)
            span = LossSpan(0, len(chunk), loss_fn, loss_cfg, total_w, len(datums), self.steps, tally,
                            needs_reference=self.cfg.needs_reference, values=self.value_head is not None)
            yield Pass(padded, [span], functools.partial(self._forward, self.model, padded, positions,
                                                         values=span.values),
                       functools.partial(self.reference_logprobs, padded))

    def optim_step(self, adam: Mapping[str, float] | None = None) -> dict[str, float]:
        """Apply the accumulated gradient; returns the pre-clip gradient norm. With fp32 masters
        (a bf16 full-parameter model) the clip and the step are the masters', then the bf16
        weights are rounded from them. `adam` (Tinker's `AdamParams`: learning_rate, beta1, beta2,
        eps, weight_decay, grad_clip_norm with 0 = no clipping) sets every parameter group's
        settings for this step and the ones after it, and replaces `cfg.grad_clip` for this step."""
        clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        if adam is not None:
            settings = adam_settings(adam)
            clip = settings.pop("grad_clip_norm") or float("inf")
            for group in self.optimizer.param_groups:
                group.update(settings)
        grad_norm = torch.nn.utils.clip_grad_norm_(self._stepped, clip)
        if not torch.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"non-finite gradient norm at learner step {self.steps}; update skipped")
        self.optimizer.step()
        if self.masters is not None:
            self.masters.copy_back()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        if adam is None:
            return {"grad_norm": grad_norm.item()}
        return {"grad_norm": grad_norm.item(), "learning_rate": settings["lr"]}

    def close(self) -> None:
        """Let go of the model's parameters: the fp32 masters' gradient hooks (which keep the
        masters alive) are removed. Call when the base outlives the learner (after an SFT warm
        start, when a worker drops a full-parameter experiment)."""
        if self.masters is not None:
            release(self.masters.low)

    def zero_grad(self) -> None:
        """Drop every accumulated gradient (the fp32 masters' included)."""
        for p in self.params:
            p.grad = None
        self.optimizer.zero_grad(set_to_none=True)

    def save_state(self, path: str | Path, record: dict[str, Any] | None = None,
                   extra_rng: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write a checkpoint atomically; returns its record (with the content hash)."""
        return learner_checkpoint.save_state(self, path, record, extra_rng)

    def verify_checkpoint(self, path: str | Path, probe_tokens: list[int]) -> dict[str, Any]:
        """Check a checkpoint this learner wrote against the resident weights (`learner_checkpoint.verify`)."""
        return learner_checkpoint.verify(self, path, probe_tokens)

    def load_state(self, path: str | Path, optimizer: bool = True) -> dict[str, Any]:
        """Restore weights, optimizer and RNG states from `save_state`; returns the record.
        `optimizer=False`: the weights only (a fresh optimizer state, RNG untouched)."""
        return learner_checkpoint.load_state(self, path, optimizer)
