"""`benchmarks.tinker_api --part api`: the arithmetic recipe's RL steps through the official SDK
against the service, and the same steps on our in-process learner and sampler.

Each step, on both sides: sample the batch's groups (the recipe's problems and prompt tokens,
`cookbook_replica`), score them with the recipe's reward, build the recipe's datums,
`forward_backward(importance_sampling)`, `optim_step`. Both start from the same base and LoRA
seed (the SDK's `create_lora_training_client(seed=...)`; in-process `Learner(init_seed=...)`),
with Tinker's Adam (beta2 0.95, eps 1e-12, no clipping, no weight decay).

The SDK side samples as the recipe's completer does (`tinker_cookbook/completers.py`): one
unseeded `sample` call per row (num_samples 1), all of a step's calls in flight together; the
in-process side samples every row in one call.

So that the losses can be compared exactly, the in-process side trains on the datums built from
the SDK's samples (its own sampling still runs, on the same prompts and parameters, and is
timed); the service must then give the same `loss:sum` and the same per-token logprobs of every
datum at every step, within 1e-5 in fp32. `api_vs_inprocess` is the SDK side's time over the
in-process side's (goal <= 1.2).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from benchmarks import cookbook_replica as rep
from benchmarks import cookbook_runs as cr

LOSS_TOLERANCE = 1e-5


def group_datums(prompt: list[int], seqs: list[tuple[list[int], list[float], bool]], x: int, y: int,
                 tokenizer) -> list:
    """The recipe's datums for one group of (tokens, logprobs, reached_stop) replies."""
    rewards_G = np.array([rep.reward(tokenizer.decode(list(t)), stop, x, y) for t, _, stop in seqs])
    adv_G = rewards_G - rewards_G.mean()
    return [rep.rl_datum(prompt, tuple(t), tuple(lp), float(a)) for (t, lp, _), a in zip(seqs, adv_G)]


def to_sdk_datum(d):
    """Our `Datum` as the SDK's (`tinker.Datum`), as the cookbook builds it
    (`rl/data_processing.py`): model input, target tokens, sampling logprobs, advantages."""
    import tinker
    import torch
    from tinker import TensorData

    return tinker.Datum(model_input=tinker.ModelInput.from_ints(list(d.input_tokens)), loss_fn_inputs={
        "target_tokens": TensorData.from_torch(torch.tensor(d.target_tokens, dtype=torch.int64)),
        "logprobs": TensorData.from_torch(torch.tensor(d.behaviour_logprobs, dtype=torch.float32)),
        "advantages": TensorData.from_torch(torch.tensor(d.advantages, dtype=torch.float32))})


def sdk_steps(url: str, mdir: Path, s: rep.Settings, prompts: dict, steps: int, seed: int, tokenizer) -> dict:
    """The RL steps through the SDK; returns per-step losses, datums and seconds."""
    import tinker
    from tinker import types

    os.environ.update(TINKER_API_KEY=cr.API_KEY, TINKER_TELEMETRY="0")
    service = tinker.ServiceClient(base_url=url, api_key=cr.API_KEY)
    trainer = service.create_lora_training_client(base_model=str(mdir), rank=s.lora_rank, seed=seed).result()
    params = types.SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, stop=[rep.STOP])
    adam = types.AdamParams(learning_rate=s.learning_rate, beta1=0.9, beta2=0.95, eps=1e-12)
    losses, logprobs, datums_by_step, t0 = [], [], [], time.perf_counter()
    for i in range(steps):
        sampler = trainer.save_weights_and_get_sampling_client().result()
        futures = [[sampler.sample(tinker.ModelInput.from_ints(p), 1, params) for _ in range(s.group_size)]
                   for p in prompts[i]]
        datums = []
        for p, (x, y), fs in zip(prompts[i], rep.recipe_problems(i, s.groups_per_batch), futures):
            seqs = [(q.tokens, q.logprobs, q.stop_reason == "stop") for f in fs for q in f.result().sequences]
            datums += group_datums(p, seqs, x, y, tokenizer)
        out = trainer.forward_backward([to_sdk_datum(d) for d in datums], "importance_sampling").result()
        trainer.optim_step(adam).result()
        losses.append(float(out.metrics["loss:sum"]))
        logprobs.append([o["logprobs"].tolist() for o in out.loss_fn_outputs])
        datums_by_step.append(datums)
    seconds = time.perf_counter() - t0
    service.close("success").result()
    return {"losses": losses, "logprobs": logprobs, "datums": datums_by_step, "seconds": seconds}


def inprocess_steps(mdir: Path, s: rep.Settings, prompts: dict, sdk_datums: list, seed: int) -> dict:
    """The same steps on an in-process `Learner` and `Sampler`, training on the SDK's datums with
    the same Tinker loss (`Learner.tinker_forward_backward`) and Adam settings. The datums are
    taken as a Tinker client's (`datum_from_tinker`, as the service takes them)."""
    from tinker_pipelines.algorithms.tinker_losses import datum_from_tinker, tinker_loss

    r = rep.Replica(mdir, s, cr.COOKBOOK_PYTHON, seed)
    loss = tinker_loss("importance_sampling")
    adam = {"learning_rate": s.learning_rate, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
            "grad_clip_norm": 0.0}
    losses, logprobs, t0 = [], [], time.perf_counter()
    for i, datums in enumerate(sdk_datums):
        rows = [p for p in prompts[i] for _ in range(s.group_size)]
        r.sampler.sample(rows, s.max_tokens, s.temperature, r.generator, stop=(rep.STOP,))
        tinker_datums = [datum_from_tinker(d.input_tokens, {"target_tokens": d.target_tokens, "logprobs":
                                                            d.behaviour_logprobs, "advantages": d.advantages},
                                           loss=loss) for d in datums]
        lps, metrics = r.learner.tinker_forward_backward(tinker_datums, loss)
        r.learner.optim_step(adam)
        losses.append(float(metrics["loss:sum"]))
        logprobs.append([[float(v) for v in lp] for lp in lps])
    return {"losses": losses, "logprobs": logprobs, "seconds": time.perf_counter() - t0}


def part_api(mdir: Path, work: Path, steps: int, service) -> dict:
    """`api_vs_inprocess` and `api_losses_equal`."""
    from tinker_pipelines.models import load_tokenizer

    tokenizer = load_tokenizer(str(mdir))
    s = rep.Settings(**{k: cr.RL_SETTINGS[k] for k in vars(rep.Settings()) if k in cr.RL_SETTINGS})
    problems = [p for i in range(steps) for p in rep.recipe_problems(i, s.groups_per_batch)]
    flat = rep.render_prompts(mdir, problems, cr.COOKBOOK_PYTHON)
    prompts = {i: flat[i * s.groups_per_batch:(i + 1) * s.groups_per_batch] for i in range(steps)}
    with service(mdir, work / "api" / "home") as svc:
        sdk = sdk_steps(svc.url, mdir, s, prompts, steps, seed=0, tokenizer=tokenizer)
    local = inprocess_steps(mdir, s, prompts, sdk["datums"], seed=0)
    diffs = [abs(a - b) for a, b in zip(sdk["losses"], local["losses"])]
    lp_diffs = [logprob_diff(a, b) for a, b in zip(sdk["logprobs"], local["logprobs"])]
    ratio = sdk["seconds"] / local["seconds"]
    print(f"{'step':>6}{'SDK loss:sum':>16}{'in-process':>16}{'|diff|':>10}{'logprobs |diff|':>18}")
    for i, (a, b, d, e) in enumerate(zip(sdk["losses"], local["losses"], diffs, lp_diffs)):
        print(f"{i:>6}{a:>16.6f}{b:>16.6f}{d:>10.1e}{e:>18.1e}")
    print(f"{steps} steps: SDK {sdk['seconds']:.1f} s, in-process {local['seconds']:.1f} s, ratio {ratio:.2f} "
          "(goal <= 1.2)")
    equal = max(diffs) <= LOSS_TOLERANCE and max(lp_diffs) <= LOSS_TOLERANCE
    return {"api_vs_inprocess": round(ratio, 3), "api_losses_equal": bool(equal),
            "api_max_loss_diff": max(diffs), "api_max_logprob_diff": max(lp_diffs)}


def logprob_diff(a: list[list[float]], b: list[list[float]]) -> float:
    """Largest |difference| of two steps' per-datum, per-token logprobs (inf where their shapes differ).

    >>> logprob_diff([[-1.0, -2.0]], [[-1.0, -2.5]])
    0.5
    >>> logprob_diff([[-1.0]], [[-1.0, -2.0]])
    inf
    """
    if len(a) != len(b) or any(len(x) != len(y) for x, y in zip(a, b)):
        return float("inf")
    return max((abs(u - v) for x, y in zip(a, b) for u, v in zip(x, y)), default=0.0)
