"""An experiment's stages: the resident model, learner and sampler, and each stage of an
iteration (`sft`, `rollout`, `score`, `train_step`, `evaluate`, `save`, `resume`).

The plain loop (`tinker_pipelines.loops.train`), DPO (`tinker_pipelines.loops.dpo`), the Dagster assets and
the worker clients all drive this one class, so they run the same code and get the same numbers;
it imports none of them.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from tinker_pipelines.algorithms.losses import LossConfig, LossFn
from tinker_pipelines.algorithms.registry import get_algorithm
from tinker_pipelines.training.allocator import retain_freed_memory
from tinker_pipelines.bases import SFT_KIND, base_ref, check_same_base
from tinker_pipelines.checkpoint import atomic_directory, read_record, seed_everything, write_record
from tinker_pipelines.config import Config, ConfigError, config_to_dict
from tinker_pipelines.loops.datums import critic_datums, rl_datums, sft_datum, with_reference_logprobs
from tinker_pipelines.training.learner import Learner, LearnerConfig
from tinker_pipelines.models import base_identity, load_model, load_tokenizer, stop_token_ids
from tinker_pipelines.rollout.episodes import RolloutConfig, run_episodes, run_groups
from tinker_pipelines.rollout.sampler import Sampler
from tinker_pipelines.schedule_rules import eval_due
from tinker_pipelines.training.interface import TrainingClient
from tinker_pipelines.types import Datum, TrajectoryGroup

if TYPE_CHECKING:
    from tinker_pipelines.worker.client import RemoteLearner, RemoteSampler, WorkerClient

EVAL_SEED_OFFSET = 10_000_000


def derived_seed(*parts: Any) -> int:
    """A 63-bit seed from any parts, stable across processes and Python versions."""
    return random.Random("-".join(map(str, parts))).getrandbits(63)


@dataclass
class RolloutStats:
    """Summary of one iteration's rollouts."""

    groups: list[TrajectoryGroup]
    metrics: dict[str, float]


def summarize_groups(groups: list[TrajectoryGroup]) -> dict[str, float]:
    """Reward mean/std, success rate (from info['exact'] when present), tokens."""
    trajs = [t for g in groups for t in g.trajectories]
    rewards = [t.total_reward for t in trajs]
    out = {"reward_mean": statistics.fmean(rewards),
           "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
           "sampled_tokens": float(sum(t.num_sampled_tokens for t in trajs)),
           "episodes": float(len(trajs))}
    for key in ("exact", "contains"):
        if all(key in t.info for t in trajs):
            out[f"{key}_rate"] = statistics.fmean(float(t.info[key]) for t in trajs)
    return out


class Experiment:
    """A loaded experiment: base model, learner (LoRA or full) and a sampler over the policy."""

    def __init__(self, cfg: Config, model=None, tokenizer=None, worker: "WorkerClient | str | None" = None,
                 name: str | None = None, base: str | Path | None = None):
        """With `worker` (a `WorkerClient` or its socket path) the policy lives on that resident
        worker as adapter `name` and this process holds only the tokenizer; `base` is the
        warm-started base directory the worker must serve (None: `model.name`)."""
        self.cfg = cfg.validate()
        retain_freed_memory()  # a process that samples and trains: freed buffers stay in the heap
        self.algorithm = get_algorithm(cfg.algorithm.name)
        self.env_spec, self.eval_spec = cfg.env.spec(), cfg.env.spec(evaluation=True)
        if cfg.sft.steps and not hasattr(self.env_spec.resolve(), "sft_examples"):
            raise ConfigError(f"sft.steps is {cfg.sft.steps} but env {cfg.env.path!r} has no sft_examples()")
        for spec in (self.env_spec, self.eval_spec):  # a constructor refusing its kwargs fails before the model loads
            spec.build()
        seed_everything(cfg.seed)
        m = cfg.model
        self.name = (name or Path(cfg.output_dir).name or "default").replace(".", "-")
        self.worker = None
        self.sft_record: dict[str, Any] | None = None
        """The record of the warm-started base in use (`save_base` / `use_base`), or None."""
        if worker is not None:
            self.worker = self._connect(worker, base)
            tokenizer = tokenizer or load_tokenizer(str(base) if base is not None else m.name)
        elif model is None:
            if cfg.training.deepspeed.stage > 0:  # each rank on its own GPU before anything is loaded onto one
                from tinker_pipelines.training.distributed import set_rank_device

                try:
                    set_rank_device(m.device)
                except ValueError as e:
                    raise ConfigError(str(e)) from None
            model, tokenizer = load_model(m.name, seed=cfg.seed if m.seed is None else m.seed, dtype=m.dtype,
                                          device=m.device, **m.kwargs)
        self.base_model, self.tokenizer = model, tokenizer
        self.learner: TrainingClient | None = None
        """The RL learner (`start_rl`): in-process, DeepSpeed or on a worker; the stages use only
        its `TrainingClient` interface."""
        self._local: Learner | None = None
        """The same learner when its modules live in this process (`local_learner`)."""
        self._remote: RemoteLearner | None = None
        """The same learner when it is an adapter on a worker (parking)."""
        self.iteration = 0
        self.rollout_share: dict[str, int] | None = None
        """Under DeepSpeed, what this rank sampled of the last rollout (`_split_rollout`)."""
        a = cfg.algorithm
        normalization = self.algorithm.normalization or a.normalization or "sequence"
        self.loss_cfg = LossConfig(a.clip_eps, a.kl_coef, a.kl_estimator, normalization, gamma=a.gamma,
                                   gae_lambda=a.gae_lambda, vf_coef=a.vf_coef, value_clip=a.value_clip,
                                   whiten_advantages=a.whiten_advantages,
                                   max_tokens=cfg.training.max_new_tokens * cfg.training.max_turns)
        self.epochs = a.ppo_epochs or self.algorithm.epochs
        self.rollout_cfg: RolloutConfig = cfg.training.sampling()

    def _connect(self, worker: "WorkerClient | str", base: str | Path | None) -> "WorkerClient":
        from tinker_pipelines.worker.client import WorkerClient
        from tinker_pipelines.worker import WorkerError

        if self.algorithm.pairwise:
            raise ConfigError(f"algorithm.name {self.cfg.algorithm.name!r} trains in-process, not on a worker")
        client = WorkerClient(worker) if isinstance(worker, (str, Path)) else worker
        m = self.cfg.model
        expected = base_identity(str(base), {}, 0) if base is not None else base_identity(
            m.name, m.kwargs, self.cfg.seed if m.seed is None else m.seed)
        if client.info["base"] != expected:
            raise WorkerError(f"worker {client.address} serves base {client.info['base']}, but experiment "
                              f"{self.name!r} trains on {expected} (set model.seed / start a worker on that base)")
        if base is not None:
            self.sft_record = read_record(base, verify=False)  # the worker verified its files at start
        return client

    # -- stages -----------------------------------------------------------------------------
    def sft(self, on_step: Callable[[int, dict[str, float]], None] | None = None) -> list[dict[str, float]]:
        """Full-parameter supervised warm start of the base model on the env's examples."""
        if self.worker is not None:
            raise ConfigError("sft runs in-process (it trains every parameter); start the worker on its output")
        s, t = self.cfg.sft, self.cfg.training
        make = self.env_spec.resolve().sft_examples
        examples = make(s.examples, seed=self.cfg.seed, **{**self.cfg.env.kwargs, **s.kwargs})
        datums = [sft_datum(self.tokenizer, m, c) for m, c in examples]
        lcfg = LearnerConfig(mode="full", learning_rate=s.learning_rate, micro_batch_size=t.micro_batch_size,
                             share_prefix=t.share_prefix, gradient_checkpointing=t.gradient_checkpointing)
        learner = Learner(self.base_model, lcfg, self.tokenizer.pad_token_id)
        sft_loss = get_algorithm("sft").loss
        rng = random.Random(derived_seed(self.cfg.seed, "sft"))
        history = []
        for step in range(s.steps):
            batch = rng.sample(datums, min(s.batch_size, len(datums)))
            metrics = learner.forward_backward(batch, sft_loss)
            metrics.update(learner.optim_step())
            history.append(metrics)
            if on_step:
                on_step(step, metrics)
        learner.close()  # a bf16 base: its fp32 masters go with the SFT learner
        self.base_model.requires_grad_(False)
        return history

    def save_base(self, path: str | Path) -> dict[str, Any]:
        """Write the (warm-started) base model and its tokenizer as a Hugging Face directory,
        atomically, with a record of its files' hashes that `use_base` verifies. Comes before
        `start_rl`: the RL learner wraps the base (LoRA layers in place, or trains it)."""
        if self.learner is not None:
            raise ConfigError("save_base saves the warm-started base before start_rl; the RL learner now holds it")
        with atomic_directory(path) as tmp:
            self.base_model.save_pretrained(str(tmp))
            self.tokenizer.save_pretrained(str(tmp))
            self.sft_record = write_record(tmp, {"kind": SFT_KIND, "base_model": self.cfg.model.name,
                                                 "config": config_to_dict(self.cfg)})
        return self.sft_record

    def use_base(self, path: str | Path) -> None:
        """Replace the base model by a warm-started one (`save_base`'s directory, its files
        checked against their recorded hashes first), on the configured device and dtype."""
        from transformers import AutoModelForCausalLM

        from tinker_pipelines.models import resolve_device, resolve_dtype

        self.sft_record = read_record(path, verify=True)
        device = resolve_device(self.cfg.model.device)
        dtype = resolve_dtype(self.cfg.model.dtype, device)
        self.base_model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()

    def start_rl(self, adapter_path: str | Path | None = None, claim: str | None = None) -> TrainingClient:
        """Build the RL learner over the (possibly warm-started) base model. On a worker, `claim`
        (`state_tag`) takes over the adapter a previous holder parked in that state, if any."""
        t = self.cfg.training
        # A pairwise loss sees whole (chosen, rejected) pairs only: micro-batches hold an even count.
        mb = max(2, t.micro_batch_size - t.micro_batch_size % 2) if self.algorithm.pairwise else t.micro_batch_size
        lcfg = LearnerConfig(mode=t.mode, learning_rate=t.learning_rate, lora_rank=t.lora_rank,
                             lora_alpha=t.lora_alpha, grad_clip=t.grad_clip,
                             # the RL losses see the sampling distribution (temperature, truncation); DPO
                             # compares the model's own (temperature 1) under the policy and the reference
                             **({} if self.algorithm.pairwise else dict(temperature=t.temperature, top_k=t.top_k,
                                                                       top_p=t.top_p, min_p=t.min_p)),
                             micro_batch_size=mb, share_prefix=t.share_prefix,
                             gradient_checkpointing=t.gradient_checkpointing,
                             needs_reference=self.cfg.algorithm.kl_coef > 0 or self.algorithm.needs_reference,
                             value_head=self.algorithm.value_head,
                             value_learning_rate=self.cfg.algorithm.value_learning_rate)
        if self.worker is not None:
            from tinker_pipelines.worker.client import RemoteLearner

            if adapter_path is not None:
                raise ConfigError("an adapter_path is loaded with resume() on a worker")
            self.learner = self._remote = RemoteLearner(self.worker, self.name, lcfg, seed=self.cfg.seed,
                                                        base_name=self.cfg.model.name, claim=claim)
            return self.learner
        if t.deepspeed.stage > 0:  # ZeRO data parallel over torchrun's ranks; deepspeed is imported only here
            from tinker_pipelines.training.deepspeed_learner import DeepSpeedLearner

            if adapter_path is not None:
                raise ConfigError("training.deepspeed trains every parameter: there is no adapter_path to load")
            self.learner = self._local = DeepSpeedLearner(self.base_model, lcfg, self.tokenizer.pad_token_id,
                                                          base_name=self.cfg.model.name, stage=t.deepspeed.stage,
                                                          offload_optimizer=t.deepspeed.offload_optimizer,
                                                          zero_overrides=dict(t.deepspeed.zero_overrides))
            return self.learner
        self.learner = self._local = Learner(self.base_model, lcfg, self.tokenizer.pad_token_id,
                                             base_name=self.cfg.model.name, adapter_path=adapter_path,
                                             init_seed=self.cfg.seed if adapter_path is None else None)
        return self.learner

    def local_learner(self) -> Learner:
        """The RL learner as the in-process object it is (its modules), for what needs more than
        `TrainingClient`: the local sampler's policy, DPO's pair metrics. Refused on a worker."""
        if self.worker is not None:
            raise ConfigError(f"experiment {self.name!r} trains on worker {self.worker.address}: its policy's "
                              "modules live there, not in this process")
        if self._local is None:
            self.start_rl()
        return self._local

    @property
    def policy(self) -> torch.nn.Module:
        """The model the local sampler decodes with: the learner's (the adapter applied), else the base."""
        if self.worker is not None:
            raise ConfigError(f"experiment {self.name!r} samples on worker {self.worker.address}: its policy "
                              "lives there")
        return self._local.model if self._local is not None else self.base_model

    def sampler(self) -> "Sampler | RemoteSampler":
        if self.worker is not None:
            from tinker_pipelines.worker.client import RemoteSampler

            if self.learner is None:
                self.start_rl()
            return RemoteSampler(self.worker, self.name)
        return Sampler(self.policy, self.tokenizer.pad_token_id, stop_token_ids(self.tokenizer), tokenizer=self.tokenizer)

    def rollout(self, iteration: int) -> RolloutStats:
        """Sample `groups_per_batch` tasks x `group_size` episodes for `iteration`."""
        t = self.cfg.training
        task_rng = random.Random(derived_seed(self.cfg.seed, "tasks", iteration))
        seeds = [task_rng.randrange(EVAL_SEED_OFFSET) for _ in range(t.groups_per_batch)]
        start = time.perf_counter()
        if t.deepspeed.stage > 0:  # ranks of one batch: each samples its share of the groups
            groups = self._split_rollout(seeds, iteration)
        else:
            gen = torch.Generator().manual_seed(derived_seed(self.cfg.seed, "sample", iteration))
            groups = run_groups(self.sampler(), self.tokenizer, self.env_spec, seeds, t.group_size,
                                self.rollout_cfg, gen)
        metrics = summarize_groups(groups)
        metrics["time/rollout_s"] = time.perf_counter() - start
        return RolloutStats(groups, metrics)

    def _split_rollout(self, seeds: list[int], iteration: int) -> list[TrajectoryGroup]:
        """Under DeepSpeed: rank r samples a contiguous share of the groups (`rank_share`), each group
        with a generator of its own seeded by the seed, the iteration and the group's index (never
        the rank), then every rank gathers all of them in group order. So the gathered batch is the
        one a single rank samples with the same seed, and sampling scales with the ranks."""
        if self.learner is None:
            self.start_rl()  # joins the process group
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        lo, hi = rank_share(len(seeds), rank, world)
        gens = [torch.Generator().manual_seed(derived_seed(self.cfg.seed, "sample", iteration, g)) for g in range(lo, hi)]
        mine = run_groups(self.sampler(), self.tokenizer, self.env_spec, seeds[lo:hi], self.cfg.training.group_size,
                          self.rollout_cfg, gens) if gens else []
        gathered: list[list[TrajectoryGroup]] = [[] for _ in range(world)]
        torch.distributed.all_gather_object(gathered, mine)
        self.rollout_share = {"rank": rank, "world": world, "groups": hi - lo,
                              "rows": sum(len(g.trajectories) for g in mine)}
        return [g for part in gathered for g in part]

    def score(self, groups: list[TrajectoryGroup]) -> list[Datum]:
        """Training datums with advantages: the algorithm's group estimator (groups with uniform
        rewards dropped), or for a value-head algorithm (PPO) the critic's values at sampling
        time and GAE advantages and returns over every episode (`CriticDatum`). When the update
        passes over the batch more than once (`algorithm.ppo_epochs` > 1) with a KL reference,
        the datums carry their reference logprobs too, so the reference forward runs once per
        rollout instead of once per pass."""
        if self.learner is None:
            self.start_rl()
        if self.algorithm.value_head:
            c = self.loss_cfg
            datums = critic_datums(groups, self.learner.compute_values, c.gamma, c.gae_lambda, c.whiten_advantages)
        else:
            datums = rl_datums(groups, self.algorithm.advantages)
        if datums and self.epochs > 1 and self.learner.cfg.needs_reference:
            datums = with_reference_logprobs(datums, self.learner.compute_reference_logprobs)
        return datums

    def train_step(self, groups: list[TrajectoryGroup], datums: list[Datum] | None = None) -> dict[str, float]:
        """Advantages, then `train_epochs` over all informative episodes: `algorithm.ppo_epochs`
        passes of `algorithm.minibatches` optimizer steps (one step by default, several for PPO).
        `datums`, when given, are `score(groups)` computed earlier with the same policy. Metrics
        are the last pass's (`summarize_epochs`)."""
        if self.learner is None:
            self.start_rl()
        start = time.perf_counter()
        datums = self.score(groups) if datums is None else datums
        metrics: dict[str, float] = {"informative_groups": float(sum(len(set(g.rewards)) > 1 for g in groups))}
        if datums:  # when every group's rewards are uniform there is no gradient: skip the step
            a = self.cfg.algorithm
            history = train_epochs(self.learner, datums, self.algorithm.loss, self.loss_cfg, self.epochs,
                                   a.minibatches, a.target_kl, derived_seed(self.cfg.seed, "minibatches", self.iteration))
            metrics.update(summarize_epochs(history))
            if a.target_kl is not None:  # 1 when the KL stop cut the loop short
                metrics["kl_early_stop"] = float(metrics["optim_steps"] < self.epochs * min(a.minibatches, len(datums)))
        metrics["time/train_s"] = time.perf_counter() - start
        return metrics

    def evaluate(self, num_tasks: int | None = None) -> dict[str, float]:
        """Greedy decoding on held-out tasks; returns eval/* metrics."""
        n = num_tasks or self.cfg.eval.num_tasks
        seeds = [EVAL_SEED_OFFSET + i for i in range(n)]
        cfg = dataclasses.replace(self.rollout_cfg, temperature=0.0)  # greedy; stop strings still apply
        start = time.perf_counter()
        trajs = run_episodes(self.sampler(), self.tokenizer, [self.eval_spec.build() for _ in seeds], seeds, cfg)
        stats = summarize_groups([TrajectoryGroup(tuple(trajs))])
        out = {f"eval/{k}": v for k, v in stats.items() if k in ("reward_mean", "exact_rate", "contains_rate")}
        out["time/eval_s"] = time.perf_counter() - start
        return out

    def run_iteration(self, iteration: int) -> dict[str, float]:
        """Rollout, train, and evaluate when due; returns the iteration's metrics."""
        start = time.perf_counter()
        ro = self.rollout(iteration)
        metrics = {"iteration": float(iteration), **ro.metrics, **self.train_step(ro.groups)}
        if eval_due(iteration, self.cfg.eval.every, self.cfg.training.iterations):
            metrics.update(self.evaluate())
        self.iteration = iteration + 1
        metrics["time/iteration_s"] = time.perf_counter() - start
        return metrics

    def save(self, path: str | Path, metrics: dict[str, float] | None = None) -> dict[str, Any]:
        """Checkpoint the learner with the config, iteration, metrics and base (`bases.base_ref`:
        the warm start's content hash too) in its record."""
        record = {"config": config_to_dict(self.cfg), "iteration": self.iteration, "metrics": metrics or {},
                  "base": base_ref(self.cfg, self.sft_record)}
        if self.learner is None:
            self.start_rl()
        return self.learner.save_state(path, record)

    def resume_parked(self, at: int, checkpoint_hash: str) -> bool:
        """On a worker: take over this experiment's adapter where a previous holder parked it at
        iteration `at`, holding the checkpoint with `checkpoint_hash` (that of iteration at-1, or
        `NEVER_SAVED` at 0), instead of rebuilding it from that checkpoint. False when none was
        parked in that state: the learner is then a fresh one (`resume` it from the checkpoint)."""
        self.start_rl(claim=state_tag(at, checkpoint_hash))
        if self._remote is None:
            raise ConfigError(f"experiment {self.name!r} runs in-process: there is no parked adapter to resume")
        if not self._remote.claimed:
            return False
        if self._remote.record is not None:
            check_same_base(self._remote.record, self.sft_record, f"parked adapter {self.name!r}")
        self.iteration = at
        return True

    def park(self) -> bool:
        """On a worker: leave the adapter there for the next process of this experiment
        (`resume_parked`) when its state is the checkpoint it was last saved to or loaded from."""
        learner = self._remote
        if learner is None or learner.saved_hash is None:
            return False
        return learner.park(state_tag(self.iteration, learner.saved_hash))

    def resume(self, path: str | Path) -> dict[str, Any]:
        """Load a checkpoint made by `save`; the next iteration is the one after it."""
        if self.learner is None:
            self.start_rl()
        record = self.learner.load_state(path)
        check_same_base(record, self.sft_record, path)
        self.iteration = int(record["iteration"])
        return record


def rank_share(n: int, rank: int, world: int) -> tuple[int, int]:
    """Rank `rank`'s contiguous share [lo, hi) of `n` items over `world` ranks (sizes differ by at most one).

    >>> [rank_share(5, r, 2) for r in (0, 1)], rank_share(1, 1, 2)
    ([(0, 3), (3, 5)], (1, 1))
    """
    base, extra = divmod(n, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (rank < extra)


def state_tag(iteration: int, checkpoint_hash: str) -> str:
    """Names a parked adapter's state: positioned at `iteration`, holding that checkpoint."""
    return f"{iteration}:{checkpoint_hash}"


def train_epochs(learner: TrainingClient, datums: list[Datum], loss_fn: LossFn, loss_cfg: LossConfig, epochs: int = 1,
                 minibatches: int = 1, target_kl: float | None = None, seed: int = 0) -> list[list[dict[str, float]]]:
    """PPO's update loop over one scored rollout; returns each pass's per-minibatch metrics.

    The datums keep what scoring fixed (behaviour logprobs, advantages, old values, returns), so
    from the second minibatch on the ratio to the behaviour policy is no longer 1 and the
    policy and value clips act. Each pass shuffles the datums (from `seed`, so a resumed run
    repeats it) into `minibatches` near-equal minibatches, each one `forward_backward` and one
    `optim_step`; a minibatch keeps its datums in rollout order, so a group's episodes stay
    adjacent for prefix sharing. With `target_kl`, the loop stops after the first minibatch
    whose approximate KL (measured by its forward, before its step) exceeds it. One pass, one
    minibatch is the plain single step. Only `forward_backward` / `optim_step` are called, so
    a worker's `RemoteLearner` runs the same loop.
    """
    rng = random.Random(seed)
    n_minibatches = min(minibatches, len(datums))
    history: list[list[dict[str, float]]] = []
    for _ in range(epochs):
        order_N = list(range(len(datums)))
        rng.shuffle(order_N)
        history.append([])
        for k in range(n_minibatches):
            idx_M = sorted(order_N[k * len(datums) // n_minibatches:(k + 1) * len(datums) // n_minibatches])
            metrics = learner.forward_backward([datums[i] for i in idx_M], loss_fn, loss_cfg)
            metrics.update(learner.optim_step())
            history[-1].append(metrics)
            if target_kl is not None and metrics.get("approx_kl", 0.0) > target_kl:
                return history
    return history


def summarize_epochs(history: list[list[dict[str, float]]]) -> dict[str, float]:
    """An iteration's update metrics: the mean over the last pass's minibatches of every metric
    (`clip_fraction`, `approx_kl`, `loss`, ...; `trained_tokens` summed: the tokens of a pass),
    plus `epochs` (passes begun) and `optim_steps`.

    >>> summarize_epochs([[{"loss": 1.0, "trained_tokens": 3.0}], [{"loss": 2.0, "trained_tokens": 1.0},
    ...                                                           {"loss": 4.0, "trained_tokens": 2.0}]])
    {'loss': 3.0, 'trained_tokens': 3.0, 'epochs': 2.0, 'optim_steps': 3.0}
    """
    last = history[-1]
    out = {k: sum(m[k] for m in last) / len(last) for k in last[0]}
    if "trained_tokens" in out:
        out["trained_tokens"] = sum(m["trained_tokens"] for m in last)
    out.update(epochs=float(len(history)), optim_steps=float(sum(map(len, history))))
    return out


def deterministic_metrics(metrics: dict[str, float]) -> dict[str, float]:
    """The metrics that must repeat exactly for the same config and seed (no timings)."""
    return {k: v for k, v in metrics.items() if not k.startswith("time/")}
