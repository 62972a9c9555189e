"""Write sample run directories of tinker-cookbook 0.5.8's recipes with the cookbook's own code:
`ml_log.JsonLogger` (metrics.jsonl, config.json) and `checkpoint_utils.CheckpointRecord` through
`TrainingRunStore.write_checkpoint` (checkpoints.jsonl). The metric keys and the order in which
rows are written are those of `rl/train.py::do_sync_training` and `supervised/train.py` (read
from their source); the values are made up. Run in .venv-cookbook:

    .venv-cookbook/bin/python tests/data/cookbook/make_logs.py OUT_DIR
"""

import sys
from pathlib import Path

from tinker_cookbook.checkpoint_utils import CheckpointRecord
from tinker_cookbook.utils.ml_log import JsonLogger

out = Path(sys.argv[1])
model = "tinker://s-0:train:0"

rl = JsonLogger(out / "math_rl")
for i, correct in enumerate([0.03, 0.05, 0.02, 0.06, 0.09, 0.11, 0.14, 0.16, 0.17]):
    # do_sync_training: progress and lr first, then trajectory metrics (env/all/...), the
    # train step's, the timing window's; then log_metrics(metrics, step=i_batch)
    rl.log_metrics({"progress/batch": i, "optim/lr": 0.002, "progress/done_frac": (i + 1) / 9,
                    "env/all/ac_tokens_per_turn": 5.0, "env/all/total_episodes": 64,
                    "env/all/reward/total": correct - 0.1, "env/all/format": 0.0, "env/all/correct": correct,
                    "optim/kl_sample_train_v1": 0.001, "time/total": 31.5}, step=i)
rl.store.write_checkpoint(CheckpointRecord.from_dict(
    {"name": "final", "batch": 9, "state_path": f"{model}/weights/final",
     "sampler_path": f"{model}/sampler_weights/final"}).to_dict())

sl = JsonLogger(out / "chat_sl")
for step, nll in enumerate([2.9, 2.7, 2.6, 2.4, 2.2, 2.1, 1.9, 1.8]):
    sl.log_metrics({"epoch": step // 4, "progress": (step + 1) / 8, "learning_rate": 0.001, "num_sequences": 16,
                    "num_tokens": 1500, "num_loss_tokens": 400.0, "train_mean_nll": nll, "train_mean_bpb": nll / 3,
                    "time/total": 12.0}, step=step)
sl.store.write_checkpoint(CheckpointRecord.from_dict(
    {"name": "final", "epoch": 2, "batch": 0, "state_path": f"{model}/weights/final",
     "sampler_path": f"{model}/sampler_weights/final"}).to_dict())
