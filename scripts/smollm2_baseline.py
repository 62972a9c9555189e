"""Greedy baseline of SmolLM2-135M-Instruct on candidate "reply with the bare number" tasks.

For each phrasing: the exact-answer rate (reply stripped == the number) and the rate at which
the reply merely contains the right number. A good RL task starts with exact LOW and contains
HIGH, so RL only has to teach the format. Also reports generate throughput at batch 16.

    python scripts/smollm2_baseline.py [--n 96] [--batch 32] [--max-new-tokens 12] [--tasks all]
"""

from __future__ import annotations

import argparse
import random
import re
import time
import zlib
from collections.abc import Callable

import torch

from tinker_pipelines.models.smollm2 import load_smollm2

SYSTEM_NUM = "Answer with a single number and nothing else."
Problem = tuple[list[dict], str]


def _msgs(user: str, system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]


def _add(rng: random.Random, lo: int = 0, hi: int = 9) -> tuple[int, int]:
    return rng.randint(lo, hi), rng.randint(lo, hi)


def _task_add_sys(rng: random.Random) -> Problem:
    a, b = _add(rng)
    return _msgs(f"{a} + {b} = ?", SYSTEM_NUM), str(a + b)


def _task_add_q(rng: random.Random) -> Problem:
    a, b = _add(rng)
    return _msgs(f"What is {a} + {b}?"), str(a + b)


def _task_add_q_sys(rng: random.Random) -> Problem:
    a, b = _add(rng)
    return _msgs(f"What is {a} + {b}?", SYSTEM_NUM), str(a + b)


def _task_add2_sys(rng: random.Random) -> Problem:
    a, b = _add(rng, 10, 49)
    return _msgs(f"{a} + {b} = ?", SYSTEM_NUM), str(a + b)


def _task_repeat(rng: random.Random) -> Problem:
    n = str(rng.randint(1000, 9999))
    return _msgs(f"Repeat this number: {n}"), n


def _task_repeat_sys(rng: random.Random) -> Problem:
    n = str(rng.randint(1000, 9999))
    return _msgs(f"Repeat this number: {n}", SYSTEM_NUM), n


def _task_count(rng: random.Random) -> Problem:
    k = rng.randint(2, 9)
    return _msgs(f"How many letters are in this list: {' '.join('abcdefghij'[:k])}?"), str(k)


TASKS: dict[str, Callable[[random.Random], Problem]] = {
    "add1 '7 + 9 = ?' +sys": _task_add_sys,
    "add1 'What is 7 + 9?'": _task_add_q,
    "add1 'What is 7 + 9?' +sys": _task_add_q_sys,
    "add2 '23 + 41 = ?' +sys": _task_add2_sys,
    "repeat 'Repeat this number: 4821'": _task_repeat,
    "repeat +sys": _task_repeat_sys,
    "count letters": _task_count,
}
DEFAULT_TASKS = [name for name in TASKS if not name.startswith(("add2", "count"))]
"""add2 and count were near 0 on `contains` in a first 32-problem run; `--tasks all` runs them."""


@torch.no_grad()
def generate(model, tokenizer, batch: list[list[dict]], max_new_tokens: int) -> tuple[list[str], int]:
    """Greedy replies for a batch of chats (left padded) and the number of new tokens made."""
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in batch]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    new = out[:, enc["input_ids"].shape[1]:]
    # count tokens up to and including the first eos per row
    is_eos = new == tokenizer.eos_token_id
    first = torch.where(is_eos.any(1), is_eos.float().argmax(1) + 1, torch.full_like(is_eos[:, 0], new.shape[1], dtype=torch.long))
    return tokenizer.batch_decode(new, skip_special_tokens=True), int(first.sum())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=96)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--tasks", default="default", help="'default', 'all' or names joined by ';'")
    ap.add_argument("--show", type=int, default=3, help="example replies printed per task")
    args = ap.parse_args()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, tokenizer = load_smollm2()
    tokenizer.padding_side = "left"
    print(f"load: {time.perf_counter() - t0:.1f}s  threads={torch.get_num_threads()}")

    # throughput at batch 16 (forced to max_new_tokens by a no-eos run)
    rng = random.Random(1)
    chats = [TASKS["add1 'What is 7 + 9?'"](rng)[0] for _ in range(16)]
    texts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in chats]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        model.generate(**enc, do_sample=False, max_new_tokens=2, pad_token_id=tokenizer.pad_token_id)  # warm-up
        t = time.perf_counter()
        out = model.generate(**enc, do_sample=False, max_new_tokens=32, min_new_tokens=32,
                             pad_token_id=tokenizer.pad_token_id)
        dt = time.perf_counter() - t
    made = (out.shape[1] - enc["input_ids"].shape[1]) * 16
    print(f"generate batch16 x32 new tokens (prompt {enc['input_ids'].shape[1]}): {dt:.2f}s "
          f"= {made / dt:.0f} tok/s")

    rows = []
    names = {"default": DEFAULT_TASKS, "all": list(TASKS)}.get(args.tasks) or args.tasks.split(";")
    for name in names:
        make = TASKS[name]
        rng = random.Random(zlib.crc32(name.encode()))
        probs = [make(rng) for _ in range(args.n)]
        exact = contains = toks = 0
        t = time.perf_counter()
        for i in range(0, args.n, args.batch):
            chunk = probs[i:i + args.batch]
            replies, made = generate(model, tokenizer, [m for m, _ in chunk], args.max_new_tokens)
            toks += made
            for j, ((m, ans), reply) in enumerate(zip(chunk, replies)):
                exact += reply.strip() == ans
                contains += ans in re.findall(r"-?\d+", reply)
                if i == 0 and j < args.show:
                    print(f"  [{name}] {m[-1]['content']!r} -> {reply!r}")
        dt = time.perf_counter() - t
        rows.append((name, exact / args.n, contains / args.n, toks / args.n, dt))
    print(f"\n{'task':40s} {'exact':>6s} {'contains':>8s} {'len':>5s} {'secs':>5s}")
    for name, e, c, ln, dt in rows:
        print(f"{name:40s} {e:6.2f} {c:8.2f} {ln:5.1f} {dt:5.1f}")
    print(f"total {time.perf_counter() - t0:.0f}s")


if __name__ == "__main__":
    main()
