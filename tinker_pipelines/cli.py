"""`tinker-pipelines train CONFIG.yaml`: SFT warm start then RL, in a plain Python loop."""

from __future__ import annotations

import argparse
import sys

from tinker_pipelines.config import ConfigError, load_config


def _fmt(metrics: dict[str, float]) -> str:
    keys = ("iteration", "reward_mean", "exact_rate", "eval/exact_rate", "eval/reward_mean", "loss", "kl",
            "grad_norm", "sampled_tokens", "time/iteration_s")
    parts = []
    for k in keys:
        if k in metrics:
            v = metrics[k]
            parts.append(f"{k}={int(v)}" if k in ("iteration", "sampled_tokens") else f"{k}={v:.4g}")
    return " ".join(parts)


def cmd_train(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    try:
        cfg = load_config(args.config)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.output_dir:
        from dataclasses import replace

        cfg = replace(cfg, output_dir=args.output_dir)
    from tinker_pipelines.train import train

    sft_bar = tqdm(total=cfg.sft.steps, desc="sft", unit="step", disable=not cfg.sft.steps, file=sys.stderr)
    rl_bar = tqdm(total=cfg.training.iterations, desc="rl", unit="it", file=sys.stderr)

    def on_sft(step: int, m: dict[str, float]) -> None:
        sft_bar.update(1)
        sft_bar.set_postfix(loss=f"{m['loss']:.3f}")

    def on_iter(m: dict[str, float]) -> None:
        if m["iteration"] >= 0:
            rl_bar.update(1)
        tqdm.write(_fmt(m), file=sys.stdout)

    train(cfg, on_iteration=on_iter, on_sft_step=on_sft, resume=args.resume)
    sft_bar.close()
    rl_bar.close()
    print(f"done: checkpoints and metrics.jsonl in {cfg.output_dir}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tinker-pipelines", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="SFT warm start (if configured) then RL from one YAML config")
    p.add_argument("config", help="path to the YAML config")
    p.add_argument("--output-dir", help="override output_dir")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in output_dir")
    p.set_defaults(func=cmd_train)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
