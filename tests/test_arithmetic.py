"""The arithmetic env: held-out split, rewards, SFT data."""

import pytest

from tinker_pipelines.envs.arithmetic import ArithmeticEnv, in_split, sft_examples


def test_train_and_test_problems_are_disjoint():
    problems = {}
    for split in ("train", "test"):
        env = ArithmeticEnv(split=split)
        problems[split] = {env.reset(seed=s)[-1]["content"] for s in range(2000)}
    assert problems["train"] and problems["test"]
    assert not problems["train"] & problems["test"]
    pairs = [(a, b) for a in range(10) for b in range(10)]
    assert 0.1 < sum(in_split(a, b, "test") for a, b in pairs) / len(pairs) < 0.3


def test_same_seed_same_task():
    assert ArithmeticEnv().reset(seed=7) == ArithmeticEnv().reset(seed=7)


@pytest.mark.parametrize("reply,reward", [("{}", 1.0), (" {}\n", 1.0), ("{}.", 1 / 3 * 2 * 0.5),
                                          ("The answer is {}.", 0.5 * 2 / 17), ("1{}", 0.0), ("no", 0.0)])
def test_exact_reward_and_length_scaled_partial_credit(reply, reward):
    env = ArithmeticEnv(partial_credit=0.5)
    env.reset(seed=next(s for s in range(100) if len(_answer(s)) == 2))  # a two-digit sum
    result = env.step(reply.format(env._answer))
    assert result.done and result.reward == pytest.approx(reward)


def _answer(seed):
    env = ArithmeticEnv()
    env.reset(seed=seed)
    return env._answer


def test_sft_examples_come_from_the_train_split_with_verbose_fraction():
    examples = sft_examples(400, seed=1, verbose_fraction=0.75)
    test_questions = {ArithmeticEnv(split="test").reset(seed=s)[-1]["content"] for s in range(2000)}
    assert not {m[-1]["content"] for m, _ in examples} & test_questions
    verbose = sum(not reply.isdigit() for _, reply in examples) / len(examples)
    assert 0.65 < verbose < 0.85
    assert sft_examples(50, seed=1) == sft_examples(50, seed=1)


def test_repeat_env_split_and_reward():
    from tinker_pipelines.envs.repeat import RepeatEnv

    train = {RepeatEnv().reset(seed=s)[-1]["content"] for s in range(500)}
    test = {RepeatEnv(split="test").reset(seed=s)[-1]["content"] for s in range(500)}
    assert train and test and not train & test
    env = RepeatEnv(partial_credit=0.5)
    number = env.reset(seed=3)[-1]["content"].split()[-1]
    assert env.step(number).reward == 1.0
    env.reset(seed=3)
    assert env.step(f"Sure: {number}").reward == pytest.approx(0.5 * 4 / 10)
