"""A user's training scripts for tinker-cookbook's DPO and SDFT trainers on local data.

Runs in the cookbook's own environment (`.venv-cookbook`), NOT the project's: it imports only
the standard library, `chz`, `datasets` and `tinker_cookbook`, as a script on a user's machine
would, and reaches the service over HTTP through the SDK. `benchmarks/cookbook_dpo_distill.py`
runs it as a subprocess:

    .venv-cookbook/bin/python benchmarks/cookbook_drivers.py dpo  model_name=DIR pairs=FILE.jsonl log_path=DIR ...
    .venv-cookbook/bin/python benchmarks/cookbook_drivers.py sdft model_name=DIR demos=FILE.jsonl log_path=DIR ...

Arguments after the subcommand are `chz`'s `key=value`, like the cookbook's own recipes. Each
builds the trainer's config with a dataset builder of ours over a local JSONL file and calls the
trainer's `main` unmodified:

- `dpo`: `preference.train_dpo.main`, its `dataset_builder` the cookbook's
  `DPODatasetBuilderFromComparisons` around `JsonlPairs` (ours: one
  `{"prompt", "chosen", "rejected"}` object a line, as labeled comparisons). Logs `accuracy`,
  `margin`, `dpo_loss`, `chosen_reward`, `rejected_reward` per step (`train_dpo.compute_dpo_loss`).
- `sdft`: `distillation.sdft.main` (on-policy self-distillation: the teacher is the base model
  shown the question *and* a golden answer; the student, a fresh LoRA or the checkpoint
  `load_checkpoint_path`, sees the question only), its batches the SDFT recipe's `SDFTDataset`
  over a local `{"question", "answer"}` JSONL (the recipe's own builders read hub datasets). With
  `topk=0` (no `topk_prompt_logprobs`, and `importance_sampling` datums of shape (N,)) it logs
  `sdft/mean_teacher_lp` and `sdft/mean_student_lp` over the student's sampled tokens: their
  difference `sdft/mean_advantage` is minus the sampled estimate of KL(student || teacher).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import chz
from tinker_cookbook import cli_utils, renderers
from tinker_cookbook.preference import train_dpo
from tinker_cookbook.preference.dpo_datasets import DPODatasetBuilderFromComparisons
from tinker_cookbook.preference.preference_datasets import ComparisonDatasetBuilder
from tinker_cookbook.preference.types import Comparison, LabeledComparison
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig
from tinker_cookbook.tokenizer_utils import get_tokenizer


def read_jsonl(path: str, keys: tuple[str, ...]) -> list[dict]:
    """The objects of a JSONL file, each checked to have the string fields `keys`."""
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        for key in keys:
            if not isinstance(row.get(key), str) or not row[key]:
                raise ValueError(f"{path} line {i}: field {key!r} must be a non-empty string")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path} has no rows")
    return rows


@chz.chz
class JsonlPairs(ComparisonDatasetBuilder):
    """Preference pairs from a local JSONL file: `{"prompt", "chosen", "rejected"}` a line, as
    one-turn comparisons labeled "A" (the chosen reply)."""

    path: str

    def get_train_and_test_datasets(self):
        import datasets

        return datasets.Dataset.from_list(read_jsonl(self.path, ("prompt", "chosen", "rejected"))), None

    def example_to_labeled_comparison(self, example: dict) -> LabeledComparison | None:
        comparison = Comparison(
            prompt_conversation=[{"role": "user", "content": example["prompt"]}],
            completion_A=[{"role": "assistant", "content": example["chosen"]}],
            completion_B=[{"role": "assistant", "content": example["rejected"]}],
        )
        return LabeledComparison(comparison=comparison, label="A")


@chz.chz
class DPOArgs:
    model_name: str
    pairs: str
    log_path: str
    base_url: str | None = None
    renderer_name: str = "role_colon"
    lora_rank: int = 8
    learning_rate: float = 1e-4
    lr_schedule: str = "constant"
    dpo_beta: float = 0.1
    batch_size: int = 8
    num_epochs: int = 1
    max_steps: int | None = None
    max_length: int | None = 512


def run_dpo(args: DPOArgs) -> None:
    cli_utils.check_log_dir(args.log_path, behavior_if_exists="delete")
    common = ChatDatasetBuilderCommonConfig(model_name_for_tokenizer=args.model_name,
                                            renderer_name=args.renderer_name, max_length=args.max_length,
                                            batch_size=args.batch_size)
    config = train_dpo.Config(
        log_path=args.log_path, model_name=args.model_name, recipe_name="cookbook_drivers_dpo",
        renderer_name=args.renderer_name,
        dataset_builder=DPODatasetBuilderFromComparisons(common_config=common,
                                                         comparison_builder=JsonlPairs(path=args.pairs)),
        learning_rate=args.learning_rate, lr_schedule=args.lr_schedule, num_epochs=args.num_epochs,
        dpo_beta=args.dpo_beta, lora_rank=args.lora_rank, base_url=args.base_url,
        save_every=0, eval_every=0, infrequent_eval_every=0, max_steps=args.max_steps)
    train_dpo.main(config)


SHORT_DEMO_TEMPLATE = (
    "{question}\n\nThis is an example for a response to the question:\n{golden_answer}\n\n"
    "Now answer with a response of your own."
)
"""`sdft.DEFAULT_DEMO_TEMPLATE` without its closing "including the thinking process": our golden
answers are one line, and the teacher should expect one back."""


@chz.chz
class SDFTArgs:
    model_name: str
    demos: str
    log_path: str
    base_url: str | None = None
    renderer_name: str = "role_colon"
    lora_rank: int = 8
    learning_rate: float = 1e-4
    groups_per_batch: int = 8
    group_size: int = 2
    max_tokens: int = 16
    temperature: float = 1.0
    topk: int = 0
    reverse: bool = False
    loss_fn: str = "importance_sampling"
    max_steps: int | None = None
    demo_template: str = SHORT_DEMO_TEMPLATE
    load_checkpoint_path: str | None = None


async def run_sdft(args: SDFTArgs) -> None:
    from tinker_cookbook.distillation import sdft
    from tinker_cookbook.recipes.sdft.datasets import SDFTDataset

    cli_utils.check_log_dir(args.log_path, behavior_if_exists="delete")
    rows = read_jsonl(args.demos, ("question", "answer"))
    renderer = renderers.get_renderer(args.renderer_name, tokenizer=get_tokenizer(args.model_name))
    dataset = SDFTDataset(questions=[r["question"] for r in rows], golden_answers=[r["answer"] for r in rows],
                          batch_size=args.groups_per_batch, group_size=args.group_size, renderer=renderer,
                          dataset_name="local_demos")
    config = sdft.Config(
        model_name=args.model_name, recipe_name="cookbook_drivers_sdft", renderer_name=args.renderer_name,
        lora_rank=args.lora_rank, base_url=args.base_url, learning_rate=args.learning_rate,
        max_tokens=args.max_tokens, temperature=args.temperature, loss_fn=args.loss_fn, topk=args.topk,
        reverse=args.reverse,
        eval_every=0, save_every=0, log_path=args.log_path, max_steps=args.max_steps,
        load_checkpoint_path=args.load_checkpoint_path, demo_template=args.demo_template)
    await sdft.main(config, dataset)


def main(argv: list[str]) -> None:
    if not argv or argv[0] not in ("dpo", "sdft"):
        raise SystemExit("usage: cookbook_drivers.py {dpo|sdft} key=value ...")
    if argv[0] == "dpo":
        run_dpo(chz.entrypoint(DPOArgs, argv=argv[1:]))
    else:
        asyncio.run(run_sdft(chz.entrypoint(SDFTArgs, argv=argv[1:])))


if __name__ == "__main__":
    main(sys.argv[1:])
