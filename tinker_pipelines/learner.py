"""The learner: one training client over a model, LoRA (PEFT) or full-parameter.

`forward_backward(datums, loss)` accumulates gradients, `optim_step()` applies them,
`save_state` / `load_state` write and restore a checkpoint that resumes bit-for-bit.
Under LoRA the KL reference is the same base with the adapter disabled, never a second copy;
full-parameter training keeps a frozen copy only when a KL penalty needs one.
"""

from __future__ import annotations

import copy
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from safetensors.torch import save_file
from transformers import PreTrainedModel

from tinker_pipelines import checkpoint as ckpt
from tinker_pipelines.algorithms.losses import LossBatch, LossConfig, LossFn
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
    micro_batch_size: int = 64
    """Sequences per forward pass; gradients accumulate across micro-batches."""
    needs_reference: bool = False
    """Whether losses get reference logprobs (a KL penalty is on)."""

    def __post_init__(self) -> None:
        if self.mode not in ("lora", "full"):
            raise ValueError(f"training.mode must be 'lora' or 'full', got {self.mode!r}")
        if not (self.learning_rate > 0 and math.isfinite(self.learning_rate)):
            raise ValueError(f"training.learning_rate must be positive, got {self.learning_rate}")
        if self.lora_rank < 1:
            raise ValueError(f"training.lora_rank must be >= 1, got {self.lora_rank}")
        if self.micro_batch_size < 1:
            raise ValueError(f"training.micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.temperature <= 0:
            raise ValueError(f"training.temperature must be positive for training, got {self.temperature}")


@dataclass
class _Padded:
    inputs_BT: torch.Tensor
    targets_BT: torch.Tensor
    mask_BT: torch.Tensor
    fields: dict[str, torch.Tensor] = field(default_factory=dict)


def pad_datums(datums: list[Datum], pad_token_id: int) -> _Padded:
    """Right-pad datums into [B, T] tensors; padding has weight 0."""
    B, T = len(datums), max(len(d.input_tokens) for d in datums)
    inputs = torch.full((B, T), pad_token_id, dtype=torch.long)
    targets = torch.zeros((B, T), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.long)
    fields = {k: torch.zeros((B, T)) for k in ("weights", "behaviour_logprobs", "advantages")}
    for i, d in enumerate(datums):
        n = len(d.input_tokens)
        inputs[i, :n] = torch.tensor(d.input_tokens)
        targets[i, :n] = torch.tensor(d.target_tokens)
        mask[i, :n] = 1
        for k in fields:
            if getattr(d, k):
                fields[k][i, :n] = torch.tensor(getattr(d, k))
    return _Padded(inputs, targets, mask, fields)


class Learner:
    """Trains one policy; `model` is what the sampler should use (the adapter applied)."""

    def __init__(self, base_model: PreTrainedModel, cfg: LearnerConfig, pad_token_id: int,
                 base_name: str = "", adapter_path: str | Path | None = None, adapter_name: str = "default"):
        """`base_model` may already be a `PeftModel`: the learner then adds its own adapter
        `adapter_name` to it, so several policies (e.g. two agents) share one resident base."""
        self.cfg, self.pad_token_id, self.base_name = cfg, pad_token_id, base_name
        self.adapter_name = adapter_name
        self.reference: PreTrainedModel | None = None
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
            elif adapter_path is not None:
                self.model = PeftModel.from_pretrained(base_model, str(adapter_path), adapter_name=adapter_name,
                                                       is_trainable=True)
            else:
                self.model = get_peft_model(base_model, lora, adapter_name=adapter_name)
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
        self.model.eval()  # no dropout: sampling and training see the same function
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.learning_rate, betas=cfg.betas,
                                           weight_decay=cfg.weight_decay)
        self.steps = 0

    def activate(self) -> None:
        """Make this learner's adapter the one the shared model applies (LoRA only)."""
        if self.cfg.mode == "lora" and self.model.active_adapter != self.adapter_name:
            self.model.set_adapter(self.adapter_name)

    def _logprobs(self, model: torch.nn.Module, padded: _Padded, only_weighted: bool = True) -> torch.Tensor:
        """Logprobs of the targets, [B, T]. With `only_weighted`, the output layer runs only from
        the first weighted position on (prompts carry no loss; at a 49k vocabulary the output
        layer and its softmax are a large share of the step); earlier positions read 0."""
        B, T = padded.inputs_BT.shape
        start = 0
        if only_weighted:
            weighted_B = padded.fields["weights"].ne(0).float().argmax(dim=1)
            start = int(weighted_B.min()) if padded.fields["weights"].any() else 0
        logits_BKV = model(input_ids=padded.inputs_BT, attention_mask=padded.mask_BT, logits_to_keep=T - start).logits
        logprobs_BKV = torch.log_softmax(logits_BKV.float() / self.cfg.temperature, dim=-1)
        lp_BK = logprobs_BKV.gather(-1, padded.targets_BT[:, start:, None]).squeeze(-1)
        return torch.nn.functional.pad(lp_BK, (start, 0)) if start else lp_BK

    @torch.no_grad()
    def reference_logprobs(self, padded: _Padded) -> torch.Tensor:
        """Logprobs of the targets under the reference policy."""
        if self.cfg.mode == "lora":
            self.activate()
            with self.model.disable_adapter():
                return self._logprobs(self.model, padded)
        if self.reference is None:
            raise RuntimeError("full-parameter learner was built without a reference (needs_reference=False)")
        return self._logprobs(self.reference, padded)

    @torch.no_grad()
    def compute_logprobs(self, datums: list[Datum]) -> list[list[float]]:
        """Current policy's logprob of every target token, per datum."""
        self.activate()
        padded = pad_datums(datums, self.pad_token_id)
        lp_BT = self._logprobs(self.model, padded, only_weighted=False)
        return [lp_BT[i, : len(d.input_tokens)].tolist() for i, d in enumerate(datums)]

    def forward_backward(self, datums: list[Datum], loss_fn: LossFn,
                         loss_cfg: LossConfig = LossConfig()) -> dict[str, float]:
        """Accumulate the gradient of `loss_fn` over `datums`; returns averaged metrics."""
        if not datums:
            raise ValueError("forward_backward needs at least one datum")
        self.activate()
        total_w = sum(sum(d.weights) for d in datums)
        totals: dict[str, float] = {}
        mb = self.cfg.micro_batch_size
        for start in range(0, len(datums), mb):
            chunk = datums[start:start + mb]
            padded = pad_datums(chunk, self.pad_token_id)
            weights_BT = padded.fields["weights"]
            ref_BT = self.reference_logprobs(padded) if self.cfg.needs_reference else None
            batch = LossBatch(weights_BT, padded.fields["behaviour_logprobs"], padded.fields["advantages"], ref_BT)
            lp_BT = self._logprobs(self.model, padded)
            loss, metrics = loss_fn(lp_BT, batch, loss_cfg)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"non-finite loss {loss.item()} at learner step {self.steps}")
            # Token-weighted share, so micro-batching does not change the gradient of a token-mean.
            share = float(weights_BT.sum()) / total_w if loss_cfg.normalization == "token" else len(chunk) / len(datums)
            (loss * share).backward()
            for k, v in {"loss": loss.item(), **metrics}.items():
                totals[k] = totals.get(k, 0.0) + v * share
        totals["trained_tokens"] = total_w
        return totals

    def optim_step(self) -> dict[str, float]:
        """Apply the accumulated gradient; returns the pre-clip gradient norm."""
        clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, clip)
        if not torch.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"non-finite gradient norm at learner step {self.steps}; update skipped")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return {"grad_norm": grad_norm.item()}

    def save_state(self, path: str | Path, record: dict[str, Any] | None = None,
                   extra_rng: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write a checkpoint atomically; returns its record (with the content hash)."""
        with ckpt.atomic_directory(path) as tmp:
            if self.cfg.mode == "lora":
                # Saved as the default adapter so `PeftModel.from_pretrained(base, path)` loads it.
                self.activate()
                state = get_peft_model_state_dict(self.model, adapter_name=self.adapter_name)
                save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "adapter_model.safetensors"))
                self.model.peft_config[self.adapter_name].save_pretrained(str(tmp))
            else:
                self.model.save_pretrained(str(tmp))
            torch.save({"optimizer": self.optimizer.state_dict(), "steps": self.steps}, tmp / "optimizer.pt")
            torch.save({**ckpt.rng_state(), **(extra_rng or {})}, tmp / "rng.pt")
            full = {"mode": self.cfg.mode, "base_model": self.base_name, "learner": asdict(self.cfg),
                    "learner_steps": self.steps, **(record or {})}
            full = ckpt.write_record(tmp, full)
        return full

    def load_state(self, path: str | Path) -> dict[str, Any]:
        """Restore weights, optimizer and RNG states from `save_state`; returns the record."""
        path = Path(path)
        record = ckpt.read_record(path)
        if record.get("mode") != self.cfg.mode:
            raise ValueError(f"checkpoint {path} was trained with mode={record.get('mode')!r}, not {self.cfg.mode!r}")
        from safetensors.torch import load_file

        if self.cfg.mode == "lora":
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self.model, load_file(str(path / "adapter_model.safetensors")),
                                      adapter_name=self.adapter_name)
        else:
            state = {}
            for f in sorted(path.glob("model*.safetensors")):
                state.update(load_file(str(f)))
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            if unexpected or [m for m in missing if not m.endswith("lm_head.weight")]:
                raise ValueError(f"checkpoint {path} does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
        opt = torch.load(path / "optimizer.pt", weights_only=True)
        self.optimizer.load_state_dict(opt["optimizer"])
        self.steps = opt["steps"]
        ckpt.set_rng_state(torch.load(path / "rng.pt", weights_only=True))
        return record
