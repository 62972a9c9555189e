"""Tinker's built-in losses, as the Tinker API defines them: `cross_entropy`, `importance_sampling`,
`ppo`, `cispo` and `dro`, selected by name with their `loss_fn_config`.

These differ from `losses.py` on purpose, because a Tinker client relies on it:
- the reduction is a plain SUM over every token of every datum (no mean, no mask other than what
  the client put in `weights` or `advantages`); Tinker reports it as the metric `loss:sum`;
- the inputs are a datum's `loss_fn_inputs` as Tinker names them: `target_tokens`, `weights`
  (cross_entropy only), `logprobs` (the SAMPLING logprobs) and `advantages`, each of shape (N,).

Because the loss is a sum, the datums of a request can be concatenated: every function here
takes 1-D tensors over the N tokens of one datum or of many (`_N`), with `target_logprobs_N` the
current model's logprobs of `target_tokens`. Half-precision logprobs are computed in fp32
(`_compute_dtype`); fp32 and fp64 inputs are computed in their own dtype.

Sources: https://tinker-docs.thinkingmachines.ai/losses (and /tinker/losses/{ppo,cispo,dro}),
tinker-cookbook docs/losses.mdx and tutorials/202_loss_functions.py, tinker==0.38.0
`tinker/types/loss_fn_type.py` (the names) and `training_client.py` (`loss:sum`, custom losses).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch

from tinker_pipelines.algorithms.losses import LossBatch, LossConfig
from tinker_pipelines.types import Datum

Metrics = dict[str, float]


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for bf16/fp16 (exp of a bf16 log-ratio is off by ~1%), else the input's own dtype."""
    return torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype


def _up(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x if x.dtype == dtype else x.to(dtype)


def _result(elementwise_loss_N: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
    loss = elementwise_loss_N.sum()
    return loss, {"loss:sum": loss.item()}


def cross_entropy(target_logprobs_N: torch.Tensor, weights_N: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
    """sum(-target_logprobs * weights). Weights may be any float: the SDK's
    `forward_backward_custom` sends weights = -dC/dlogprobs through this loss.

    >>> loss, m = cross_entropy(torch.tensor([-1.0, -2.0, -4.0]), torch.tensor([0.0, 1.0, 0.5]))
    >>> loss.item(), m
    (4.0, {'loss:sum': 4.0})
    """
    dtype = _compute_dtype(target_logprobs_N)
    return _result(-_up(target_logprobs_N, dtype) * _up(weights_N, dtype))


def importance_sampling(target_logprobs_N: torch.Tensor, sampling_logprobs_N: torch.Tensor,
                        advantages_N: torch.Tensor) -> tuple[torch.Tensor, Metrics]:
    """REINFORCE corrected for sampler/learner mismatch: sum(-exp(target - sampling) * A).

    >>> loss, _ = importance_sampling(torch.tensor([0.0, -1.0]), torch.tensor([0.0, -1.0]), torch.tensor([2.0, -3.0]))
    >>> loss.item()  # ratios 1: -(2 - 3)
    1.0
    """
    dtype = _compute_dtype(target_logprobs_N)
    prob_ratio_N = torch.exp(_up(target_logprobs_N, dtype) - _up(sampling_logprobs_N, dtype))
    return _result(-(prob_ratio_N * _up(advantages_N, dtype)))


def ppo(target_logprobs_N: torch.Tensor, sampling_logprobs_N: torch.Tensor, advantages_N: torch.Tensor,
        clip_low_threshold: float, clip_high_threshold: float) -> tuple[torch.Tensor, Metrics]:
    """sum(-min(ratio * A, clamp(ratio, clip_low_threshold, clip_high_threshold) * A)). The
    thresholds bound the ratio itself (0.8 and 1.2 mean eps = 0.2), not an epsilon.

    >>> lp = torch.tensor([math.log(1.5), math.log(0.5)]); adv = torch.tensor([1.0, -1.0])
    >>> round(ppo(lp, torch.zeros(2), adv, 0.8, 1.2)[0].item(), 6)  # -(1.2 * 1 + 0.8 * -1)
    -0.4
    """
    dtype = _compute_dtype(target_logprobs_N)
    adv_N = _up(advantages_N, dtype)
    prob_ratio_N = torch.exp(_up(target_logprobs_N, dtype) - _up(sampling_logprobs_N, dtype))
    clipped_ratio_N = torch.clamp(prob_ratio_N, clip_low_threshold, clip_high_threshold)
    return _result(-torch.min(prob_ratio_N * adv_N, clipped_ratio_N * adv_N))


def cispo(target_logprobs_N: torch.Tensor, sampling_logprobs_N: torch.Tensor, advantages_N: torch.Tensor,
          clip_low_threshold: float, clip_high_threshold: float) -> tuple[torch.Tensor, Metrics]:
    """sum(-sg(clamp(ratio, low, high)) * target_logprobs * A): the clipped ratio is a constant
    coefficient, so every token keeps a gradient of -clipped_ratio * A.

    >>> lp = torch.tensor([math.log(2.0)]); loss, _ = cispo(lp, torch.zeros(1), torch.tensor([1.0]), 0.0, 1.5)
    >>> round(loss.item(), 6) == round(-1.5 * math.log(2.0), 6)
    True
    """
    dtype = _compute_dtype(target_logprobs_N)
    target_N = _up(target_logprobs_N, dtype)
    prob_ratio_N = torch.exp(target_N - _up(sampling_logprobs_N, dtype))
    clipped_ratio_N = torch.clamp(prob_ratio_N, clip_low_threshold, clip_high_threshold)
    return _result(-(clipped_ratio_N.detach() * target_N * _up(advantages_N, dtype)))


def dro(target_logprobs_N: torch.Tensor, sampling_logprobs_N: torch.Tensor, advantages_N: torch.Tensor,
        beta: float) -> tuple[torch.Tensor, Metrics]:
    """sum(-(target_logprobs * A - 0.5 * beta * (target_logprobs - sampling_logprobs)^2)). The
    quadratic term applies on every position, including those whose advantage is 0.

    >>> loss, _ = dro(torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([2.0]), 0.5)
    >>> loss.item()  # -(-2 - 0.5 * 0.5 * 4)
    3.0
    """
    dtype = _compute_dtype(target_logprobs_N)
    target_N = _up(target_logprobs_N, dtype)
    quadratic_term_N = (target_N - _up(sampling_logprobs_N, dtype)) ** 2
    return _result(-(target_N * _up(advantages_N, dtype) - 0.5 * beta * quadratic_term_N))


class TinkerLossError(ValueError):
    """A request the Tinker service must refuse; `field` names what is wrong (the loss name,
    a `loss_fn_config` key or a `loss_fn_inputs` key), for the error body the SDK surfaces."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class TinkerLossSpec:
    """What one named Tinker loss reads and accepts."""

    name: str
    """The `loss_fn` string a client sends."""
    fn: Callable[..., tuple[torch.Tensor, Metrics]]
    """The loss over concatenated tokens; config values are passed as keyword arguments."""
    inputs: tuple[str, ...]
    """The `loss_fn_inputs` keys every datum must carry, exactly (Tinker's names)."""
    config_defaults: Mapping[str, float | None] = field(default_factory=dict)
    """The `loss_fn_config` keys it accepts and their defaults; None means the key is required."""
    advantage_gated: bool = False
    """Whether a token whose advantage is 0 adds exactly 0 to the loss and to its gradient (every
    term is a multiple of the advantage): such tokens get weight 0 (`datum_from_tinker`), so a
    prompt shared by a group's samples runs once and without gradient."""


_RL_INPUTS = ("target_tokens", "logprobs", "advantages")

TINKER_LOSSES: dict[str, TinkerLossSpec] = {
    spec.name: spec for spec in (
        TinkerLossSpec("cross_entropy", cross_entropy, ("target_tokens", "weights")),
        TinkerLossSpec("importance_sampling", importance_sampling, _RL_INPUTS, advantage_gated=True),
        # ppo: "currently fixed to 0.2" in the losses doc, i.e. ratio bounds 0.8 and 1.2 (tutorial 202)
        TinkerLossSpec("ppo", ppo, _RL_INPUTS, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
                       advantage_gated=True),
        # cispo: one-sided by default (tutorial 202's current revision; earlier revisions said 0.8/1.2)
        TinkerLossSpec("cispo", cispo, _RL_INPUTS, {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
                       advantage_gated=True),
        # dro: Tinker documents `beta` but no default value, so a client must send it; its
        # quadratic term applies where the advantage is 0, so it is not advantage-gated
        TinkerLossSpec("dro", dro, _RL_INPUTS, {"beta": None}),
    )
}
"""The losses this service runs, by Tinker name. Tinker's other names (`gspo`,
`stable_reinforce`, server-side `custom`) are refused by `tinker_loss`."""


def _supported() -> str:
    return ", ".join(TINKER_LOSSES)


def _number(name: str, key: str, value: object) -> float:
    # the wire carries float | str (LossConfigValue.number / .text); bool is not a number here
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TinkerLossError(f"loss_fn_config.{key} for loss_fn {name!r} must be a finite number, got {value!r}",
                              f"loss_fn_config.{key}")
    return float(value)


@dataclass(frozen=True)
class TinkerLoss:
    """A named Tinker loss with its validated `loss_fn_config` (defaults filled in)."""

    spec: TinkerLossSpec
    """Which loss."""
    config: Mapping[str, float]
    """Every config value the loss uses, the client's or the default."""

    @property
    def name(self) -> str:
        return self.spec.name

    def check_inputs(self, loss_fn_inputs: Mapping[str, torch.Tensor], datum_index: int | None = None) -> int:
        """Check one datum's `loss_fn_inputs`: exactly the loss's keys, all 1-D of one length N,
        `target_tokens` integer and the others floating point. Returns N. A `cross_entropy`
        datum's `target_tokens` and `weights` may instead both be (N, K), soft targets
        (`soft_target_columns`)."""
        where = "" if datum_index is None else f"data[{datum_index}]."
        if self.name == "cross_entropy" and all(k in loss_fn_inputs for k in self.spec.inputs) \
                and loss_fn_inputs["target_tokens"].dim() == 2:
            return _check_soft_targets(loss_fn_inputs, where)
        missing = [k for k in self.spec.inputs if k not in loss_fn_inputs]
        extra = sorted(k for k in loss_fn_inputs if k not in self.spec.inputs)
        if missing or extra:
            bad = missing[0] if missing else extra[0]
            what = "is missing" if missing else "is not an input of this loss"
            raise TinkerLossError(f"{where}loss_fn_inputs.{bad} {what}; loss_fn {self.name!r} takes exactly: "
                                  f"{', '.join(self.spec.inputs)}", f"{where}loss_fn_inputs.{bad}")
        length = None
        for key in self.spec.inputs:
            t = loss_fn_inputs[key]
            integral = key == "target_tokens"
            ok_dtype = (not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool) if integral \
                else t.is_floating_point()
            if t.dim() != 1 or not ok_dtype or (length is not None and t.shape[0] != length):
                want = "int" if integral else "float"
                raise TinkerLossError(f"{where}loss_fn_inputs.{key} must be a 1-D {want} tensor of the datum's length"
                                      f"{'' if length is None else f' {length}'}, got {t.dtype} {tuple(t.shape)}",
                                      f"{where}loss_fn_inputs.{key}")
            length = t.shape[0]
        return int(length)

    def __call__(self, target_logprobs_N: torch.Tensor,
                 loss_fn_inputs: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, Metrics]:
        """The loss and Tinker's metrics over tokens whose `loss_fn_inputs` are concatenated
        datums (checked with `check_inputs` first, per datum)."""
        if self.name == "cross_entropy":
            return cross_entropy(target_logprobs_N, loss_fn_inputs["weights"])
        return self.spec.fn(target_logprobs_N, loss_fn_inputs["logprobs"], loss_fn_inputs["advantages"],
                            **self.config)


MAX_SOFT_TARGETS = 20
"""Most columns K of a soft-target `cross_entropy` datum: each column is a datum of its own on the
worker (`soft_target_columns`), so K bounds its cost, as `wire.MAX_TOPK_LOGPROBS` bounds the
teacher's top-K that such targets come from (tinker-cookbook's distillation default, 20)."""


def _check_soft_targets(loss_fn_inputs: Mapping[str, torch.Tensor], where: str) -> int:
    """`check_inputs` for (N, K) `target_tokens` (integers) and `weights` (floats) of one shape."""
    targets_NK, weights_NK = loss_fn_inputs["target_tokens"], loss_fn_inputs["weights"]
    if targets_NK.is_floating_point() or targets_NK.is_complex() or targets_NK.dtype == torch.bool:
        raise TinkerLossError(f"{where}loss_fn_inputs.target_tokens must be integers, got {targets_NK.dtype}",
                              f"{where}loss_fn_inputs.target_tokens")
    if not 1 <= targets_NK.shape[1] <= MAX_SOFT_TARGETS:
        raise TinkerLossError(f"{where}loss_fn_inputs.target_tokens of shape (N, K) must have 1 <= K <= "
                              f"{MAX_SOFT_TARGETS} soft targets, got {tuple(targets_NK.shape)}",
                              f"{where}loss_fn_inputs.target_tokens")
    if not weights_NK.is_floating_point() or weights_NK.shape != targets_NK.shape:
        raise TinkerLossError(f"{where}loss_fn_inputs.weights must be a float tensor of target_tokens' shape "
                              f"{tuple(targets_NK.shape)}, got {weights_NK.dtype} {tuple(weights_NK.shape)}",
                              f"{where}loss_fn_inputs.weights")
    return int(targets_NK.shape[0])


def soft_target_columns(loss_fn_inputs: Mapping[str, torch.Tensor]) -> list[dict[str, torch.Tensor]] | None:
    """A `cross_entropy` datum with (N, K) `target_tokens` and `weights` (checked by
    `check_inputs`), as the inputs of K datums over the same tokens, column k's targets and
    weights each: the loss is a sum, so theirs (and its gradient) is the (N, K) datum's,
    -sum(weights_NK * logprobs_NK). None for a datum of shape (N,).

    >>> cols = soft_target_columns({"target_tokens": torch.tensor([[5, 6], [7, 8]]),
    ...                             "weights": torch.tensor([[0.75, 0.25], [1.0, 0.0]])})
    >>> [c["target_tokens"].tolist() for c in cols], [c["weights"].tolist() for c in cols]
    ([[5, 7], [6, 8]], [[0.75, 1.0], [0.25, 0.0]])
    """
    targets_NK = loss_fn_inputs["target_tokens"]
    if targets_NK.dim() != 2:
        return None
    weights_NK = loss_fn_inputs["weights"]
    return [{"target_tokens": targets_NK[:, k].contiguous(), "weights": weights_NK[:, k].contiguous()}
            for k in range(targets_NK.shape[1])]


def stack_soft_targets(logprobs: Sequence[Sequence[float]], widths: Sequence[int | None]) -> list:
    """Per-datum logprobs of datums expanded by `soft_target_columns` (`widths`: K for a datum
    that became K, None for one of shape (N,)) back as one entry per datum: a list of N for an
    (N,) datum, an (N, K) float32 array for soft targets.

    >>> out = stack_soft_targets([[-1.0], [-2.0, -3.0], [-4.0, -5.0]], [None, 2])
    >>> out[0], out[1].tolist()
    ([-1.0], [[-2.0, -4.0], [-3.0, -5.0]])
    """
    import numpy as np

    out, i = [], 0
    for width in widths:
        if width is None:
            out.append(logprobs[i])
            i += 1
        else:
            out.append(np.stack([np.asarray(lp, np.float32) for lp in logprobs[i:i + width]], axis=1))
            i += width
    if i != len(logprobs):
        raise ValueError(f"{len(logprobs)} logprob rows for datums expanding to {i}")
    return out


def tinker_loss(name: str, config: Mapping[str, float | str] | None = None) -> TinkerLoss:
    """The Tinker loss `name` with `config` (a request's `loss_fn_config`) validated: an
    unsupported name, an unknown key, a missing required key or a bad value raises
    `TinkerLossError` naming it and what is allowed.

    >>> tinker_loss("ppo", {"clip_high_threshold": 1.3}).config
    {'clip_low_threshold': 0.8, 'clip_high_threshold': 1.3}
    >>> tinker_loss("stable_reinforce")
    Traceback (most recent call last):
    ...
    tinker_pipelines.algorithms.tinker_losses.TinkerLossError: loss_fn 'stable_reinforce' is not supported by this service; supported: cross_entropy, importance_sampling, ppo, cispo, dro
    """
    spec = TINKER_LOSSES.get(name) if isinstance(name, str) else None
    if spec is None:
        raise TinkerLossError(f"loss_fn {name!r} is not supported by this service; supported: {_supported()}",
                              "loss_fn")
    given = dict(config or {})
    for key in given:
        if key not in spec.config_defaults:
            allowed = ", ".join(spec.config_defaults) or "none"
            raise TinkerLossError(f"loss_fn_config.{key} is not a parameter of loss_fn {name!r}; allowed: {allowed}",
                                  f"loss_fn_config.{key}")
    values: dict[str, float] = {}
    for key, default in spec.config_defaults.items():
        if key not in given and default is None:
            raise TinkerLossError(f"loss_fn_config.{key} is required for loss_fn {name!r}", f"loss_fn_config.{key}")
        values[key] = _number(name, key, given[key]) if key in given else default
    if "clip_low_threshold" in values and not 0 <= values["clip_low_threshold"] <= values["clip_high_threshold"]:
        raise TinkerLossError(f"loss_fn_config.clip_low_threshold must be >= 0 and <= clip_high_threshold "
                              f"(they bound the ratio itself), got {values['clip_low_threshold']} and "
                              f"{values['clip_high_threshold']}", "loss_fn_config.clip_low_threshold")
    if values.get("beta", 0.0) < 0:
        raise TinkerLossError(f"loss_fn_config.beta must be >= 0, got {values['beta']}", "loss_fn_config.beta")
    return TinkerLoss(spec, values)


# -- Tinker's datums and losses on the one gradient path ---------------------------------------
def _as_tensor(value: object, key: str, where: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TinkerLossError(f"{where}loss_fn_inputs.{key} is not an array ({e})", f"{where}loss_fn_inputs.{key}") from None


def datum_from_tinker(tokens: Sequence[int], loss_fn_inputs: Mapping[str, object], *,
                      loss: TinkerLoss | None = None, datum_index: int | None = None) -> Datum:
    """A Tinker datum (its `model_input` tokens, N of them, and its `loss_fn_inputs`) as our
    `Datum`: `target_tokens` as they are; a cross-entropy datum's `weights`; an RL datum's
    `logprobs` (the sampler's) as `behaviour_logprobs` and its `advantages`. An RL datum's weights
    mark the tokens `TinkerLossFn` reads (padding adds nothing): those whose advantage is not 0
    under an advantage-gated `loss` (`TinkerLossSpec.advantage_gated`: the others add exactly
    0), else all. With `loss`, the inputs are checked against it first
    (`TinkerLoss.check_inputs`); in any case each input must have the tokens' length N and be
    finite, or `TinkerLossError` names it (`data[i].` in front with `datum_index`).

    >>> datum_from_tinker([1, 2], {"target_tokens": [2, 3], "weights": [0.0, 1.0]}).weights
    (0.0, 1.0)
    >>> rl = {"target_tokens": [2, 3], "logprobs": [0.0, -1.0], "advantages": [0.0, 0.5]}
    >>> datum_from_tinker([1, 2], rl).weights, datum_from_tinker([1, 2], rl, loss=tinker_loss("ppo")).weights
    ((1.0, 1.0), (0.0, 1.0))
    """
    where = "" if datum_index is None else f"data[{datum_index}]."
    inputs = {k: _as_tensor(v, k, where) for k, v in loss_fn_inputs.items()}
    if loss is not None:
        loss.check_inputs(inputs, datum_index)
    n = len(tokens)
    if n == 0:
        raise TinkerLossError(f"{where}model_input has no tokens", f"{where}model_input")
    rl = "advantages" in inputs or "logprobs" in inputs
    keys = ("target_tokens", *(("logprobs", "advantages") if rl else ("weights",)))
    for key in keys:
        t = inputs.get(key)
        if t is None:
            raise TinkerLossError(f"{where}loss_fn_inputs.{key} is missing", f"{where}loss_fn_inputs.{key}")
        if t.dim() != 1 or t.shape[0] != n:
            raise TinkerLossError(f"{where}loss_fn_inputs.{key} must have shape ({n},) like model_input, got "
                                  f"{tuple(t.shape)}", f"{where}loss_fn_inputs.{key}")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise TinkerLossError(f"{where}loss_fn_inputs.{key} has a non-finite value", f"{where}loss_fn_inputs.{key}")
    if inputs["target_tokens"].is_floating_point():
        raise TinkerLossError(f"{where}loss_fn_inputs.target_tokens must be integers, got {inputs['target_tokens'].dtype}",
                              f"{where}loss_fn_inputs.target_tokens")
    targets = tuple(int(x) for x in inputs["target_tokens"].tolist())
    if not rl:
        return Datum(tuple(int(x) for x in tokens), targets, tuple(inputs["weights"].tolist()))
    advantages = tuple(float(a) for a in inputs["advantages"].tolist())
    gated = loss is not None and loss.spec.advantage_gated
    weights = tuple(float(a != 0) for a in advantages) if gated else (1.0,) * n
    return Datum(tuple(int(x) for x in tokens), targets, weights,
                 behaviour_logprobs=tuple(inputs["logprobs"].tolist()), advantages=advantages)


class TinkerLossFn:
    """A `TinkerLoss` as a `losses.LossFn`, so the learner's and the worker's `forward_backward`
    run it through the one gradient path. Its normalization is fixed to 'sum' (every micro-batch
    counts in full: the batch's loss is the sum of theirs, as Tinker's is) and it names its own
    metrics (Tinker's `loss:sum`). It reads the tokens whose weight is not 0: an RL datum's
    whose terms can be other than 0 (`datum_from_tinker`), none of the padding."""

    normalization = "sum"
    own_metrics = True

    def __init__(self, loss: TinkerLoss):
        self.loss = loss
        self.__name__ = f"tinker:{loss.name}"

    def __call__(self, logprobs_BT: torch.Tensor, batch: LossBatch, cfg: LossConfig) -> tuple[torch.Tensor, Metrics]:
        keep_BT = batch.weights_BT != 0
        inputs = {"weights": batch.weights_BT[keep_BT]} if self.loss.name == "cross_entropy" else {
            "logprobs": batch.behaviour_logprobs_BT[keep_BT], "advantages": batch.advantages_BT[keep_BT]}
        return self.loss(logprobs_BT[keep_BT], inputs)


def tinker_forward_metrics(loss: TinkerLoss, datums: Sequence[Datum], logprobs: Sequence[Sequence[float]]) -> Metrics:
    """Tinker's metrics of a forward-only call: the loss over the datums' tokens at the given
    target logprobs (the weights and inputs as `TinkerLossFn` reads them)."""
    lp_N = torch.tensor([x for d, row in zip(datums, logprobs) for x, w in zip(row, d.weights) if w != 0])
    kept = [(d, [i for i, w in enumerate(d.weights) if w != 0]) for d in datums]
    if loss.name == "cross_entropy":
        inputs = {"weights": torch.tensor([d.weights[i] for d, idx in kept for i in idx])}
    else:
        inputs = {"logprobs": torch.tensor([d.behaviour_logprobs[i] for d, idx in kept for i in idx]),
                  "advantages": torch.tensor([d.advantages[i] for d, idx in kept for i in idx])}
    with torch.no_grad():
        return loss(lp_N, inputs)[1]


def check_tinker_datums(loss: TinkerLoss, datums: Sequence[Datum]) -> None:
    """Each datum carries what `loss` reads (`datum_from_tinker`'s): an RL loss its sampling
    logprobs and advantages, cross_entropy its weights; `TinkerLossError` naming the first
    `data[i].loss_fn_inputs.<key>` that it lacks."""
    for i, d in enumerate(datums):
        if loss.name == "cross_entropy":
            continue  # every Datum has weights of its length
        for key, have in (("logprobs", d.behaviour_logprobs), ("advantages", d.advantages)):
            if len(have) != len(d.input_tokens):
                raise TinkerLossError(f"data[{i}].loss_fn_inputs.{key} is missing; loss_fn {loss.name!r} takes "
                                      f"exactly: {', '.join(loss.spec.inputs)}", f"data[{i}].loss_fn_inputs.{key}")
