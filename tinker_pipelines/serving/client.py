"""The same agent against the served model: a sampler that talks to the endpoint.

`EndpointSampler` has the `Sampler` interface `run_episodes` uses (`sample`, `stop_token_ids`,
`max_context`), so an env episode plays against a served version through the rollout code of
training. Each call is one `/v1/completions` request with token-id prompts (the whole batch) and
token ids back (`return_tokens_as_token_ids`, as vLLM spells it), so the record stays token-exact.
Greedy decoding gives the in-process tokens; with temperature > 0 the request's `seed` is drawn
from the caller's generator, so a seeded rollout repeats (but draws other uniforms than in-process).

    metrics = evaluate_endpoint("http://127.0.0.1:8000/v1", "tinker-quickstart@champion", num_tasks=32)
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import torch

from tinker_pipelines.rollout.sampler import ContextOverflowError, Sample


class EndpointError(RuntimeError):
    """The endpoint refused or failed a request; the message is its OpenAI error message."""

    def __init__(self, status: int, body: dict[str, Any]):
        err = body.get("error") or {}
        super().__init__(f"HTTP {status}: {err.get('message', body)}")
        self.status, self.code = status, err.get("code")


def _call(url: str, body: dict | None = None, timeout_s: float = 600.0) -> dict[str, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            payload = json.loads(raw)
        except ValueError:
            payload = {"error": {"message": raw.decode(errors="replace")}}
        if payload.get("error", {}).get("code") == "context_length_exceeded":
            raise ContextOverflowError(payload["error"]["message"]) from None
        raise EndpointError(e.code, payload) from None


class EndpointSampler:
    """Samples from `model` on the endpoint at `base_url` (`http://host:port/v1`)."""

    def __init__(self, base_url: str, model: str, timeout_s: float = 600.0):
        self.base_url, self.model, self.timeout_s = base_url.rstrip("/"), model, timeout_s
        self.card = _call(f"{self.base_url}/models/{model}", timeout_s=timeout_s)
        self.stop_token_ids = list(self.card["stop_token_ids"])
        self.max_context = self.card["max_model_len"]

    def sample(self, prompts: list[list[int]], max_new_tokens: int, temperature: float = 1.0,
               generator: torch.Generator | None = None) -> list[Sample]:
        if not prompts:
            return []
        body: dict[str, Any] = {"model": self.model, "prompt": [list(map(int, p)) for p in prompts],
                                "max_tokens": max_new_tokens, "temperature": temperature, "logprobs": 0,
                                "return_tokens_as_token_ids": True}
        if temperature > 0 and generator is not None:
            body["seed"] = int(torch.randint(0, 2**62, (1,), generator=generator))
        out = _call(f"{self.base_url}/completions", body, self.timeout_s)
        samples = []
        for choice in sorted(out["choices"], key=lambda c: c["index"]):
            lp = choice["logprobs"]
            tokens = tuple(int(t.removeprefix("token_id:")) for t in lp["tokens"])
            samples.append(Sample(tokens, tuple(lp["token_logprobs"]), choice["finish_reason"]))
        return samples


def evaluate_endpoint(base_url: str, model: str, num_tasks: int | None = None) -> dict[str, float]:
    """`Experiment.evaluate` of the served version `model` (greedy, held-out tasks), played over
    HTTP: the env and rollout settings come from the version's config (its `/v1/models` card)."""
    from tinker_pipelines.config import config_from_dict
    from tinker_pipelines.loops.experiment import EVAL_SEED_OFFSET, summarize_groups
    from tinker_pipelines.models import load_tokenizer
    from tinker_pipelines.rollout.episodes import RolloutConfig, run_episodes
    from tinker_pipelines.types import TrajectoryGroup

    sampler = EndpointSampler(base_url, model)
    if "tinker" not in sampler.card:
        raise ValueError(f"{model!r} is the endpoint's base, not a registered version: there is no env to evaluate on")
    if sampler.card["tinker"].get("config") is None:
        raise ValueError(f"{model!r} was saved through the Tinker API and has no run config: there is no env to "
                         "evaluate on")
    cfg = config_from_dict(sampler.card["tinker"]["config"])
    tokenizer = load_tokenizer(cfg.model.name)
    spec = cfg.env.spec(evaluation=True)
    n = num_tasks or cfg.eval.num_tasks
    seeds = [EVAL_SEED_OFFSET + i for i in range(n)]
    t = cfg.training
    trajs = run_episodes(sampler, tokenizer, [spec.build() for _ in seeds], seeds,
                         RolloutConfig(t.max_new_tokens, 0.0, t.max_turns))
    stats = summarize_groups([TrajectoryGroup(tuple(trajs))])
    return {f"eval/{k}": v for k, v in stats.items() if k in ("reward_mean", "exact_rate", "contains_rate")}
