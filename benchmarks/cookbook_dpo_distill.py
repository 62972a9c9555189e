"""tinker-cookbook's DPO and SDFT (self-distillation) trainers, unmodified, against our Tinker service.

    python -m benchmarks.cookbook_dpo_distill                  # both, on SmolLM2, against a fresh service
    python -m benchmarks.cookbook_dpo_distill --part dpo       # or --part distill
    python -m benchmarks.cookbook_dpo_distill --model-dir DIR --work DIR

Neither trainer has a command line for local data (`recipes/preference/dpo/train.py` knows three
hub datasets; `recipes/sdft/train.py` two), so, as the cookbook's own docs advise, a script of
ours builds each trainer's config with a dataset builder of ours and calls its `main`:
`benchmarks/cookbook_drivers.py`, run in `.venv-cookbook` as a subprocess with the client's
environment (`cookbook_runs.client_env`). The data is local JSONL written here.

- DPO (`preference.train_dpo.main`): pairs `What is a + b?` -> the sum (chosen) against the sum
  off by 1, 2 or 10 (rejected). Its metric is `accuracy`: the fraction of a batch's pairs whose
  chosen reply gained more log-probability over the reference (the frozen start) than the
  rejected one (`train_dpo.compute_dpo_loss`; step 0 is policy == reference, a tie). Also `margin`.
- Distillation (`distillation.sdft.main`, `topk=0`): the teacher is the base model shown the
  question and a golden answer (`a + b = c`); the student is a LoRA that starts elsewhere: a
  checkpoint trained first, by the cookbook's `chat_sl` recipe, to answer every such question
  "Let me count on my fingers." Each step the student samples replies to the question alone, the
  teacher scores them, and the per-token advantage is teacher_lp - student_lp. SDFT logs
  `sdft/mean_student_lp` and `sdft/mean_teacher_lp` over the sampled tokens: their difference
  (minus `sdft/mean_advantage`) is the sampled estimate of KL(student || teacher) per token, the
  KL this reports.

  `topk=K` (1..20) runs SDFT's `reverse=True` instead: the teacher's top-K
  (`sample(topk_prompt_logprobs=K)`) as (N, K) soft targets of a custom loss, and the KL is the
  trainer's own `sdft/reverse_kl_mean` (exact over that top-K). It costs K times the training
  work here (each column is a datum on the worker), so the default is `topk=0`.

Each part returns `{"completed": bool, ...metrics}`; `run_dpo` and `run_distill` take a running
service's URL, so a longer benchmark can import them. Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import cookbook_runs as cr

DRIVER = Path(__file__).resolve().parent / "cookbook_drivers.py"
DPO_ACCURACY = "accuracy"
DPO_MARGIN = "margin"
SDFT_TEACHER_LP = "sdft/mean_teacher_lp"
SDFT_STUDENT_LP = "sdft/mean_student_lp"
SDFT_REVERSE_KL = "sdft/reverse_kl_mean"
WARM_REPLY = "Let me count on my fingers."
"""What the distillation's student is first trained to answer, whatever the sum."""


# -- local data ----------------------------------------------------------------------------
def _sums(n: int, seed: int) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    return [(rng.randint(0, 50), rng.randint(0, 50)) for _ in range(n)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def arithmetic_pairs(n: int, seed: int = 0) -> list[dict]:
    """DPO pairs: the right sum is chosen, a sum off by 1, 2 or 10 rejected."""
    rng = random.Random(seed + 1)
    return [{"prompt": f"What is {a} + {b}?", "chosen": str(a + b),
             "rejected": str(a + b + rng.choice((-10, -2, -1, 1, 2, 10)))} for a, b in _sums(n, seed)]


def arithmetic_demos(n: int, seed: int = 0) -> list[dict]:
    """SDFT questions with their golden answers."""
    return [{"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}"} for a, b in _sums(n, seed)]


def warm_start_conversations(n: int, seed: int = 0) -> list[dict]:
    """chat_sl conversations that teach the student one fixed reply, far from the teacher's."""
    return [{"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                          {"role": "assistant", "content": WARM_REPLY}]} for a, b in _sums(n, seed)]


# -- runs ----------------------------------------------------------------------------------
def driver_argv(kind: str, settings: dict, python: str | Path = cr.COOKBOOK_PYTHON) -> list[str]:
    """The command line of our driver script (`dpo` or `sdft`) in the cookbook's environment."""
    if kind not in ("dpo", "sdft"):
        raise ValueError(f"kind must be 'dpo' or 'sdft', got {kind!r}")
    return [str(python), str(DRIVER), kind, *cr._chz(settings)]


def _ends(curve: list[tuple[int, float]], k: int) -> tuple[float | None, float | None]:
    """Mean of the first and of the last `k` values (fewer when the curve is short)."""
    if not curve:
        return None, None
    k = max(1, min(k, len(curve) // 2 or 1))
    values = [v for _, v in curve]
    return sum(values[:k]) / k, sum(values[-k:]) / k


def _finish(run: cr.RecipeRun, what: str, steps: int) -> tuple[bool, str | None, list[dict]]:
    """(completed, error line, metrics rows): completed means it exited 0 after logging every
    step and saving its final checkpoint."""
    try:
        run.check(what)
        rows = cr.read_metrics(run.log_path)
        logged = sorted({r["step"] for r in rows if isinstance(r.get("step"), int)})
        if len(logged) < steps:
            raise cr.RecipeError(f"{what} logged {len(logged)} of {steps} steps")
        cr.final_checkpoint(run.log_path)
        return True, None, rows
    except cr.RecipeError as e:
        try:
            rows = cr.read_metrics(run.log_path)
        except cr.RecipeError:
            rows = []
        return False, str(e), rows


def _check_positive(**values: int | float) -> None:
    for name, v in values.items():
        if not v > 0:
            raise ValueError(f"{name} must be > 0, got {v}")


DPO_PRESETS = {
    "smollm2": {"pairs": 80, "batch_size": 8, "num_epochs": 1, "learning_rate": 5e-4, "k": 3},
    "tiny": {"pairs": 16, "batch_size": 16, "num_epochs": 4, "learning_rate": 2e-3, "k": 2},
}
"""run_dpo's defaults by model. SmolLM2: 10 steps of fresh pairs (it learns to prefer the right
sum on pairs it has not seen). tiny has random weights, so nothing it learns about sums carries
to unseen pairs: 4 epochs over one batch of 16, which it learns to rank."""
DISTILL_PRESETS = {
    "smollm2": {"steps": 8, "learning_rate": 2e-3, "warm_learning_rate": 1e-3, "k": 3, "topk": 0},
    "tiny": {"steps": 6, "learning_rate": 1e-2, "warm_learning_rate": 1e-2, "k": 2, "topk": 0},
}
"""run_distill's defaults by model: tiny's near-uniform distributions move only at larger rates
(its warm start at 1e-3 barely leaves the base). `topk=0`: SDFT's top-K modes make each datum K
datums on the worker (`tinker_losses.soft_target_columns`), K times the training work: at topk=5
SmolLM2's SDFT steps took 180-200 s on a machine loaded to ~15, against 30-50 s for topk=0 at a
load of 4-5 (their reverse_kl_mean fell 1.66, 0.97, 0.73 in 3 steps)."""


def model_kind(model_dir: str | Path) -> str:
    """'tiny' for a `tiny` written by `tinker-pipelines model-dir` (its record.json says so), else
    'smollm2' (whose settings suit a pretrained small model)."""
    try:
        source = json.loads((Path(model_dir) / "record.json").read_text()).get("source") or {}
    except (OSError, ValueError, AttributeError):
        return "smollm2"
    return "tiny" if isinstance(source, dict) and source.get("name") == "tiny" else "smollm2"


def _settings(presets: dict, model_dir: str | Path, given: dict) -> dict:
    """The model's preset with every argument the caller gave (not None) over it."""
    return {**presets[model_kind(model_dir)], **{k: v for k, v in given.items() if v is not None}}


def run_dpo(base_url: str, model_dir: str | Path, work_dir: str | Path, *, pairs: int | None = None,
            batch_size: int | None = None, num_epochs: int | None = None, learning_rate: float | None = None,
            dpo_beta: float = 0.1, lora_rank: int = 8, seed: int = 0, k: int | None = None,
            api_key: str = cr.API_KEY, timeout_s: float = 1800, python: str | Path = cr.COOKBOOK_PYTHON) -> dict:
    """`train_dpo.main` on `pairs` arithmetic pairs, `batch_size` pairs a step, for `num_epochs`
    (steps = pairs // batch_size * num_epochs); what is not given comes from `DPO_PRESETS`.
    `accuracy_first`/`_last`: mean `accuracy` of the first and last `k` steps (likewise `margin_`)."""
    s = _settings(DPO_PRESETS, model_dir, dict(pairs=pairs, batch_size=batch_size, num_epochs=num_epochs,
                                                learning_rate=learning_rate, k=k))
    pairs, batch_size, num_epochs, learning_rate, k = (s[x] for x in ("pairs", "batch_size", "num_epochs",
                                                                      "learning_rate", "k"))
    _check_positive(pairs=pairs, batch_size=batch_size, num_epochs=num_epochs, learning_rate=learning_rate,
                    dpo_beta=dpo_beta, lora_rank=lora_rank, k=k)
    if pairs < batch_size:
        raise ValueError(f"pairs ({pairs}) must be >= batch_size ({batch_size}): the trainer drops a partial batch")
    work = Path(work_dir)
    data = write_jsonl(work / "dpo_pairs.jsonl", arithmetic_pairs(pairs, seed))
    log = work / "dpo"
    settings = {"model_name": str(Path(model_dir).resolve()), "pairs": str(data), "log_path": str(log),
                "base_url": base_url, "lora_rank": lora_rank, "learning_rate": learning_rate,
                "dpo_beta": dpo_beta, "batch_size": batch_size, "num_epochs": num_epochs}
    steps = pairs // batch_size * num_epochs
    run = cr.run_recipe(driver_argv("dpo", settings, python), cr.client_env(base_url, api_key, runs_dir=work),
                        log, work / "dpo.out", timeout_s)
    completed, error, rows = _finish(run, "the DPO driver", steps)
    accuracy = cr.metric_curve(rows, DPO_ACCURACY)
    margin = cr.metric_curve(rows, DPO_MARGIN)
    acc_first, acc_last = _ends(accuracy, k)
    margin_first, margin_last = _ends(margin, k)
    return {"completed": completed, "error": error, "steps": len(accuracy), "accuracy_first": acc_first,
            "accuracy_last": acc_last, "margin_first": margin_first, "margin_last": margin_last,
            "accuracy_curve": accuracy, "margin_curve": margin, "seconds": round(run.seconds, 1),
            "log_path": str(log)}


def kl_curve(rows: list[dict], topk: int = 0) -> list[tuple[int, float]]:
    """SDFT's KL(student || teacher) per token by step. topk > 0 (`reverse=True`): the trainer's
    own `sdft/reverse_kl_mean`, exact over the teacher's top-K (both renormalized there). topk=0:
    the sampled estimate, `sdft/mean_student_lp` minus `sdft/mean_teacher_lp` (steps whose batch
    had no completion tokens log neither)."""
    if topk > 0:
        return cr.metric_curve(rows, SDFT_REVERSE_KL)
    teacher = dict(cr.metric_curve(rows, SDFT_TEACHER_LP))
    return [(step, lp - teacher[step]) for step, lp in cr.metric_curve(rows, SDFT_STUDENT_LP) if step in teacher]


def warm_start(base_url: str, model_dir: str | Path, work: Path, *, conversations: int, batch_size: int,
               epochs: int, learning_rate: float, lora_rank: int, seed: int, api_key: str, timeout_s: float,
               python: str | Path) -> tuple[str | None, dict]:
    """The student's starting checkpoint: the cookbook's chat_sl recipe on
    `warm_start_conversations`; (its final `state_path` or None, what it measured)."""
    data = write_jsonl(work / "warm_start.jsonl", warm_start_conversations(conversations, seed + 1000))
    log = work / "warm_start"
    argv = cr.chat_sl_argv(model_dir, base_url, log, data, python=python, settings={
        "lora_rank": lora_rank, "batch_size": batch_size, "num_epochs": epochs, "learning_rate": learning_rate,
        "max_length": 256})
    run = cr.run_recipe(argv, cr.client_env(base_url, api_key, runs_dir=work), log, work / "warm_start.out",
                        timeout_s)
    completed, error, rows = _finish(run, "chat_sl (the student's warm start)", conversations // batch_size * epochs)
    nll = cr.metric_curve(rows, cr.SL_LOSS_KEY)
    report = {"warm_start_seconds": round(run.seconds, 1), "warm_start_nll_first": nll[0][1] if nll else None,
              "warm_start_nll_last": nll[-1][1] if nll else None, "error": error}
    return (cr.final_checkpoint(log)["state_path"] if completed else None), report


def run_distill(base_url: str, model_dir: str | Path, work_dir: str | Path, *, steps: int | None = None,
                groups_per_batch: int = 8, group_size: int = 2, max_tokens: int = 12,
                learning_rate: float | None = None, lora_rank: int = 8, warm_conversations: int = 32,
                warm_batch_size: int = 8, warm_epochs: int = 2, warm_learning_rate: float | None = None,
                seed: int = 0, k: int | None = None, topk: int | None = None, api_key: str = cr.API_KEY,
                timeout_s: float = 1800, python: str | Path = cr.COOKBOOK_PYTHON) -> dict:
    """The student's warm start (`warm_start`), then `sdft.main` from it for `steps` steps of
    `groups_per_batch` questions x `group_size` samples: with `topk` > 0, `reverse=True` (the
    exact reverse KL over the teacher's top-K, a custom loss over (N, K) soft targets), with
    `topk=0` the per-token importance-sampling estimate. What is not given comes from
    `DISTILL_PRESETS`. `kl_first`/`_last`: mean KL(student || teacher) (`kl_curve`) of the first
    and last `k` steps; `kl_metric` names it."""
    s = _settings(DISTILL_PRESETS, model_dir, dict(steps=steps, learning_rate=learning_rate,
                                                    warm_learning_rate=warm_learning_rate, k=k, topk=topk))
    steps, learning_rate, warm_learning_rate, k, topk = (s[x] for x in ("steps", "learning_rate",
                                                                        "warm_learning_rate", "k", "topk"))
    if not 0 <= topk <= 20:
        raise ValueError(f"topk must be 0 (sampled KL) or 1..20 (the teacher's top-K), got {topk}")
    _check_positive(steps=steps, groups_per_batch=groups_per_batch, group_size=group_size, max_tokens=max_tokens,
                    learning_rate=learning_rate, lora_rank=lora_rank, warm_conversations=warm_conversations,
                    warm_batch_size=warm_batch_size, warm_epochs=warm_epochs,
                    warm_learning_rate=warm_learning_rate, k=k)
    work = Path(work_dir)
    t0 = time.perf_counter()
    start, warm = warm_start(base_url, model_dir, work, conversations=warm_conversations, batch_size=warm_batch_size,
                             epochs=warm_epochs, learning_rate=warm_learning_rate, lora_rank=lora_rank, seed=seed,
                             api_key=api_key, timeout_s=timeout_s, python=python)
    result = {"completed": False, "steps": 0, "kl_first": None, "kl_last": None, "kl_curve": [],
              "kl_metric": SDFT_REVERSE_KL if topk else f"{SDFT_STUDENT_LP} - {SDFT_TEACHER_LP}",
              "student_start": start, **warm}
    if start is None:
        return {**result, "seconds": round(time.perf_counter() - t0, 1)}
    data = write_jsonl(work / "sdft_demos.jsonl", arithmetic_demos(steps * groups_per_batch, seed))
    log = work / "sdft"
    settings = {"model_name": str(Path(model_dir).resolve()), "demos": str(data), "log_path": str(log),
                "base_url": base_url, "load_checkpoint_path": start, "learning_rate": learning_rate,
                "groups_per_batch": groups_per_batch, "group_size": group_size, "max_tokens": max_tokens,
                "topk": topk, "reverse": topk > 0, "loss_fn": "importance_sampling", "max_steps": steps}
    run = cr.run_recipe(driver_argv("sdft", settings, python), cr.client_env(base_url, api_key, runs_dir=work),
                        log, work / "sdft.out", max(60.0, timeout_s - (time.perf_counter() - t0)))
    completed, error, rows = _finish(run, "the SDFT driver", steps)
    kl = kl_curve(rows, topk)
    kl_first, kl_last = _ends(kl, k)
    return {**result, "completed": completed, "error": error, "steps": len(kl), "kl_first": kl_first,
            "kl_last": kl_last, "kl_curve": kl, "sdft_seconds": round(run.seconds, 1),
            "seconds": round(time.perf_counter() - t0, 1), "log_path": str(log)}


# -- benchmark -----------------------------------------------------------------------------
def _summary(dpo: dict | None, distill: dict | None) -> dict:
    out: dict = {}
    if distill is not None:
        out.update(cookbook_distill_completed=distill["completed"], cookbook_distill_kl_first=distill["kl_first"],
                   cookbook_distill_kl_last=distill["kl_last"], cookbook_distill_minutes=round(distill["seconds"] / 60, 2))
    if dpo is not None:
        out.update(cookbook_dpo_completed=dpo["completed"], cookbook_dpo_accuracy_first=dpo["accuracy_first"],
                   cookbook_dpo_accuracy_last=dpo["accuracy_last"], cookbook_dpo_minutes=round(dpo["seconds"] / 60, 2))
    return out


def _show(name: str, result: dict, curves: tuple[str, ...]) -> None:
    print(f"{name}: completed={result['completed']} in {result['seconds']:.0f} s", flush=True)
    for key in curves:
        if result.get(key):
            print(f" {key}:\n" + cr.curve_line(result[key]), flush=True)
    if result.get("error"):
        print(f"error: {name}: {result['error']}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    from benchmarks.tinker_api import model_dir, service

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("both", "dpo", "distill"), default="both")
    p.add_argument("--model-dir", help="a model directory (tinker-pipelines model-dir); default: SmolLM2, written")
    p.add_argument("--work", help="keep the run folders here (default: a temporary folder)")
    p.add_argument("--topk", type=int, help="distillation: SDFT reverse=True over the teacher's top-K (1..20); "
                                            "default 0, the sampled KL")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="cookbook_dpo_distill_") as tmp:
        work = Path(args.work or tmp).resolve()
        mdir = model_dir(work, args.model_dir)
        dpo = distill = None
        with service(mdir, work / "home") as svc:
            if args.part in ("both", "dpo"):
                dpo = run_dpo(svc.url, mdir, work / "dpo_run")
                _show("dpo", dpo, ("accuracy_curve", "margin_curve"))
            if args.part in ("both", "distill"):
                distill = run_distill(svc.url, mdir, work / "distill_run", topk=args.topk)
                _show("distill", distill, ("kl_curve",))
        print(json.dumps(_summary(dpo, distill)), flush=True)
    return 0 if all(r is None or r["completed"] for r in (dpo, distill)) else 1


if __name__ == "__main__":
    sys.exit(main())
