"""What a worker hosts and how it runs requests: adapters on one base, batched across experiments."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import resource
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from tinker_pipelines.algorithms.losses import LossConfig
from tinker_pipelines.algorithms.registry import get_algorithm
from tinker_pipelines.algorithms.tinker_losses import TinkerLossFn, check_tinker_datums, tinker_loss
from tinker_pipelines.training.gradient import Account
from tinker_pipelines.training.allocator import HeapGrowth
from tinker_pipelines.training.learner import Learner, LearnerConfig
from tinker_pipelines.rollout.prompt_scores import PromptScores, PromptScoring, check_scoring, score_prompts
from tinker_pipelines.rollout.sampler import BASE, Sample, Sampler, SampleRequest
from tinker_pipelines.scheduler.step_entry import cuda_state
from tinker_pipelines.training.lora_linear import adapters_disabled
from tinker_pipelines.types import Datum
from tinker_pipelines.worker.batching import FBJob, forward_backward_together
from tinker_pipelines.worker.messages import error_reply


log = logging.getLogger(__name__)


class RequestError(ValueError):
    """A request the worker refuses; it keeps serving the others."""


@dataclass
class Hosted:
    """One experiment's adapter on the worker."""

    learner: Learner
    """Its learner (adapter, optimizer, value head, step counter)."""
    generator: torch.Generator
    """Its own sampling RNG, for requests that bring none (saved in its checkpoints)."""
    owner: int | None
    """Id of the client connection that holds it; it is dropped when that client goes away.
    None while parked (`park`): then no client holds it until one claims it."""
    algorithm: str = ""
    """Registered algorithm name its losses come from."""
    spec: tuple = ()
    """(learner config, seed, base name, algorithm) it was created with: a claim must bring the same."""
    record: dict[str, Any] | None = None
    """The record of the checkpoint it was last saved to or loaded from (None: neither yet)."""
    parked: tuple[str, float] | None = None
    """(tag, monotonic deadline) while parked: the state tag its last holder gave, and when it expires."""
    read_only: bool = False
    """Loaded for sampling and scoring only (a Tinker sampler's checkpoint): training ops are refused."""


@dataclass
class EngineConfig:
    """Limits and batching of one worker."""

    batching: bool = True
    """Run concurrent requests of several experiments together (mixed-adapter decode, shared base
    passes); off: one request at a time, each exactly as the in-process engine computes it."""
    max_rows: int = 256
    """Most sequences in one sample batch (and in one request)."""
    max_train_rows: int = 0
    """Most sequences in one training pass shared by several experiments; 0: experiments never
    share a pass, so each one's gradients are exactly those of its solo run (on CPU a shared pass
    is no faster: its matmuls are compute-bound at one micro-batch already; on a GPU, small
    micro-batches may gain from sharing)."""
    max_lora_rank: int = 64
    """Largest LoRA rank an adapter may have."""
    exclusive: bool = False
    """Host one experiment only, which may train every parameter (mode 'full')."""
    park_ttl_s: float = 600.0
    """How long a parked adapter waits for a client to claim it before it is dropped."""


@dataclass
class Engine:
    """The base model and its hosted adapters; every method runs on the worker's compute thread."""

    model: torch.nn.Module
    pad_token_id: int
    stop_token_ids: list[int]
    base: str
    """Identity of the base model (`models.base_identity`); clients check it."""
    cfg: EngineConfig = field(default_factory=EngineConfig)
    hosted: dict[str, Hosted] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    tokenizer: Any = None
    """The base's tokenizer, for requests with stop strings (the sampler decodes their tails)."""
    claims: int = 0
    """Parked adapters taken over by a client so far (`create` with a matching `claim`)."""
    shared_passes: int = 0
    """`forward_backward` calls of several experiments that ran in shared base passes."""
    shared_pass_errors: int = 0
    """Those that raised and were rerun one call at a time (each is logged with its cause)."""
    heap: HeapGrowth = field(default_factory=HeapGrowth)
    """Gives free heap back before a training cycle once it has grown (`training.allocator`)."""
    device_key: str = ""
    """The physical device this worker holds (`scheduler.workers.worker_device_key`): a GPU's
    UUID, a leased simulated/CPU device's `<kind>:<index>@<scope>`, or `cpu`."""

    def __post_init__(self) -> None:
        self.base_model = self.model
        self.base_generator = torch.Generator().manual_seed(0)
        """Uniforms of base-model sample requests that bring neither a seed nor a generator."""
        self.sampler_seeds = torch.Generator().manual_seed(1)
        """Seeds of the generators of adapters loaded read-only from checkpoints (one each)."""
        self.sampler = Sampler(self.model, self.pad_token_id, self.stop_token_ids, tokenizer=self.tokenizer)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the base computes in."""
        return self.model.get_input_embeddings().weight.dtype

    # -- adapters ---------------------------------------------------------------------------
    def create(self, owner: int, name: str, learner: dict[str, Any], seed: int, base_name: str,
               algorithm: str = "", claim: str | None = None) -> dict[str, Any]:
        """Host a new adapter `name` for client `owner`; with `claim`, first take over the parked
        adapter of that name instead when it was parked with this state tag and the same spec
        (`claimed: true` and its `record` in the reply). A parked adapter that does not match is
        dropped: its holder's successor asked for another state."""
        if not name or not isinstance(name, str) or name.startswith("__") or "." in name:
            raise RequestError(f"adapter name {name!r} is not allowed (non-empty, no '.', not starting with '__')")
        spec = (dict(learner), int(seed), base_name, algorithm)
        h = self.hosted.get(name)
        if h is not None and h.parked is not None:
            if claim is not None and h.parked[0] == claim and h.spec == spec:
                h.owner, h.parked = owner, None
                self.claims += 1
                return {"steps": h.learner.steps, "claimed": True, "record": h.record}
            self.drop(name)
        if name in self.hosted:
            raise RequestError(f"adapter {name!r} already exists on this worker (held by another client); "
                               "use another experiment name or stop that client")
        try:
            lcfg = LearnerConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in learner.items()})
        except (TypeError, ValueError) as e:
            raise RequestError(f"learner config for {name!r}: {e}") from None
        if lcfg.mode == "full" and not (self.cfg.exclusive and not self.hosted):
            raise RequestError(f"experiment {name!r} trains every parameter (training.mode: full): it needs a worker "
                               "of its own (`tinker-pipelines worker --exclusive`) or the in-process engine")
        if self.cfg.exclusive and self.hosted:
            raise RequestError(f"this worker is exclusive and already hosts {next(iter(self.hosted))!r}")
        if lcfg.mode == "lora" and lcfg.lora_rank > self.cfg.max_lora_rank:
            raise RequestError(f"adapter {name!r} has training.lora_rank {lcfg.lora_rank} (a Tinker client's "
                               f"lora_config.rank); this worker hosts ranks up to {self.cfg.max_lora_rank} "
                               "(--max-lora-rank)")
        if algorithm:
            get_algorithm(algorithm)
        base = self.model if lcfg.mode == "lora" else self.base_model
        try:
            lr = Learner(base, lcfg, self.pad_token_id, base_name=base_name, adapter_name=name, init_seed=seed)
        except ValueError as e:
            raise RequestError(f"adapter {name!r}: {e}") from None
        if lcfg.mode == "lora":
            self.model = lr.model  # a PeftModel from the first adapter on
            self.sampler.model = self.model
            # the first adapter replaces the base's linears by LoRA layers behind unchanged base
            # weights: a decoder cached over the bare base would not see any adapter
            self.sampler.invalidate()
        gen = torch.Generator().manual_seed(seed)
        self.hosted[name] = Hosted(lr, gen, owner, algorithm, spec)
        return {"steps": lr.steps, "claimed": False}

    def create_sampler(self, owner: int, name: str, path: str, base_name: str = "") -> dict[str, Any]:
        """Host LoRA checkpoint `path`'s weights as read-only adapter `name` for client `owner`
        (sampling and scoring: training ops are refused), shaped as its record says (rank,
        targets); `base_name` ('': the record's) is the base it must have been trained on."""
        record = _peek_record(Path(path))
        learner = record.get("learner")
        if not isinstance(learner, dict) or record.get("mode") != "lora":
            raise RequestError(f"checkpoint {path} is not a LoRA adapter's (mode {record.get('mode')!r})")
        self.create(owner, name, learner, _next_seed(self.sampler_seeds), base_name or record.get("base_model") or "")
        try:
            record = self.load_state(name, path, optimizer=False)
        except Exception:
            self.drop(name)
            raise
        self.hosted[name].read_only = True
        return record

    def copy_adapter(self, owner: int, src: str, name: str) -> dict[str, Any]:
        """Host read-only adapter `name` for client `owner`: a copy in memory of LoRA adapter
        `src`'s weights as they are now (same rank, targets and dtype; its value head too), with
        a fresh optimizer and generator, written nowhere. The tensors are copied, not shared, so
        later optimizer steps of `src` do not change what `name` samples. The server has checked
        that `owner` holds `src`."""
        h = self.get(src)
        if h.learner.cfg.mode != "lora":
            raise RequestError(f"adapter {src!r} trains every parameter (mode 'full'): only a LoRA adapter can be "
                               "copied")
        if name in self.hosted:
            raise RequestError(f"cannot copy adapter {src!r} to {name!r}: adapter {name!r} already exists on this "
                               "worker")
        # its own stream, drawn from the source's: two copies of unchanged weights must not sample alike
        self.create(owner, name, asdict(h.learner.cfg), _next_seed(h.generator), h.learner.base_name, h.algorithm)
        copy = self.hosted[name]
        try:
            _copy_weights(h.learner, copy.learner)
        except Exception:
            self.drop(name)
            raise
        copy.read_only = True
        copy.learner.steps = h.learner.steps
        # no sampler.invalidate() beyond create's: copy_ bumps the version counters its fingerprint reads
        return {"steps": copy.learner.steps}

    def park(self, name: str, tag: str) -> None:
        """Keep adapter `name` after its holder goes away, for a client that claims it with `tag`
        within `park_ttl_s` (the next step process of the same experiment): that client then skips
        rebuilding it from a checkpoint. The holder gives the tag of the state it leaves it in."""
        if not isinstance(tag, str) or not tag:
            raise RequestError("park needs a non-empty state tag")
        h = self.get(name)
        h.owner, h.parked = None, (tag, time.monotonic() + self.cfg.park_ttl_s)

    def expire_parked(self) -> list[str]:
        """Drop the parked adapters nobody claimed in time; their names (the server calls this
        before every batch of requests)."""
        now = time.monotonic()
        names = [n for n, h in self.hosted.items() if h.parked is not None and h.parked[1] <= now]
        for n in names:
            self.drop(n)
        return names

    def drop(self, name: str) -> None:
        h = self.hosted.pop(name, None)
        if h is None:
            return
        if h.learner.cfg.mode == "lora" and name in getattr(self.model, "peft_config", {}):
            self.model.delete_adapter(name)
        h.learner.optimizer.state.clear()
        h.learner.close()
        self.sampler.invalidate()

    def drop_owned(self, owner: int) -> list[str]:
        names = [n for n, h in self.hosted.items() if h.owner == owner]
        for n in names:
            self.drop(n)
        return names

    def trainable(self, name: str) -> Learner:
        """Adapter `name`'s learner, for a training op; RequestError when it is read-only."""
        h = self.get(name)
        if h.read_only:
            raise RequestError(f"adapter {name!r} is read-only (loaded for sampling): it takes no forward_backward "
                               "or optim_step")
        return h.learner

    def get(self, name: str) -> Hosted:
        h = self.hosted.get(name)
        if h is None:
            known = ", ".join(sorted(self.hosted)) or "none"
            raise RequestError(f"unknown adapter {name!r} on this worker (hosted: {known})")
        return h

    # -- sampling ---------------------------------------------------------------------------
    def sample(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Requests: {adapter, prompts, max_new_tokens, temperature, generator_state} and optional
        top_k (-1 or 0: off), top_p, min_p, stop, top_logprobs (`SampleRequest`'s), and Tinker's
        seed, stop_token_ids, num_samples, prompt_logprobs and prompt_scoring. Adapter '' samples
        the base without any adapter. Each reply has the samples (tokens, logprobs, stop_reason,
        stop_string, support, top_logprobs; `num_samples` per prompt, prompt by prompt), the
        advanced generator state, and with `prompt_logprobs` / `prompt_scoring` each prompt's
        scores, from one forward over the prompt whatever `num_samples` (or an error of its own:
        one client's bad request never fails the others batched with it)."""
        replies: list[dict[str, Any] | None] = [None] * len(requests)
        ready: list[tuple[int, SampleRequest, torch.Generator]] = []
        for i, r in enumerate(requests):
            try:
                req = self._sample_request(r)
                self.sampler._check(req)
                self._scoring(r)
                ready.append((i, req, req.generator))
            except (RequestError, ValueError, KeyError, TypeError) as e:
                replies[i] = _error(e)
        groups = _chunk(ready, self.cfg.max_rows) if self.cfg.batching else [[x] for x in ready]
        for group in groups:
            if self.cfg.batching:
                out = self.sampler.sample_each([req for _, req, _ in group])
            else:  # one adapter at a time, as the in-process engine does (merged adapter weights)
                (_, req, _), = group
                try:
                    with _active(self.model, req.adapter):
                        out = [self.sampler.sample(req.prompts, req.max_new_tokens, req.temperature, req.generator,
                                                   top_k=req.top_k, top_p=req.top_p, min_p=req.min_p, stop=req.stop,
                                                   top_logprobs=req.top_logprobs,
                                                   stop_token_ids=req.stop_token_ids)]
                except Exception as e:  # noqa: BLE001 - this request's error alone
                    out = [e]
            for (i, req, gen), samples in zip(group, out):
                replies[i] = _error(samples) if isinstance(samples, Exception) else self._sample_reply(
                    requests[i], req, gen, samples)
        return replies  # type: ignore[return-value]

    def _sample_reply(self, r: dict[str, Any], req: SampleRequest, gen: torch.Generator,
                      samples: list[Sample]) -> dict[str, Any]:
        reply = {"samples": [(s.tokens, s.logprobs, s.stop_reason, s.stop_string, s.support, s.top_logprobs)
                             for s in samples],
                 "generator_state": gen.get_state().numpy().tobytes()
                 if r.get("generator_state") is not None else None}
        scoring = self._scoring(r)
        if scoring is not None:
            try:
                scores = self.prompt_scores(req.adapter, [list(p) for p in r["prompts"]], scoring)
            except Exception as e:  # noqa: BLE001 - this request's error alone
                return _error(e)
            if r.get("prompt_logprobs"):
                reply["prompt_logprobs"] = [[math.nan] * s.first + list(s.logprobs) for s in scores]
            else:
                reply["prompt_scores"] = scores
        return reply

    def _scoring(self, r: dict[str, Any]) -> list[PromptScoring] | None:
        """Each prompt's `PromptScoring` (`prompt_logprobs`: every position's logprob); None: none
        asked. RequestError naming what does not fit the prompts."""
        asked = r.get("prompt_scoring") or []
        if r.get("prompt_logprobs") and asked:
            raise RequestError("a sample request takes prompt_logprobs or prompt_scoring, not both")
        if not asked:
            return [PromptScoring(logprobs=True)] * len(r["prompts"]) if r.get("prompt_logprobs") else None
        if len(asked) != len(r["prompts"]):
            raise RequestError(f"prompt_scoring has {len(asked)} entries for {len(r['prompts'])} prompts")
        vocab = self.model.get_input_embeddings().num_embeddings
        for p, s in zip(r["prompts"], asked):
            try:
                check_scoring(s, len(p), vocab)
            except ValueError as e:
                raise RequestError(str(e)) from None
        return list(asked)

    @torch.no_grad()
    def prompt_scores(self, adapter: str | None, prompts: list[list[int]],
                      scoring: list[PromptScoring]) -> list[PromptScores]:
        """Each prompt's scores (`rollout.prompt_scores`) under `adapter` (`BASE`: the base alone),
        at temperature 1 without truncation: the same logprobs as a Tinker adapter's
        `compute_logprobs` of the prompt."""
        with _active(self.model, adapter):
            return score_prompts(self.model, prompts, scoring, self.pad_token_id)

    def _sample_request(self, r: dict[str, Any]) -> SampleRequest:
        """A client's sample request as a `SampleRequest`; RequestError naming what is malformed."""
        base = not r["adapter"]
        h = None if base else self.get(r["adapter"])
        raw = r["prompts"]
        if not isinstance(raw, (list, tuple)) or not all(isinstance(p, (list, tuple)) for p in raw):
            raise RequestError(f"prompts must be a list of token-id lists, got {type(raw).__name__}")
        n = r.get("num_samples", 1)
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise RequestError(f"num_samples must be an integer >= 1, got {n!r}")
        prompts = [[int(t) for t in p] for p in raw for _ in range(n)]
        if len(prompts) > self.cfg.max_rows:
            raise RequestError(f"{len(prompts)} sequences ({len(raw)} prompts x num_samples {n}) exceed this worker's "
                               f"--max-rows {self.cfg.max_rows}")
        gen = self._generator(r, h)
        stop = r.get("stop", ())
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        top_k = r.get("top_k", 0)
        top_k = 0 if top_k == -1 else top_k  # Tinker's "off"
        adapter = (BASE if hasattr(self.model, "peft_config") else None) if base else r["adapter"]
        return SampleRequest(prompts, int(r["max_new_tokens"]), float(r["temperature"]), gen, adapter,
                             top_k=top_k, top_p=r.get("top_p", 1.0), min_p=r.get("min_p", 0.0), stop=stop,
                             stop_token_ids=tuple(r.get("stop_token_ids") or ()), top_logprobs=r.get("top_logprobs", 0))

    def _generator(self, r: dict[str, Any], h: Hosted | None) -> torch.Generator:
        """The request's uniforms: from its `seed` (a fresh generator: the same seed gives the
        same tokens whatever else is decoded), from the state it brought, else its adapter's own
        generator (the base's, for base sampling)."""
        if r.get("seed") is not None and r.get("generator_state") is not None:
            raise RequestError("a sample request takes a seed or a generator_state, not both")
        if r.get("seed") is not None:
            seed = r["seed"]
            if isinstance(seed, bool) or not isinstance(seed, int):
                raise RequestError(f"seed must be an integer, got {seed!r}")
            return torch.Generator().manual_seed(seed % 2**64)
        if r.get("generator_state") is None:
            return self.base_generator if h is None else h.generator
        gen = torch.Generator()
        try:
            gen.set_state(torch.frombuffer(bytearray(r["generator_state"]), dtype=torch.uint8))
        except (RuntimeError, TypeError, ValueError) as e:
            raise RequestError(f"generator_state is not the state of a CPU torch.Generator ({e})") from None
        return gen

    # -- training ---------------------------------------------------------------------------
    def forward_backward(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Calls: {adapter, datums, algorithm, loss_cfg}, or Tinker's {adapter, datums, loss,
        loss_config, forward_only} (reply: {logprobs, metrics}); LoRA calls of several adapters
        share base passes. A call that fails, fails alone: if a shared pass fails, every adapter's
        gradient is put back as it was and each call runs alone. A forward-only call does no
        gradient work (`Learner.tinker_forward_backward`)."""
        replies: list[dict[str, Any] | None] = [None] * len(calls)
        jobs: list[tuple[int, FBJob]] = []
        for i, c in enumerate(calls):
            try:
                h = self.get(c["adapter"])
                datums = c["datums"]
                self._check_datums(datums)
                if h.read_only and not c.get("forward_only"):
                    self.trainable(c["adapter"])
                if "loss" not in c:
                    jobs.append((i, FBJob(h.learner, datums, get_algorithm(c["algorithm"]).loss,
                                          LossConfig(**c["loss_cfg"]))))
                    continue
                loss = tinker_loss(c["loss"], c.get("loss_config") or {})
                check_tinker_datums(loss, datums)
                if c.get("forward_only"):
                    logprobs, metrics = h.learner.tinker_forward_backward(datums, loss, forward_only=True)
                    replies[i] = {"logprobs": logprobs, "metrics": metrics}
                    continue
                jobs.append((i, FBJob(h.learner, datums, TinkerLossFn(loss), LossConfig(), logprobs=[])))
            except (RequestError, ValueError, KeyError, TypeError) as e:
                replies[i] = _error(e)
        if jobs:  # a heap that other clients' calls left full of holes goes back to its live part
            self.heap.release_if_grown()
        done = self._together(jobs, replies)
        for i, j in jobs:
            if i not in done:
                replies[i] = _alone(j)
        return replies  # type: ignore[return-value]

    def _check_datums(self, datums: list[Datum]) -> None:
        """RequestError naming the first datum (by index) too long for the context or holding a
        token id outside the vocabulary."""
        if not datums or not all(isinstance(d, Datum) for d in datums):
            raise RequestError("forward_backward needs a non-empty list of Datum")
        vocab = self.model.get_input_embeddings().num_embeddings
        for k, d in enumerate(datums):
            n = len(d.input_tokens)
            if self.sampler.max_context is not None and n > self.sampler.max_context:
                raise RequestError(f"datum {k}: a datum of {n} tokens exceeds the model context of "
                                   f"{self.sampler.max_context} tokens")
            bad = next((t for t in (*d.input_tokens, *d.target_tokens) if not 0 <= t < vocab), None)
            if bad is not None:
                raise RequestError(f"datum {k}: token id {bad} in a datum is outside the model's vocabulary "
                                   f"[0, {vocab})")

    def _together(self, jobs: list[tuple[int, FBJob]], replies: list[dict[str, Any] | None]) -> set[int]:
        """Run the LoRA jobs of several adapters in shared passes; the indices it answered (none
        when batching is off, there is only one, or the shared pass raised: then every gradient
        is put back and each job runs alone)."""
        lora = [(i, j) for i, j in jobs if j.learner.cfg.mode == "lora"]
        if not (self.cfg.batching and len(lora) > 1):
            return set()
        saved = {p: None if p.grad is None else p.grad.clone() for _, j in lora for p in j.learner.params}
        try:
            forward_backward_together([j for _, j in lora], self.cfg.max_train_rows)
        except Exception as e:  # noqa: BLE001 - whose call it was is found by running each alone
            self.shared_pass_errors += 1
            log.warning("shared forward_backward of %s failed (%s: %s); running each call alone",
                        ", ".join(j.learner.adapter_name for _, j in lora), type(e).__name__, e)
            for p, grad in saved.items():
                p.grad = grad
            return set()
        self.shared_passes += 1
        for i, j in lora:
            replies[i] = _error(j.error) if j.error is not None else _fb_reply(j.totals, j.logprobs)
        return {i for i, _ in lora}

    def save_state(self, name: str, path: str, record: dict[str, Any] | None,
                   extra_rng: dict[str, Any] | None) -> dict[str, Any]:
        """Checkpoint adapter `name`, its own sampling generator with it (restored by `load_state`)."""
        h = self.get(name)
        h.record = h.learner.save_state(path, record, {**(extra_rng or {}), "adapter_generator": h.generator.get_state()})
        return h.record

    def load_state(self, name: str, path: str | Path, optimizer: bool = True) -> dict[str, Any]:
        """Restore adapter `name` from a checkpoint made on this worker's base; returns its record.
        `optimizer=False`: its weights only (no optimizer state, no generator)."""
        h = self.get(name)
        path, lr = Path(path), h.learner
        record = _peek_record(path)
        if record.get("base_model") not in (None, "", lr.base_name):
            raise RequestError(f"checkpoint {path} was trained on base {record.get('base_model')!r}; adapter "
                               f"{name!r} lives on this worker's base {lr.base_name!r}")
        record = lr.load_state(path, optimizer)
        rng = torch.load(path / "rng.pt", weights_only=True) if optimizer else {}
        if "adapter_generator" in rng:
            h.generator.set_state(rng["adapter_generator"])
        h.record = record
        return record

    def stats(self) -> dict[str, Any]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {"adapters": sorted(self.hosted), "parked": sorted(n for n, h in self.hosted.items() if h.parked),
                "claims": self.claims, "shared_passes": self.shared_passes,
                "shared_pass_errors": self.shared_pass_errors, **self.sampler.counts,
                "decode_path": self.sampler.decode_path, "base": self.base, "device": str(self.device),
                "device_key": self.device_key, "pid": os.getpid(), "cuda": cuda_state(),
                "peak_rss_mb": usage.ru_maxrss / 1024, "rss_mb": resident_mb()[0]}


def _lora_tensors(learner: Learner) -> dict[str, torch.Tensor]:
    """The learner's LoRA parameters by their names with its adapter's name left out."""
    marker = f".{learner.adapter_name}."
    return {n.replace(marker, ".", 1): p for n, p in learner.model.named_parameters() if "lora_" in n and marker in n}


@torch.no_grad()
def _copy_weights(src: Learner, dst: Learner) -> None:
    """Write `src`'s LoRA weights (and value head) into `dst`, a learner of the same config on
    the same model. A name, shape or dtype that differs is a bug, raised rather than cast: a copy
    rounded to another dtype would not sample what `src` samples."""
    theirs, ours = _lora_tensors(src), _lora_tensors(dst)
    if set(theirs) != set(ours):
        raise RuntimeError(f"adapter {dst.adapter_name!r} does not have adapter {src.adapter_name!r}'s LoRA tensors "
                           f"(differing: {sorted(set(theirs) ^ set(ours))[:3]})")
    for k, p in ours.items():
        if p.shape != theirs[k].shape or p.dtype != theirs[k].dtype:
            raise RuntimeError(f"{k}: {tuple(theirs[k].shape)} {theirs[k].dtype} in {src.adapter_name!r}, "
                               f"{tuple(p.shape)} {p.dtype} in its copy {dst.adapter_name!r}")
        p.copy_(theirs[k])
    if src.value_head is not None:
        dst.value_head.load_state_dict(src.value_head.state_dict())  # type: ignore[union-attr]


def _peek_record(path: Path) -> dict[str, Any]:
    import json

    f = path / "record.json"
    if not f.exists():
        raise RequestError(f"{path} is not a checkpoint: no record.json")
    return json.loads(f.read_text())


def resident_mb() -> tuple[float, float]:
    """This process's resident memory now and at its peak (VmRSS, VmHWM), MB; zeros where /proc is missing."""
    found = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    found[line[:5]] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return found.get("VmRSS", 0.0), found.get("VmHWM", 0.0)


def _chunk(items: list, max_rows: int) -> list[list]:
    groups, current, rows = [], [], 0
    for item in items:
        n = len(item[1].prompts)
        if current and rows + n > max_rows:
            groups.append(current)
            current, rows = [], 0
        current.append(item)
        rows += n
    if current:
        groups.append(current)
    return groups


@contextlib.contextmanager
def _active(model: torch.nn.Module, adapter: str | None) -> Iterator[None]:
    """Make `adapter` the active one for the block (the merged, in-process decode path); `BASE`:
    the base alone; None (a model without adapters yet): the model as it is."""
    if adapter == BASE and hasattr(model, "peft_config"):
        with adapters_disabled(model):
            yield
        return
    if adapter not in (None, BASE) and getattr(model, "active_adapter", None) != adapter and hasattr(model, "set_adapter"):
        model.set_adapter(adapter)
    yield


def _error(e: BaseException) -> dict[str, Any]:
    """A failed request of a batch as its reply (`messages.error_reply`'s kind, message and field)."""
    r = error_reply(e)
    return {"error": r.error, "message": r.message, **({"field": r.field} if r.field else {})}


def _fb_reply(metrics: dict[str, float], logprobs: list[list[float]] | None) -> dict[str, Any]:
    return {"metrics": metrics} if logprobs is None else {"metrics": metrics, "logprobs": logprobs}


def _alone(j: FBJob) -> dict[str, Any]:
    """One `forward_backward` job run by its own learner (Tinker's with its datums' logprobs)."""
    try:
        tally = Account(logprobs=[] if j.logprobs is not None else None)
        metrics = j.learner._accumulate(j.datums, j.loss_fn, j.loss_cfg, tally)
        return _fb_reply(metrics, tally.logprobs)
    except Exception as e:  # noqa: BLE001 - this call's error alone
        j.learner.zero_grad()  # a failed call leaves no partial gradient behind (fp32 masters too)
        return _error(e)


def _next_seed(generator: torch.Generator) -> int:
    """A seed for a new adapter's sampling generator, drawn from `generator` (which it advances):
    distinct per adapter, and reproducible from the seeds the worker and its adapters started with."""
    return int(torch.randint(0, 2**62, (1,), generator=generator))


__all__ = ["Engine", "EngineConfig", "Hosted", "RequestError", "Sample"]

