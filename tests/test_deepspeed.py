"""DeepSpeed ZeRO-2/3 full-parameter training on CPU, against the plain single-process learner.

`tests/deepspeed_worker_script.py` runs under `torchrun --nproc_per_node 2` (gloo, the CPU
accelerator); these tests hold its measurements to the tolerances below. fp32 throughout.

Tolerances, and why (measured values on 2 ranks in brackets):
- metrics (loss, kl, ratio, value loss ...): |a - b| <= 1e-5 (1 + |b|). Each rank sums its shard's
  micro-batch losses with the plain learner's shares of the whole batch [<= 2.4e-6, grad_norm].
- grad_norm: 1e-5 relative. DeepSpeed takes the norm over its flat partitions, torch over
  per-tensor norms: another summation order over ~1M fp32 squares [<= 2.9e-6].
- gradient, elementwise: Adam's first moment after one step (0.1 x the clipped gradient),
  consolidated from the ZeRO partitions into `optimizer.pt`, within 1e-5 of its largest element
  [<= 2.9e-6, mostly the clip coefficient 1 / grad_norm].
- parameters after a step: 1e-6 absolute (~8 float32 ulps at |p| ~ 1, 1e-4 of a step of lr 1e-2)
  wherever the RMS gradient is >= 1e-5 (~90% of the elements at step 1, ~94% at step 2)
  [<= 2.3e-7]. Below that Adam's lr * m / (sqrt(v) + eps) magnifies the ~1e-9 rounding noise of
  the gradient: up to 2 lr where g ~ 0 [3.5e-4 at most over all elements]; those elements are
  covered by the gradient check above.
- a checkpoint loaded without DeepSpeed gives the same logits bit for bit; DeepSpeed resuming its
  own checkpoint takes the same next step bit for bit.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tinker_pipelines.config import ConfigError, config_from_dict
from tinker_pipelines.training.deepspeed_learner import check_model_on_rank_device, deepspeed_config
from tinker_pipelines.training.distributed import (accelerator_for, backend_for, check_rank_model_device, rank_device,
                                          set_rank_device)
from tinker_pipelines.training.learner import LearnerConfig

WORKER = Path(__file__).with_name("deepspeed_worker_script.py")
METRICS_TOL = 1e-5
GRAD_NORM_RTOL = 1e-5
GRAD_RTOL = 1e-5
PARAM_ATOL = 1e-6
CASES = [(stage, case) for stage in (2, 3) for case in ("grpo_kl", "ppo_token", "ppo_checkpointed")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args: list[str], nproc: int | None, timeout: float, cwd: Path | None = None,
         accelerator: str = "cpu") -> subprocess.CompletedProcess:
    """Run a script under torchrun (`nproc` ranks) or as one plain process (None) on DeepSpeed's
    `accelerator` ('cuda': DeepSpeed picks it itself); fail loudly."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT", "DS_ACCELERATOR")}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    if accelerator == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    launcher = [] if nproc is None else ["-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
                                         "--master_addr", "127.0.0.1", "--master_port", str(_free_port())]
    proc = subprocess.run([sys.executable, *launcher, *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("zero") / "results.json"
    _run([str(WORKER), str(out)], nproc=2, timeout=900)  # two ranks on 2 cores: minutes when the machine is busy
    return json.loads(out.read_text())


@pytest.mark.parametrize("stage,case", CASES)
@pytest.mark.e2e
def test_one_step_matches_the_plain_learner(two_ranks, stage, case):
    r = two_ranks[f"zero{stage}/{case}"]
    assert two_ranks["world_size"] == 2 and r["ranks_agree"] == 1.0
    assert r["metrics_max_err"] <= METRICS_TOL
    assert r["grad_norm_rel"] <= GRAD_NORM_RTOL
    assert r["grad_max_err"] <= GRAD_RTOL
    assert r["param_max_abs_well"] <= PARAM_ATOL and r["well_fraction"] > 0.85


@pytest.mark.parametrize("stage,case", CASES)
@pytest.mark.e2e
def test_checkpoint_loads_without_deepspeed_and_resumes(two_ranks, stage, case):
    r = two_ranks[f"zero{stage}/{case}"]
    assert r["record_ok"] == 1.0
    assert r["logits_learner_max_abs"] == 0.0 and r["logits_hf_max_abs"] == 0.0
    # a plain Learner resumes the consolidated Adam states: the same second step as DeepSpeed's
    assert r["plain_resume_grad_norm_rel"] <= GRAD_NORM_RTOL
    assert r["plain_resume_param_max_abs_well"] <= PARAM_ATOL and r["plain_resume_well_fraction"] > 0.9
    # DeepSpeed resumes its own checkpoint bit for bit
    assert r["ds_resume_param_max_abs"] == 0.0 and r["ds_resume_metrics_equal"] == 1.0


@pytest.mark.parametrize("stage", (2, 3))
@pytest.mark.e2e
def test_carried_reference_logprobs_skip_the_reference_forward(two_ranks, stage):
    """Datums scored once for several passes carry their reference logprobs: DeepSpeed's step
    uses them (no reference forward) and equals the plain learner's step that computes them."""
    r = two_ranks[f"zero{stage}/grpo_kl_carried"]
    assert r["all_carried"] == 1.0 and r["reference_forwards"] == 0
    assert r["metrics_max_err"] <= METRICS_TOL and r["grad_norm_rel"] <= GRAD_NORM_RTOL
    assert r["param_max_abs_well"] <= PARAM_ATOL and r["well_fraction"] > 0.85


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict:
    """The worker script as one plain process (no torchrun), ZeRO-2 and -3, `ppo_token` and `bf16`:
    one process start and DeepSpeed import serve both tests below."""
    out = tmp_path_factory.mktemp("zero1") / "results.json"
    _run([str(WORKER), str(out), "2,3", "ppo_token,bf16"], nproc=None, timeout=600)
    return json.loads(out.read_text())


@pytest.mark.parametrize("stage", (2, 3))
@pytest.mark.e2e
def test_one_process_without_torchrun(one_rank, stage):
    """World size 1: the learner makes its own one-process gloo group."""
    assert one_rank["world_size"] == 1
    r = one_rank[f"zero{stage}/ppo_token"]
    assert r["metrics_max_err"] <= METRICS_TOL and r["grad_max_err"] <= GRAD_RTOL
    assert r["param_max_abs_well"] <= PARAM_ATOL and r["ds_resume_param_max_abs"] == 0.0


@pytest.mark.e2e
def test_cli_train_under_torchrun(tmp_path):
    """`torchrun -m tinker_pipelines train` with ZeRO-3: rank 0 alone writes metrics and checkpoints,
    and the checkpoint is a plain Hugging Face directory."""
    cfg = {"seed": 3, "output_dir": str(tmp_path / "out"),
           "env": {"path": "arithmetic", "kwargs": {"max_operand": 3, "partial_credit": 0.5}},
           "algorithm": {"name": "grpo", "kl_coef": 0.05},
           "training": {"mode": "full", "iterations": 2, "learning_rate": 1e-3, "groups_per_batch": 4,
                        "group_size": 4, "max_new_tokens": 4, "micro_batch_size": 4, "deepspeed": {"stage": 3}},
           "sft": {"steps": 10, "batch_size": 16, "examples": 64, "learning_rate": 3e-3},
           "eval": {"every": 2, "num_tasks": 8}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    _run(["-m", "tinker_pipelines", "train", str(tmp_path / "cfg.yaml")], nproc=2, timeout=600)
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [m["iteration"] for m in lines] == [-1, 0, 1]  # once each: only rank 0 appended
    assert any(m.get("informative_groups", 0) > 0 and "grad_norm" in m for m in lines)
    ck = tmp_path / "out" / "checkpoints" / "iter_00001"
    record = json.loads((ck / "record.json").read_text())
    assert record["deepspeed"] == {"stage": 3, "world_size": 2} and record["iteration"] == 2
    assert not [p.name for p in ck.parent.iterdir() if p.name.startswith(".")]  # no temporary directories left
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(ck)


@pytest.mark.parametrize("training,field", [
    ({"mode": "full", "deepspeed": {"stage": 5}}, "training.deepspeed.stage must be 0, 2 or 3, got 5"),
    ({"mode": "full", "deepspeed": {"stage": 1}}, "training.deepspeed.stage must be 0, 2 or 3, got 1"),
    ({"mode": "lora", "deepspeed": {"stage": 2}}, "training.mode must be 'full' with training.deepspeed.stage 2"),
    ({"mode": "full", "deepspeed": {"offload_optimizer": True}}, "training.deepspeed.offload_optimizer"),
    ({"mode": "full", "deepspeed": {"stage": 3, "zero_overrides": {"stage": 2}}}, "training.deepspeed.zero_overrides"),
    ({"mode": "full", "deepspeed": {"stages": 2}}, "unknown field training.deepspeed.stages"),
    ({"mode": "full", "deepspeed": {"stage": "2"}}, "training.deepspeed.stage must be int"),
])
def test_deepspeed_config_errors_name_the_field(training, field):
    with pytest.raises(ConfigError, match=field.replace("(", r"\(")):
        config_from_dict({"training": training})


def test_deepspeed_config_defaults_off():
    cfg = config_from_dict({"training": {"mode": "full", "deepspeed": {"stage": 3, "offload_optimizer": True}}})
    assert cfg.training.deepspeed.stage == 3 and cfg.training.deepspeed.offload_optimizer
    assert config_from_dict({}).training.deepspeed.stage == 0


BF16_MASTERS_RTOL = 0.02
"""bf16 under DeepSpeed against the plain learner's fp32 masters, after 3 PPO steps at lr 1e-5:
||d_ds - d_plain|| / ||d_plain|| of the policy's masters [0.0053 ZeRO-2, 0.0048 ZeRO-3 on CPU]:
DeepSpeed's `bf16` casts the value head to bf16 too (the plain learner keeps it fp32)."""


def _check_bf16(r: dict, exact_resume: bool = True) -> None:
    assert r["bf16_enabled"] == 1.0 and r["policy_bf16"] == 1.0
    assert r["masters_rel"] <= BF16_MASTERS_RTOL and r["moved_fraction"] > 0.05
    assert r["weights_are_rounded_masters"] == 1.0 and r["master_file"] == 1.0
    # a plain learner resumes DeepSpeed's masters and Adam states exactly; the head is saved from its masters
    assert r["plain_resume_masters_equal"] == 1.0 and r["plain_resume_adam_equal"] == 1.0
    assert r["value_head_file_fp32"] == 1.0
    if exact_resume:
        assert r["ds_resume_param_max_abs"] == 0.0 and r["ds_resume_masters_max_abs"] == 0.0
        assert r["ds_resume_metrics_equal"] == 1.0


@pytest.mark.e2e
def test_bf16_zero2_and_zero3_on_cpu(one_rank):
    """DeepSpeed accepts a `bf16` section on its CPU accelerator (one process, gloo)."""
    r = one_rank
    for stage in (2, 3):
        assert r[f"zero{stage}/bf16"]["device"] == "cpu"
        _check_bf16(r[f"zero{stage}/bf16"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (scripts/gpu_check)")
def test_bf16_zero2_on_cuda(tmp_path):
    """One rank on the GPU: NCCL, the rank's device cuda:0 (LOCAL_RANK), DeepSpeed's `bf16`."""
    out = tmp_path / "results.json"
    _run([str(WORKER), str(out), "2", "bf16"], nproc=None, timeout=300, accelerator="cuda")
    r = json.loads(out.read_text())["zero2/bf16"]
    assert r["device"] == "cuda:0"
    _check_bf16(r, exact_resume=False)  # GPU kernels need not repeat bit for bit


def test_deepspeed_config_follows_the_model_dtype():
    cfg = LearnerConfig(mode="full", learning_rate=1e-3, micro_batch_size=4, grad_clip=0.5)
    fp32 = deepspeed_config(cfg, torch.float32, 2)
    assert fp32 == {  # exactly what fp32 runs always had
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "managed_gradient_accumulation": False,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.999], "weight_decay": 0.0,
                                                  "torch_adam": True}},
        "zero_optimization": {"stage": 2}, "steps_per_print": 2**31 - 1, "wall_clock_breakdown": False}
    bf16 = deepspeed_config(cfg, torch.bfloat16, 3, offload_optimizer=True, zero_overrides={"x": 1})
    assert bf16["bf16"] == {"enabled": True} and bf16["data_types"] == {"grad_accum_dtype": "fp32"}
    assert bf16["zero_optimization"] == {"stage": 3, "x": 1, "offload_optimizer": {"device": "cpu"}}
    assert "fp16" not in bf16
    with pytest.raises(ValueError, match="model.dtype float16 cannot be trained.*use bfloat16"):
        deepspeed_config(cfg, torch.float16, 2)


def test_backend_and_rank_device_decisions():
    assert backend_for("cuda") == "nccl" and backend_for("cpu") == "gloo"
    with pytest.raises(ValueError, match="DS_ACCELERATOR"):
        backend_for("xpu")
    assert rank_device(3, "cuda") == torch.device("cuda", 3) and rank_device(3, "cpu") == torch.device("cpu")
    assert accelerator_for(None, True) == "cuda" and accelerator_for("cpu", True) == "cpu"
    assert accelerator_for(None, False) == "cpu"
    with pytest.raises(ValueError, match="model.device 'cuda:0' would put all 4 ranks on one GPU"):
        check_rank_model_device("cuda:0", 4)
    check_rank_model_device("cuda:0", 1)
    check_rank_model_device("auto", 4)
    with pytest.raises(ValueError, match="the model is on cuda:0 but this rank's device is cuda:1"):
        check_model_on_rank_device(torch.device("cuda", 0), torch.device("cuda", 1))
    check_model_on_rank_device(torch.device("cpu"), torch.device("cuda", 1))  # DeepSpeed moves it


def test_set_rank_device_on_a_cpu_machine_leaves_cuda_alone(monkeypatch):
    """torchrun's rank 1 of 2 with an inherited CUDA_VISIBLE_DEVICES: no GPU here, so the CPU, and
    CUDA is not initialized (it reads CUDA_VISIBLE_DEVICES once, when it does)."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    if torch.cuda.is_available():
        pytest.skip("a CPU machine's answer")
    assert set_rank_device("auto") == torch.device("cpu")
    assert not torch.cuda.is_initialized()
    with pytest.raises(ValueError, match="model.device 'cuda:1'"):
        set_rank_device("cuda:1")
