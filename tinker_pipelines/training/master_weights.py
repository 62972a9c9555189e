"""fp32 master weights for full-parameter training of a bf16 model.

Why masters and not fp32 parameters under autocast: the model the sampler runs and the model
the learner differentiates stay the same bf16 module (logprobs of the learner match the
sampler's, a resident worker keeps one copy of the weights in the dtype it serves, and
checkpoints keep the model's dtype), while the update itself is done in fp32. A bf16 update of
a bf16 weight loses anything below ~2^-8 of the weight, so at RL learning rates (1e-6 to 1e-5)
AdamW's steps would mostly round away; here they accumulate in the fp32 master and reach the
bf16 weight once they are large enough to change its rounding. This is also what DeepSpeed's
`bf16` mode does, so the two learners keep the same arithmetic and checkpoint format.

The rule: every trainable parameter that is not fp32 gets an fp32 master (a copy at creation).
Each backward's gradient of such a parameter is moved, as it is accumulated, into its master's
fp32 `.grad` (so micro-batches add up in fp32; the bf16 `.grad` stays None); clipping and AdamW
(states fp32) run on the masters; `copy_back` then rounds each master into its bf16 weight
(round to nearest even). fp32 parameters (fp32 runs, the value head) are stepped as they are:
fp32 training is unchanged bit for bit.

Masters are not derivable from the bf16 weights (their low bits are what the rounding drops), so
a checkpoint of a bf16 learner holds them in `MASTER_FILE`, keyed by parameter name.
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch

MASTER_FILE = "master_weights.safetensors"
"""The fp32 masters of a low-precision full-parameter checkpoint, beside the model's weights."""

log = logging.getLogger(__name__)


class MasterWeights:
    """The fp32 masters of `named_params`' low-precision parameters, and what the optimizer steps."""

    def __init__(self, named_params: Iterable[tuple[str, torch.nn.Parameter]]):
        self.names: list[str] = []
        """Names of the parameters that have a master, in order."""
        self.low: list[torch.nn.Parameter] = []
        """Those parameters (bf16)."""
        self.masters: list[torch.nn.Parameter] = []
        """Their fp32 masters, in the same order."""
        self.stepped: list[torch.nn.Parameter] = []
        """What the optimizer updates, one per parameter in the given order: the master of a
        low-precision parameter, an fp32 parameter itself."""
        self.rederived = 0
        """Masters last loaded from a checkpoint's low-precision weights (no masters in it): counted, logged."""
        for name, p in named_params:
            if p.dtype == torch.float32:
                self.stepped.append(p)
                continue
            master = torch.nn.Parameter(p.detach().float().clone())
            self.names.append(name)
            self.low.append(p)
            self.masters.append(master)
            self.stepped.append(master)
            _own(p, master)

    @classmethod
    def of(cls, model: torch.nn.Module) -> "MasterWeights | None":
        """Masters for `model`'s trainable parameters, or None when they are all fp32."""
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        return cls(named) if any(p.dtype != torch.float32 for _, p in named) else None

    @torch.no_grad()
    def copy_back(self) -> None:
        """Round every master into its low-precision weight."""
        for p, m in zip(self.low, self.masters):
            p.copy_(m)

    def state(self) -> dict[str, torch.Tensor]:
        """The masters by parameter name (CPU, contiguous), for a checkpoint."""
        return {n: m.detach().cpu().contiguous() for n, m in zip(self.names, self.masters)}

    @torch.no_grad()
    def load(self, masters: dict[str, torch.Tensor] | None, weights: dict[str, torch.Tensor],
             aliases: dict[str, str], where: str = "") -> None:
        """Set the masters from a checkpoint's `masters` (exact), else from its `weights` as they
        were stored (exact for an fp32 checkpoint; a bf16 one without masters loses the low bits
        of the run that wrote it: logged and counted in `rederived`), then round them into the weights.
        `aliases` are the model's tied names (`checkpoint.tied_aliases`)."""
        self.rederived = 0
        if masters is not None:
            missing = sorted(set(self.names) - set(masters))
            if missing:
                raise KeyError(f"{MASTER_FILE} lacks the masters of {missing[:3]}")
        for name, m in zip(self.names, self.masters):
            if masters is not None:
                value = masters[name]
            else:
                value = weights.get(name)
                if value is None:  # the checkpoint kept the tie under another of its names
                    value = next(weights[a] for a, first in aliases.items() if first == name and a in weights)
                self.rederived += value.dtype != torch.float32
            m.copy_(value.to(m.device, torch.float32))
        if self.rederived:
            log.warning("checkpoint %s has no %s: %d fp32 masters re-derived from its low-precision weights "
                        "(the resumed run is not bit for bit the saved one)", where, MASTER_FILE, self.rederived)
        self.copy_back()


FLOAT16_REFUSED = ("model.dtype float16 cannot be trained: there is no loss scaling, so small gradients "
                   "underflow to 0; use bfloat16 (same memory, float32's exponent range) or float32")


def refuse_float16(model: torch.nn.Module) -> None:
    """Raise `ValueError` when `model` holds float16 weights (training refuses them: `FLOAT16_REFUSED`)."""
    if any(p.dtype == torch.float16 for p in model.parameters()):
        raise ValueError(FLOAT16_REFUSED)


def _own(p: torch.nn.Parameter, master: torch.nn.Parameter) -> None:
    """Route `p`'s accumulated gradients into `master.grad` (fp32), replacing any previous owner's
    hook (a second learner on the same base, e.g. RL after an SFT warm start)."""
    release([p])

    def to_master(param: torch.Tensor) -> None:
        g = param.grad.float()
        if master.grad is None:
            master.grad = g
        else:
            master.grad.add_(g)
        param.grad = None

    p._master_hook = p.register_post_accumulate_grad_hook(to_master)  # type: ignore[attr-defined]


def release(params: Iterable[torch.nn.Parameter]) -> int:
    """Remove the master-gradient hooks from `params` (a learner that steps them itself, e.g.
    DeepSpeed, takes the base over); returns how many there were."""
    n = 0
    for p in params:
        hook = getattr(p, "_master_hook", None)
        if hook is not None:
            hook.remove()
            del p._master_hook
            n += 1
    return n
