"""Full-parameter training through DeepSpeed ZeRO (stage 2 or 3), data parallel over ranks.

`DeepSpeedLearner` has `Learner`'s interface (mode "full"). Every rank gets the same datums
(rollouts are seeded identically) and trains on its contiguous shard; each micro-batch's loss
is scaled by its share of the WHOLE batch (the plain learner's token or sequence share) times
the world size, so DeepSpeed's average over ranks is the single-process `Learner`'s gradient.
The loss-and-gradient path is the plain learner's (`training.gradient`), with the engine's
forward and `engine.backward`.
Clipping (`gradient_clipping`) and AdamW (`torch_adam: true`) are DeepSpeed's, with the
learner's hyper-parameters: the same arithmetic as `clip_grad_norm_` and `torch.optim.AdamW`.

`forward_backward`, `optim_step`, `save_state` and `load_state` are collective. ZeRO reduces
gradients (and ZeRO-3 gathers parameters) in the order the autograd graph reaches them, so every
rank runs the same graph: the same number of micro-batches (a shorter shard runs a weight-0
one) and the shared-prefix forward only when every rank's micro-batch takes it.
`compute_logprobs`, `compute_values` and sampling are local and use `.model`, full weights on
every rank: under ZeRO-2 the trained module itself; under ZeRO-3 (parameters partitioned, the
`base_model` passed in included) a replica refreshed from the gathered parameters after each
step and load, one extra copy of the weights per rank (gradients and Adam states stay partitioned).

Checkpoints have the plain full-parameter `Learner`'s format, written by rank 0 (the others wait):
HF `save_pretrained` safetensors of the consolidated weights, `value_head.safetensors`,
`optimizer.pt` holding the consolidated Adam states as a `torch.optim.AdamW.state_dict()` (a
plain `Learner` resumes from it; this learner restores it at any world size), `rng.pt` and
`record.json` (with `deepspeed: {stage, world_size}`), and for a bf16 model DeepSpeed's fp32
master weights (`master_weights.MASTER_FILE`, as the plain learner writes them, so either
resumes the other's bf16 run from the same masters). No DeepSpeed-specific state is written.

Precision follows the model: a bf16 model trains under DeepSpeed's `bf16` section (fp32 masters
and Adam states, gradients accumulated in fp32; `deepspeed_config`), fp32 as before; float16 is
refused. On CUDA each rank takes cuda:LOCAL_RANK (`distributed.rank_device`), made current before
the KL reference is copied, and joins an NCCL group (gloo on the CPU).

The process group (`init_process_group`, `is_main_process`) is set up in `distributed`, and
re-exported here.
"""
from __future__ import annotations

import copy
import functools
import hashlib
import logging
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import torch
from safetensors.torch import load_file, save_file
from transformers import PreTrainedModel

from tinker_pipelines import checkpoint as ckpt
from tinker_pipelines.algorithms.losses import LossConfig, LossFn
from tinker_pipelines.training.distributed import _deepspeed, init_process_group, is_main_process
from tinker_pipelines.training.learner import Learner, LearnerConfig, ValueHead
from tinker_pipelines.training.learner_checkpoint import VALUE_HEAD_FILE
from tinker_pipelines.training.master_weights import FLOAT16_REFUSED, MASTER_FILE, release
from tinker_pipelines.training.padding import _Padded, pad_datums
from tinker_pipelines.training.prefix_sharing import plan_prefix_sharing, supports_prefix_sharing
from tinker_pipelines.training.gradient import Account, LossSpan, Pass, Positions, accumulate_gradients
from tinker_pipelines.types import Datum

__all__ = ["DeepSpeedLearner", "deepspeed_config", "init_process_group", "is_main_process", "shard_datums"]


class _PolicyAndHead(torch.nn.Module):
    """What the engine trains: the policy and (PPO) its value head, so one ZeRO optimizer owns
    both, and a forward that is `Learner._forward`'s (the same numbers as the plain learner)."""

    def __init__(self, policy: PreTrainedModel, value_head: ValueHead | None, cfg: LearnerConfig):
        super().__init__()
        self.policy, self.value_head, self.cfg = policy, value_head, cfg

    def forward(self, padded: _Padded, values: bool, share_prefix: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.cfg = replace(self.cfg, share_prefix=share_prefix)
        return Learner._forward(self, self.policy, padded, values=values)  # reads .cfg and .value_head


@dataclass(frozen=True)
class _Shard:
    """This rank's part of a batch."""

    datums: list[Datum]
    """Contiguous block of the batch (may be empty)."""
    micro_batches: int
    """Micro-batches every rank runs (the longest shard's count)."""


def shard_datums(datums: list[Datum], rank: int, world: int, micro_batch_size: int) -> _Shard:
    """Rank `rank`'s contiguous block of ceil(N / world) datums, rounded up to an even size so a
    pairwise loss (DPO) keeps its (chosen, rejected) pairs whole.

    >>> [len(shard_datums(list(range(7)), r, 2, 3).datums) for r in (0, 1)], shard_datums([0] * 7, 1, 2, 3).micro_batches
    ([4, 3], 2)
    """
    size = math.ceil(len(datums) / world)
    size += size % 2
    mine = datums[rank * size:(rank + 1) * size]
    return _Shard(mine, math.ceil(min(size, len(datums)) / micro_batch_size))


def deepspeed_config(cfg: LearnerConfig, dtype: torch.dtype, stage: int, offload_optimizer: bool = False,
                     zero_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """DeepSpeed's config for `cfg` on a model of `dtype`: the plain learner's clipping and AdamW,
    ZeRO `stage`, and for a bf16 model a `bf16` section (DeepSpeed's fp32 master weights, the plain
    learner's `master_weights`) with gradients accumulated in fp32 as the plain learner does.
    float16 is refused (`master_weights.FLOAT16_REFUSED`: the experiment has no loss scaling).

    >>> from tinker_pipelines.training.learner import LearnerConfig
    >>> c = deepspeed_config(LearnerConfig(mode="full"), torch.bfloat16, 2)
    >>> c["bf16"], c["data_types"], "bf16" in deepspeed_config(LearnerConfig(mode="full"), torch.float32, 2)
    ({'enabled': True}, {'grad_accum_dtype': 'fp32'}, False)
    """
    if dtype == torch.float16:
        raise ValueError(FLOAT16_REFUSED)
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"model.dtype must be float32 or bfloat16 for DeepSpeed training, got {dtype}")
    zero: dict[str, Any] = {"stage": stage, **(zero_overrides or {})}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu"}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": 1,
        # step() is the accumulation boundary: forward_backward may run any number of micro-batches.
        "managed_gradient_accumulation": False,
        "gradient_clipping": cfg.grad_clip,
        "optimizer": {"type": "AdamW", "params": {"lr": cfg.learning_rate, "betas": list(cfg.betas),
                                                  "weight_decay": cfg.weight_decay, "torch_adam": True}},
        "zero_optimization": zero,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if dtype == torch.bfloat16:
        config["bf16"] = {"enabled": True}
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    return config


def check_model_on_rank_device(model_device: torch.device, rank_dev: torch.device) -> None:
    """Raise `ValueError` when the model was loaded onto another rank's GPU (every rank on cuda:0:
    load it after `distributed.set_rank_device`, or on the CPU); a CPU model is moved by DeepSpeed.

    >>> check_model_on_rank_device(torch.device("cuda", 0), torch.device("cuda", 1))
    Traceback (most recent call last):
    ...
    ValueError: the model is on cuda:0 but this rank's device is cuda:1: load it after distributed.set_rank_device() (model.device 'auto' or 'cuda')
    """
    if model_device.type == "cuda" and model_device != rank_dev:
        raise ValueError(f"the model is on {model_device} but this rank's device is {rank_dev}: load it after "
                         "distributed.set_rank_device() (model.device 'auto' or 'cuda')")


def _to_device(padded: _Padded, device: torch.device) -> _Padded:
    return _Padded(padded.inputs_BT.to(device), padded.targets_BT.to(device), padded.mask_BT.to(device),
                   {k: v.to(device) for k, v in padded.fields.items()},
                   None if padded.reference_BT is None else padded.reference_BT.to(device), padded.has_reference)


def _fingerprint(datums: list[Datum]) -> str:
    return hashlib.sha1(repr([(d.input_tokens, d.weights, d.advantages) for d in datums]).encode()).hexdigest()


class DeepSpeedLearner(Learner):
    """Trains every parameter of one policy under ZeRO `stage` 2 or 3; `model` is what the
    sampler should use (full weights on every rank)."""

    def __init__(self, base_model: PreTrainedModel, cfg: LearnerConfig, pad_token_id: int, base_name: str = "",
                 stage: int = 2, offload_optimizer: bool = False, zero_overrides: dict[str, Any] | None = None):
        """`zero_overrides` are extra keys of DeepSpeed's `zero_optimization` section."""
        if cfg.mode != "full":
            raise ValueError(f"DeepSpeed trains every parameter: training.mode must be 'full', got {cfg.mode!r}")
        if stage not in (2, 3):
            raise ValueError(f"training.deepspeed.stage must be 2 or 3 for DeepSpeedLearner, got {stage}")
        if cfg.micro_batch_tokens:  # DeepSpeed's engine fixes a micro-batch's rows in its config
            raise ValueError(f"training.micro_batch_tokens is not supported under DeepSpeed (it splits passes by "
                             f"training.micro_batch_size alone), got {cfg.micro_batch_tokens}")
        deepspeed = _deepspeed()
        dtype = next(base_model.parameters()).dtype
        config = deepspeed_config(cfg, dtype, stage, offload_optimizer, zero_overrides)  # refuses fp16 first
        # this rank's GPU is made current before anything below copies the model (the KL reference)
        rank_dev = init_process_group(next(base_model.parameters()).device)
        check_model_on_rank_device(next(base_model.parameters()).device, rank_dev)
        self.cfg, self.pad_token_id, self.base_name, self.stage = cfg, pad_token_id, base_name, stage
        self.adapter_name = "default"
        self.rank, self.world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        release(base_model.parameters())  # DeepSpeed keeps its own fp32 masters: no plain learner's hooks
        self.masters, self._low_precision = None, dtype != torch.float32
        base_model.requires_grad_(True).eval()  # no dropout: sampling and training see the same function
        self.reference = copy.deepcopy(base_model).requires_grad_(False) if cfg.needs_reference else None
        head = ValueHead(base_model.config.hidden_size) if cfg.value_head else None
        trained = _PolicyAndHead(base_model, head, cfg)
        full = copy.deepcopy(_PolicyAndHead(base_model, head, cfg)) if stage == 3 else trained
        groups = [{"params": list(base_model.parameters())}]
        if head is not None:
            groups.append({"params": list(head.parameters()), "lr": cfg.value_learning_rate or cfg.learning_rate})
        self.engine, *_ = deepspeed.initialize(model=trained, model_parameters=groups, config=config)
        self.device = self.engine.device
        self._trained, self._full = trained, (full.to(self.device).eval() if stage == 3 else full)
        self.reference = self.reference.to(self.device) if self.reference is not None else None
        self.model, self.value_head, self.params = full.policy, full.value_head, list(full.parameters())
        self.optimizer, self.steps = self.engine.optimizer, 0
        self._sync_full()

    # -- local (no collectives) -------------------------------------------------------------
    @torch.no_grad()
    def reference_logprobs(self, padded: _Padded) -> torch.Tensor:
        return super().reference_logprobs(_to_device(padded, self.device))

    def _forward(self, model, padded, positions=Positions.LOSS, values=False, **kwargs):
        return super()._forward(model, _to_device(padded, self.device), positions, values, **kwargs)

    # -- collective ---------------------------------------------------------------------------
    def forward_backward(self, datums: list[Datum], loss_fn: LossFn,
                         loss_cfg: LossConfig = LossConfig()) -> dict[str, float]:
        """Accumulate this rank's share of the gradient of `loss_fn` over `datums` (the same list on
        every rank); returns the metrics of the whole batch (the same on every rank)."""
        if not datums:
            raise ValueError("forward_backward needs at least one datum")
        fingerprints = [None] * self.world
        torch.distributed.all_gather_object(fingerprints, (len(datums), _fingerprint(datums)))
        if len(set(fingerprints)) > 1:
            raise RuntimeError(f"ranks got different datums ({[n for n, _ in fingerprints]} datums): every rank "
                               "must pass the same batch (seed rollouts identically)")
        total_w = sum(sum(d.weights) for d in datums)
        tally = Account()
        accumulate_gradients(self._shard_passes(datums, loss_fn, loss_cfg, total_w, tally), self.engine.backward)
        gathered: list[dict[str, float]] = [{}] * self.world
        torch.distributed.all_gather_object(gathered, tally.totals)
        out: dict[str, float] = {}
        for part in gathered:  # rank order: every rank adds in the same order, same floats
            for k, v in part.items():
                out[k] = out.get(k, 0.0) + v
        out["trained_tokens"] = total_w
        return out

    def _shard_passes(self, datums: list[Datum], loss_fn: LossFn, loss_cfg: LossConfig, total_w: float,
                      tally: Account) -> Iterator[Pass]:
        """This rank's passes: one per micro-batch of its shard, as many as every rank runs (a
        shorter shard ends with weight-0 `filler` passes over a datum, for the same collectives).
        Each loss is scaled by the plain learner's share of the whole batch, x world because
        DeepSpeed averages the ranks' gradients."""
        shard = shard_datums(datums, self.rank, self.world, self.cfg.micro_batch_size)
        mb = self.cfg.micro_batch_size
        for i in range(shard.micro_batches):
            chunk = shard.datums[i * mb:(i + 1) * mb]
            padded = _to_device(pad_datums(chunk or datums[:1], self.pad_token_id), self.device)
            span = LossSpan(0, len(chunk or datums[:1]), loss_fn, loss_cfg, total_w, len(datums), self.steps, tally,
                            needs_reference=self.cfg.needs_reference, values=self.value_head is not None,
                            grad_scale=float(self.world), filler=not chunk)
            yield Pass(padded, [span], functools.partial(self._engine_forward, padded),
                       functools.partial(self.reference_logprobs, padded))

    def _engine_forward(self, padded: _Padded) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The trained module's forward (collective: the shared-prefix forward only when every rank takes it)."""
        return self.engine(padded, values=self.value_head is not None, share_prefix=self._all_share_prefix(padded))

    def _all_share_prefix(self, padded: _Padded) -> bool:
        """Whether every rank's micro-batch takes the shared-prefix forward (collective). ZeRO
        reduces gradients (and ZeRO-3 gathers parameters) in the order the autograd graph reaches
        them, so all ranks must run the same graph: the shared forward runs the model twice."""
        local = (self.cfg.share_prefix and supports_prefix_sharing(self._trained.policy)
                 and plan_prefix_sharing(padded.inputs_BT, padded.mask_BT, padded.fields["weights"]) is not None)
        flag = torch.tensor([int(local)], device=self.device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return bool(flag.item())

    def optim_step(self) -> dict[str, float]:
        """Clip and apply the accumulated gradient; returns the pre-clip gradient norm."""
        self.engine.step()
        grad_norm = float(self.engine.get_global_grad_norm())
        if not math.isfinite(grad_norm) or not self.engine.was_step_applied():
            raise FloatingPointError(f"non-finite gradient norm at learner step {self.steps}; update skipped")
        self.steps += 1
        self._sync_full()
        return {"grad_norm": grad_norm}

    def _sync_full(self) -> None:
        """ZeRO-3: copy the gathered parameters into the full replica (one parameter at a time, so
        the peak is one extra parameter, not a second model)."""
        if self.stage != 3:
            return
        GatheredParameters = _deepspeed().zero.GatheredParameters

        with torch.no_grad():
            for dst, src in zip(self._full.parameters(), self._trained.parameters(), strict=True):
                with GatheredParameters([src], modifier_rank=None):
                    dst.copy_(src)

    def _set_partitioned(self, param: torch.nn.Parameter, value: torch.Tensor, key: str | None = None) -> None:
        """Overwrite DeepSpeed's fp32 master copy of `param` (key None) or its Adam state `key`."""
        from deepspeed import utils

        value = value.to(self.device, torch.float32)
        if self.stage == 2:
            if key is None:
                utils.safe_set_full_fp32_param(param, value)
            else:
                utils.safe_set_full_optimizer_state(param, value, key)
            return
        # ZeRO-3: this rank's padded slice (the full-value setter fails when the size is not a
        # multiple of the world size, e.g. the value head's bias)
        size = param.ds_tensor.numel()
        flat = torch.zeros(size * self.world, device=self.device)
        flat[:value.numel()] = value.flatten()
        local = flat[self.rank * size:(self.rank + 1) * size]
        if key is None:
            utils.safe_set_local_fp32_param(param, local)
        else:
            utils.safe_set_local_optimizer_state(param, local, key)

    def _set_full_parameter(self, param: torch.nn.Parameter, value: torch.Tensor) -> None:
        """Overwrite a trained parameter: DeepSpeed's fp32 master copy and the module's weights."""
        GatheredParameters = _deepspeed().zero.GatheredParameters

        self._set_partitioned(param, value)
        value = value.to(self.device, torch.float32)
        with torch.no_grad():
            if self.stage == 3:
                with GatheredParameters([param], modifier_rank=0):
                    param.copy_(value)
            else:
                param.copy_(value)

    def _link_adam_states(self) -> None:
        """ZeRO-1/2 links each parameter to its slice of the Adam states once, right after the step
        of the first parameter group, before the value head's group has states (DeepSpeed 0.19.8):
        link again so that the `safe_*_full_optimizer_state` calls see every group."""
        zero = self.engine.optimizer
        if hasattr(zero, "_hp_optimizer_states_linked") and zero.optimizer.state:
            zero._hp_optimizer_states_linked = False
            zero._lazy_init_hp_params_optimizer_state()

    def _adam_state(self) -> dict[str, Any]:
        """The consolidated Adam states in the plain learner's `torch.optim.AdamW.state_dict()` form
        (collective: every rank gathers, the result is complete on every rank)."""
        from deepspeed.utils import safe_get_full_optimizer_state

        self._link_adam_states()
        basic = self.engine.optimizer.optimizer
        steps = [s["step"] for s in basic.state.values() if "step" in s]
        groups = [{"params": list(self._full.policy.parameters())}]
        if self._full.value_head is not None:
            groups.append({"params": list(self._full.value_head.parameters()),
                           "lr": self.cfg.value_learning_rate or self.cfg.learning_rate})
        plain = torch.optim.AdamW(groups, lr=self.cfg.learning_rate, betas=self.cfg.betas,
                                  weight_decay=self.cfg.weight_decay)
        if steps:
            step = torch.as_tensor(steps[0], dtype=torch.float32).detach().cpu().clone()
            for full_p, p in zip(self._full.parameters(), self._trained.parameters(), strict=True):
                plain.state[full_p] = {"step": step.clone(), **{
                    k: safe_get_full_optimizer_state(p, k).detach().cpu().clone().reshape(full_p.shape)
                    for k in ("exp_avg", "exp_avg_sq")}}
        return plain.state_dict()

    def _master_state(self, module: str) -> dict[str, torch.Tensor] | None:
        """A bf16 model's fp32 masters (DeepSpeed's) of `module` ('policy' or 'value_head'), by
        parameter name; None for fp32. Collective (ZeRO-3 gathers)."""
        trained = getattr(self._trained, module)
        if not self._low_precision or trained is None:
            return None
        from deepspeed.utils import safe_get_full_fp32_param

        return {n: safe_get_full_fp32_param(p).detach().cpu().clone().reshape(full_p.shape).contiguous()
                for (n, p), full_p in zip(trained.named_parameters(), getattr(self._full, module).parameters(),
                                          strict=True)}

    def save_state(self, path: str | Path, record: dict[str, Any] | None = None,
                   extra_rng: dict[str, Any] | None = None) -> dict[str, Any]:
        """Write a plain full-parameter checkpoint (rank 0) atomically; returns its record on every
        rank. A bf16 model's checkpoint holds DeepSpeed's fp32 masters too (`MASTER_FILE`), and
        its value head's masters as the head's weights (DeepSpeed's `bf16` casts every parameter;
        the plain learner's head is fp32)."""
        optimizer, masters, head_masters = self._adam_state(), self._master_state("policy"), self._master_state(
            "value_head")
        full = None
        if self.rank == 0:
            with ckpt.atomic_directory(path) as tmp:
                # Clones: under ZeRO-2 the parameters are views of one flat buffer, which
                # save_pretrained would take for tied weights.
                state = {k: v.detach().cpu().clone() for k, v in self._full.policy.state_dict().items()}
                self._full.policy.save_pretrained(str(tmp), state_dict=state)
                if self._full.value_head is not None:
                    head = head_masters or {k: v.detach().cpu().contiguous()
                                            for k, v in self._full.value_head.state_dict().items()}
                    save_file(head, str(tmp / VALUE_HEAD_FILE))
                if masters is not None:
                    save_file(masters, str(tmp / MASTER_FILE))
                torch.save({"optimizer": optimizer, "steps": self.steps}, tmp / "optimizer.pt")
                torch.save({**ckpt.rng_state(), **(extra_rng or {})}, tmp / "rng.pt")
                full = {"mode": "full", "base_model": self.base_name, "learner": asdict(self.cfg),
                        "learner_steps": self.steps, "deepspeed": {"stage": self.stage, "world_size": self.world},
                        **(record or {})}
                full = ckpt.write_record(tmp, full)
        box = [full]
        torch.distributed.broadcast_object_list(box, src=0)  # also the barrier: rank 0 has finished writing
        return box[0]

    def load_state(self, path: str | Path) -> dict[str, Any]:
        """Restore weights, Adam states and RNG from a full-parameter checkpoint (made by this
        learner or a plain `Learner`, at any world size); returns the record. Collective."""
        path = Path(path)
        record = ckpt.read_record(path)
        if record.get("mode") != "full":
            raise ValueError(f"checkpoint {path} was trained with mode={record.get('mode')!r}, not 'full'")
        if self.value_head is not None and not (path / VALUE_HEAD_FILE).exists():
            raise ValueError(f"checkpoint {path} has no {VALUE_HEAD_FILE}, but this learner trains a value head")
        state: dict[str, torch.Tensor] = {}
        files = sorted(path.glob("model*.safetensors"))
        for f in files:
            state.update(load_file(str(f)))
        names = [n for n, _ in self._trained.policy.named_parameters()]  # one name per tie
        aliases = ckpt.tied_aliases(self._trained.policy)
        missing, unexpected = ckpt.state_fit(set(state), set(names), aliases)
        if missing or unexpected:
            raise ckpt.CheckpointError(ckpt.misfit_message(path, files, missing, unexpected))
        ckpt.check_ties(path, state, aliases)  # the tie keeps one tensor: the other one's training would be lost
        values = self._master_values(path, names, state)
        if self.value_head is not None:
            head = load_file(str(path / VALUE_HEAD_FILE))
            values += [head[n] for n, _ in self._trained.value_head.named_parameters()]
        opt = ckpt.load_torch_file(path / "optimizer.pt")
        adam: dict[int, dict[str, torch.Tensor]] = opt["optimizer"]["state"]
        basic = self.engine.optimizer.optimizer
        if adam and not basic.state:
            self._null_step()  # DeepSpeed creates the Adam states at the first step
        self._link_adam_states()
        for i, (p, v) in enumerate(zip(self._trained.parameters(), values, strict=True)):
            self._set_full_parameter(p, v)
            if basic.state:  # a checkpoint without a state for p (step 0) resets it
                for k in ("exp_avg", "exp_avg_sq"):
                    s = adam[i][k] if i in adam else torch.zeros_like(v)
                    self._set_partitioned(p, s, k)
        step = float(next(iter(adam.values()))["step"]) if adam else 0.0
        for s in basic.state.values():
            s["step"].fill_(step)
        self.steps = opt["steps"]
        self._sync_full()
        ckpt.set_rng_state(ckpt.load_torch_file(path / "rng.pt"))
        return record

    def _master_values(self, path: Path, names: list[str], state: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """What DeepSpeed's fp32 masters of the policy are set to on load: a bf16 checkpoint's saved
        masters (exact), else the stored weights (exact when they are fp32; a bf16 checkpoint
        without masters loses the low bits of the run that wrote it: logged)."""
        if self._low_precision and (path / MASTER_FILE).exists():
            masters = load_file(str(path / MASTER_FILE))
            missing = [n for n in names if n not in masters]
            if missing:
                raise ckpt.CheckpointError(f"checkpoint {path}: {MASTER_FILE} lacks the masters of {missing[:3]}")
            return [masters[n] for n in names]
        rederived = sum(state[n].dtype != torch.float32 for n in names) if self._low_precision else 0
        if rederived:
            logging.getLogger(__name__).warning(
                "checkpoint %s has no %s: %d fp32 masters re-derived from its low-precision weights (the resumed "
                "run is not bit for bit the saved one)", path, MASTER_FILE, rederived)
        return [state[n] for n in names]

    def _null_step(self) -> None:
        """One optimizer step with a zero gradient and learning rate 0 (the parameters do not
        move), so that DeepSpeed creates the Adam states that `load_state` then overwrites."""
        groups = self.engine.optimizer.optimizer.param_groups
        lrs = [g["lr"] for g in groups]
        for g in groups:
            g["lr"] = 0.0
        padded = _to_device(pad_datums([Datum((self.pad_token_id,), (self.pad_token_id,), (1.0,))],
                                       self.pad_token_id), self.device)
        lp_BT, values_BT = self.engine(padded, values=self.value_head is not None, share_prefix=False)
        zero = lp_BT.sum() * 0.0 + (values_BT.sum() * 0.0 if values_BT is not None else 0.0)
        self.engine.backward(zero)
        self.engine.step()
        for g, lr in zip(groups, lrs):
            g["lr"] = lr
