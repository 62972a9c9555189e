"""The episode runner: drives many environments with one sampler, batched across episodes.

Each round collects the context of every live episode, samples all of them in one batched call,
and steps each environment. The context grows by the sampled tokens plus the tokens of the
environment's reply, so the record stays token-exact across turns.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import PreTrainedTokenizerBase

from tinker_pipelines.envs.base import Env, EnvSpec, checked_reset, checked_step
from tinker_pipelines.models import render_chat
from tinker_pipelines.rollout.lean_decoder import LeanDecoder
from tinker_pipelines.rollout.sampler import BASE, ContextOverflowError, SampleRequest, Sampler, completion_text
from tinker_pipelines.rollout.settings import SamplingSettings
from tinker_pipelines.types import Message, Trajectory, TrajectoryGroup, Turn


RolloutConfig = SamplingSettings
"""How episodes are sampled: the shared sampling settings (`rollout.settings`), under the runner's name."""


@dataclass
class _Episode:
    env: Env
    task_id: str
    messages: list[Message]
    context: list[int]
    turns: list[Turn] = field(default_factory=list)
    stop_reason: str | None = None
    info: dict = field(default_factory=dict)


def env_reply_tokens(tokenizer: PreTrainedTokenizerBase, messages: list[Message], action: str,
                     sampled_tokens: list[int], new_messages: list[Message]) -> list[int]:
    """Tokens that follow the sampled ones before the next turn: the end of the assistant turn
    as the chat template writes it, then the environment's messages and the generation prompt.

    Only these are tokenized from text; the sampled tokens are kept exactly as sampled.
    """
    prompt_text = render_chat(tokenizer, messages, add_generation_prompt=True)
    with_reply = messages + [{"role": "assistant", "content": action}]
    reply_text = render_chat(tokenizer, with_reply, add_generation_prompt=False)
    full_text = render_chat(tokenizer, with_reply + new_messages, add_generation_prompt=True)
    if not (reply_text.startswith(prompt_text) and full_text.startswith(reply_text)):
        raise ValueError("the chat template does not render conversations as growing prefixes; "
                         "multi-turn episodes need one that does")
    after_prompt = reply_text[len(prompt_text):]
    sampled_text = tokenizer.decode(sampled_tokens, skip_special_tokens=False)
    if after_prompt.startswith(sampled_text):
        bridge = after_prompt[len(sampled_text):]
    else:  # the template rewrote the reply (e.g. stripped it): keep what follows its content
        at = after_prompt.find(action)
        bridge = after_prompt[at + len(action):] if at >= 0 else ""
        eos = tokenizer.eos_token or ""
        if eos and sampled_text.endswith(eos) and bridge.startswith(eos):
            bridge = bridge[len(eos):]
    return tokenizer.encode(bridge + full_text[len(reply_text):], add_special_tokens=False)


def run_episodes(sampler: Sampler, tokenizer: PreTrainedTokenizerBase, envs: list[Env],
                 seeds: list[int], cfg: RolloutConfig,
                 generator: torch.Generator | list[torch.Generator] | None = None) -> list[Trajectory]:
    """Play one episode per env (reset with the matching seed), all batched together. `generator`
    may be a list, one per episode: episodes sharing one are a request of their own
    (`Sampler.sample_requests`), so their samples do not depend on the other episodes of the batch."""
    per_episode = isinstance(generator, list)
    if per_episode and len(generator) != len(envs):
        raise ValueError(f"{len(generator)} generators for {len(envs)} episodes")
    episodes = []
    for env, seed in zip(envs, seeds, strict=True):
        messages = list(checked_reset(env, seed))
        context = tokenizer.encode(render_chat(tokenizer, messages), add_special_tokens=False)
        episodes.append(_Episode(env, env.task_id or str(seed), messages, context))
    gen_of = {id(e): g for e, g in zip(episodes, generator)} if per_episode else {}
    stop_ids = set(sampler.stop_token_ids)
    while live := [e for e in episodes if e.stop_reason is None]:
        if sampler.max_context is not None:
            for e in live:
                if len(e.context) + cfg.max_new_tokens > sampler.max_context:
                    if not e.turns:
                        raise ContextOverflowError(
                            f"the first prompt of {type(e.env).__name__} (task {e.task_id}) has "
                            f"{len(e.context)} tokens; with max_new_tokens={cfg.max_new_tokens} "
                            f"it exceeds the model context of {sampler.max_context}; "
                            "shorten the prompt or lower training.max_new_tokens")
                    e.stop_reason = "context_overflow"
            live = [e for e in live if e.stop_reason is None]
            if not live:
                break
        if per_episode:
            live, samples = _sample_per_generator(sampler, live, [gen_of[id(e)] for e in live], cfg)
        else:
            samples = sampler.sample([e.context for e in live], cfg.max_new_tokens, cfg.temperature, generator,
                                     **cfg.sampling_kwargs())
        for e, s in zip(live, samples):
            action = completion_text(tokenizer, s, stop_ids)
            result = checked_step(e.env, action)
            e.turns.append(Turn(tuple(e.context), s.tokens, s.logprobs, float(result.reward), action, s.support))
            e.info = dict(result.info)
            if result.done:
                e.stop_reason = "done"
            elif len(e.turns) >= cfg.max_turns:
                e.stop_reason = "max_turns"
            else:
                reply = env_reply_tokens(tokenizer, e.messages, action, list(s.tokens), list(result.observation))
                e.messages += [{"role": "assistant", "content": action}, *result.observation]
                e.context = e.context + list(s.tokens) + reply
    return [Trajectory(tuple(e.turns), 0.0, e.task_id, e.stop_reason or "done", e.info) for e in episodes]


def _sample_per_generator(sampler: Sampler, live: list[_Episode], gens: list[torch.Generator],
                          cfg: RolloutConfig) -> tuple[list[_Episode], list]:
    """One batched call, one request per generator (in order of first use); returns the episodes in
    the order of their samples. A model without adapters decodes through the base-only decoder
    (`SampleRequest.adapter = BASE`), batch-invariant on CPU: a row's tokens and logprobs are the
    same whichever rows share its batch (the plain decoder's logprobs moved by ~5e-7 on the tiny model)."""
    order: dict[int, list[int]] = {}
    for i, g in enumerate(gens):
        order.setdefault(id(g), []).append(i)
    model = getattr(sampler, "model", None)
    plain = model is not None and not hasattr(model, "peft_config") and LeanDecoder.supports(model)
    requests = [SampleRequest([live[i].context for i in rows], cfg.max_new_tokens, cfg.temperature, gens[rows[0]],
                              BASE if plain else None, **cfg.sampling_kwargs()) for rows in order.values()]
    results = sampler.sample_requests(requests)
    return [live[i] for rows in order.values() for i in rows], [s for res in results for s in res]


def run_groups(sampler: Sampler, tokenizer: PreTrainedTokenizerBase, env_spec: EnvSpec,
               task_seeds: list[int], group_size: int, cfg: RolloutConfig,
               generator: torch.Generator | list[torch.Generator] | None = None) -> list[TrajectoryGroup]:
    """`group_size` episodes of each task seed, all sampled in one batch. `generator` may be a
    list, one per task: then a group's episodes depend only on its task and its generator, not on
    which other groups share the batch (`split_rollouts` decodes a share of the groups per rank)."""
    seeds = [s for s in task_seeds for _ in range(group_size)]
    if isinstance(generator, list):
        if len(generator) != len(task_seeds):
            raise ValueError(f"{len(generator)} generators for {len(task_seeds)} tasks")
        generator = [g for g in generator for _ in range(group_size)]
    trajectories = run_episodes(sampler, tokenizer, [env_spec.build() for _ in seeds], seeds, cfg, generator)
    return [TrajectoryGroup(tuple(trajectories[i:i + group_size]))
            for i in range(0, len(trajectories), group_size)]
