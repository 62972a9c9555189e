"""One RL step on SmolLM2-135M, LoRA vs full-parameter, each with the KL reference it needs.

    python -m benchmarks.lora_vs_full [--model smollm2-135m-instruct] [--batch 8] [--tokens 128] [--epochs 4]

LoRA's reference is the base with the adapter disabled; full-parameter training keeps a frozen
copy. LoRA runs twice: through our fused LoRA layers (`tinker_pipelines/training/lora_linear.py`, what the
learner uses) and through PEFT's own layer forwards (`lora-peft`, what a PEFT user gets). Each
mode runs in its own process (so peak memory is not shared) on the same datums: a GRPO loss
with a k3 KL penalty, one forward/backward and one Adam step, timed after a warm-up step, and
split into the reference forward, the policy forward, the backward and the optimizer step (the
two forwards timed again on their own). Peak memory is the process's peak resident
set size from after the model has loaded (weights included) to the end of the steps.

Then, in each process, a PPO-style update of `--epochs` passes over the same batch (one step
each), twice: with the reference logprobs scored once and carried by the datums (what
`Experiment.score` does when an update has several passes), and recomputed in every pass. The
last line is one JSON object (`epochs_time_ratio`: LoRA / full over that update).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time


def status_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def reset_peak() -> None:
    # Writing 5 to clear_refs resets VmHWM, so the peak excludes the (larger) GGUF load.
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _one_mode(mode: str, model_name: str, batch: int, tokens: int, steps: int, micro: int, epochs: int,
              queue: mp.Queue) -> None:
    import torch

    import tinker_pipelines.training.learner as learner_module
    from tinker_pipelines.algorithms import LossConfig, get_algorithm
    from tinker_pipelines.training.learner import Learner, LearnerConfig

    if mode == "lora-peft":  # this process only: the learner leaves PEFT's layers as they are
        learner_module.fuse_lora_layers = lambda model: 0
    from tinker_pipelines.models import load_model
    from tinker_pipelines.types import Datum

    model, tok = load_model(model_name)
    import gc

    gc.collect()
    reset_peak()
    after_load = status_mb("VmRSS")
    gen = torch.Generator().manual_seed(0)
    prompt = tokens // 2
    datums = []
    for i in range(batch):
        ids = torch.randint(0, len(tok), (tokens + 1,), generator=gen).tolist()
        w = [0.0] * (prompt - 1) + [1.0] * (tokens - prompt + 1)
        datums.append(Datum(tuple(ids[:-1]), tuple(ids[1:]), tuple(w), tuple(-2.0 * x for x in w),
                            tuple((1.0 if i % 2 else -1.0) * x for x in w)))
    learner = Learner(model, LearnerConfig(mode=mode.split("-")[0], learning_rate=1e-5, micro_batch_size=micro,
                                           needs_reference=True), tok.pad_token_id)
    loss_fn, loss_cfg = get_algorithm("grpo").loss, LossConfig(kl_coef=0.05)
    times, parts = [], []
    for _ in range(steps + 1):  # the first step allocates optimizer state: a warm-up
        start = time.perf_counter()
        learner.forward_backward(datums, loss_fn, loss_cfg)
        fb = time.perf_counter()
        learner.optim_step()
        times.append(time.perf_counter() - start)
        parts.append((fb - start, times[-1] - (fb - start)))
    peak = status_mb("VmHWM")
    best = min(range(1, steps + 1), key=lambda i: times[i])
    trainable = sum(p.numel() for p in learner.params)
    result = {"mode": mode, "peak_mb": peak, "after_load_mb": after_load, "step_s": times[best],
              "trainable": trainable, "breakdown": breakdown(learner, datums, micro, *parts[best])}
    if epochs > 1:
        result["update_s"] = passes(learner, datums, loss_fn, loss_cfg, epochs, scored=True)
        result["update_uncached_s"] = passes(learner, datums, loss_fn, loss_cfg, epochs, scored=False)
    queue.put(result)


def passes(learner, datums, loss_fn, loss_cfg, epochs: int, scored: bool) -> float:
    """Seconds for a PPO-style update of `epochs` passes (one step each) over the batch; `scored`:
    the reference logprobs computed once first and carried by the datums (what `Experiment.score`
    does when there are several passes), else recomputed in every pass."""
    from tinker_pipelines.loops.datums import with_reference_logprobs
    from tinker_pipelines.loops.experiment import train_epochs

    start = time.perf_counter()
    if scored:
        datums = with_reference_logprobs(datums, learner.compute_reference_logprobs)
    train_epochs(learner, datums, loss_fn, loss_cfg, epochs)
    return time.perf_counter() - start


def breakdown(learner, datums, micro: int, forward_backward_s: float, optimizer_s: float) -> dict:
    """Where one step's time went: the KL reference's forward (no gradient), the policy's forward
    with the graph kept, the backward (the rest of `forward_backward`: the loss, autograd), and
    the optimizer step (clip + Adam). The two forwards are timed again on their own, after the step."""
    from tinker_pipelines.training.learner import pad_datums

    padded = [pad_datums(datums[i:i + micro], learner.pad_token_id, learner.device)
              for i in range(0, len(datums), micro)]
    start = time.perf_counter()
    for p in padded:
        learner.reference_logprobs(p)
    reference = time.perf_counter() - start
    start = time.perf_counter()
    for p in padded:
        lp, _ = learner._forward(learner.model, p)
        del lp
    forward = time.perf_counter() - start
    return {"reference_s": round(reference, 3), "forward_s": round(forward, 3),
            "backward_s": round(max(0.0, forward_backward_s - reference - forward), 3),
            "optimizer_s": round(optimizer_s, 3)}


def _export(model_name: str, out: str) -> None:
    from tinker_pipelines.models import load_model

    model, tok = load_model(model_name)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def export_as_directory(model_name: str, out: str) -> None:
    """Save the model as a plain safetensors directory, in a child process: loading it from
    there leaves no GGUF-dequantization garbage in the measured processes' resident set."""
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_export, args=(model_name, out))
    proc.start()
    proc.join()
    if proc.exitcode:
        raise RuntimeError(f"exporting {model_name} failed (exit code {proc.exitcode})")


def measure(mode: str, model: str, batch: int, tokens: int, steps: int, micro: int, epochs: int) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_one_mode, args=(mode, model, batch, tokens, steps, micro, epochs, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4,
                        help="passes of the PPO-style update also timed (PPO's default 4; 1: skip it)")
    parser.add_argument("--micro-batch", type=int, default=2,
                        help="sequences per forward/backward; gradients accumulate over the batch")
    args = parser.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as model_dir:
        export_as_directory(args.model, model_dir)
        lora = measure("lora", model_dir, args.batch, args.tokens, args.steps, args.micro_batch, args.epochs)
        peft = measure("lora-peft", model_dir, args.batch, args.tokens, args.steps, args.micro_batch, args.epochs)
        full = measure("full", model_dir, args.batch, args.tokens, args.steps, args.micro_batch, args.epochs)
    print(f"{args.model}, one GRPO+KL step, batch {args.batch} x {args.tokens} tokens "
          f"(micro-batches of {args.micro_batch})")
    print(f"{'mode':<10}{'trainable':>14}{'loaded MB':>11}{'peak MB':>10}{'step s':>9}")
    for r in (lora, peft, full):
        print(f"{r['mode']:<10}{r['trainable']:>14,}{r['after_load_mb']:>11.0f}{r['peak_mb']:>10.0f}{r['step_s']:>9.2f}")
    print("\nwhere a step's time goes (s): reference forward (no gradient), policy forward, backward, optimizer")
    print(f"{'mode':<10}{'reference':>11}{'forward':>9}{'backward':>10}{'optimizer':>11}")
    for r in (lora, peft, full):
        b = r["breakdown"]
        print(f"{r['mode']:<10}{b['reference_s']:>11.2f}{b['forward_s']:>9.2f}{b['backward_s']:>10.2f}{b['optimizer_s']:>11.2f}")
    memory_ratio, time_ratio = lora["peak_mb"] / full["peak_mb"], lora["step_s"] / full["step_s"]
    peft_ratio = peft["step_s"] / full["step_s"]
    # Without a KL penalty neither mode runs its reference forward (a separate no-gradient pass).
    no_kl = {r["mode"]: r["step_s"] - r["breakdown"]["reference_s"] for r in (lora, full)}
    no_kl_ratio = no_kl["lora"] / no_kl["full"]
    print(f"without a KL reference (the step less its reference forward): LoRA / full time {no_kl_ratio:.2f}x")
    print(f"LoRA / full: memory {memory_ratio:.2f}x (goal <= 0.6), time {time_ratio:.2f}x (goal <= 0.7); "
          f"through PEFT's layers: time {peft_ratio:.2f}x, fused / PEFT {lora['step_s'] / peft['step_s']:.2f}x")
    update = {}
    if args.epochs > 1:
        print(f"\na PPO-style update: {args.epochs} passes over the batch, one step each (s)")
        print(f"{'mode':<10}{'reference once':>16}{'every pass':>12}")
        for r in (lora, peft, full):
            print(f"{r['mode']:<10}{r['update_s']:>16.2f}{r['update_uncached_s']:>12.2f}")
        update = {"epochs": args.epochs, "epochs_time_ratio": round(lora["update_s"] / full["update_s"], 3),
                  "epochs_uncached_time_ratio": round(lora["update_uncached_s"] / full["update_uncached_s"], 3),
                  "lora_update_s": round(lora["update_s"], 3), "full_update_s": round(full["update_s"], 3),
                  "lora_update_uncached_s": round(lora["update_uncached_s"], 3),
                  "full_update_uncached_s": round(full["update_uncached_s"], 3)}
        print(f"LoRA / full over the update: {update['epochs_time_ratio']:.2f}x with the reference scored once, "
              f"{update['epochs_uncached_time_ratio']:.2f}x recomputing it every pass")
    print(json.dumps({"memory_ratio": round(memory_ratio, 3), "time_ratio": round(time_ratio, 3),
                      "no_kl_time_ratio": round(no_kl_ratio, 3), "peft_time_ratio": round(peft_ratio, 3),
                      "peft_memory_ratio": round(peft["peak_mb"] / full["peak_mb"], 3),
                      "lora_peak_mb": round(lora["peak_mb"]), "full_peak_mb": round(full["peak_mb"]),
                      "lora_step_s": round(lora["step_s"], 3), "full_step_s": round(full["step_s"], 3),
                      "lora_breakdown": lora["breakdown"], "peft_breakdown": peft["breakdown"],
                      "full_breakdown": full["breakdown"],
                      "model": args.model, "batch": args.batch, "tokens": args.tokens,
                      "micro_batch": args.micro_batch, **update}))


if __name__ == "__main__":
    main()
