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
from tinker_pipelines.rollout.sampler import ContextOverflowError, Sampler, completion_text
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
                 generator: torch.Generator | None = None) -> list[Trajectory]:
    """Play one episode per env (reset with the matching seed), all batched together."""
    episodes = []
    for env, seed in zip(envs, seeds, strict=True):
        messages = list(checked_reset(env, seed))
        context = tokenizer.encode(render_chat(tokenizer, messages), add_special_tokens=False)
        episodes.append(_Episode(env, env.task_id or str(seed), messages, context))
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


def run_groups(sampler: Sampler, tokenizer: PreTrainedTokenizerBase, env_spec: EnvSpec,
               task_seeds: list[int], group_size: int, cfg: RolloutConfig,
               generator: torch.Generator | None = None) -> list[TrajectoryGroup]:
    """`group_size` episodes of each task seed, all sampled in one batch."""
    seeds = [s for s in task_seeds for _ in range(group_size)]
    trajectories = run_episodes(sampler, tokenizer, [env_spec.build() for _ in seeds], seeds, cfg, generator)
    return [TrajectoryGroup(tuple(trajectories[i:i + group_size]))
            for i in range(0, len(trajectories), group_size)]
