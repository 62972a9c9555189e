"""Every learner implements `TrainingClient` (`training.interface`): the same members, with
signatures that match the Protocol's, so a drifted signature fails here rather than in a loop."""

from __future__ import annotations

import ast
import inspect
import json
import os
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import pytest
import torch

from tinker_pipelines.training.deepspeed_learner import DeepSpeedLearner
from tinker_pipelines.loops.experiment import Experiment, train_epochs
from tinker_pipelines.training.learner import Learner, LearnerConfig
from tinker_pipelines.training.interface import LearnerSettings, TrainingClient
from tinker_pipelines.worker.client import RemoteLearner, WorkerClient, start_worker

ROOT = Path(__file__).resolve().parents[1]
LEARNERS = (Learner, DeepSpeedLearner, RemoteLearner)


def _protocol_methods() -> list[str]:
    return sorted(n for n, v in vars(TrainingClient).items()
                  if callable(v) and not n.startswith("_") and not isinstance(v, property))


def signature_drift(cls: type) -> list[str]:
    """How `cls`'s methods differ from `TrainingClient`'s: a missing method, or a parameter
    whose name, kind or default differs (extra parameters must have defaults)."""
    problems = []
    for name in _protocol_methods():
        impl = getattr(cls, name, None)
        if impl is None or not callable(impl):
            problems.append(f"{cls.__name__}.{name} is missing")
            continue
        want = list(inspect.signature(getattr(TrainingClient, name)).parameters.values())
        have = list(inspect.signature(impl).parameters.values())
        for w, h in zip(want, have):
            if (w.name, w.kind, w.default) != (h.name, h.kind, h.default):
                problems.append(f"{cls.__name__}.{name}: parameter {h.name!r} ({h.kind.name}, default "
                                f"{h.default!r}) where the Protocol has {w.name!r} ({w.kind.name}, default {w.default!r})")
        if len(have) < len(want):
            problems.append(f"{cls.__name__}.{name} lacks {[p.name for p in want[len(have):]]}")
        problems += [f"{cls.__name__}.{name}: extra parameter {p.name!r} has no default"
                     for p in have[len(want):] if p.default is inspect.Parameter.empty
                     and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    for attr in ("cfg", "steps", "device", "dtype"):  # data members: set in an __init__, or a property
        if not isinstance(getattr(cls, attr, None), property) and not _assigned_in_mro(cls, attr):
            problems.append(f"{cls.__name__} has no {attr}")
    return problems


def _assigned_in_mro(cls: type, attr: str) -> bool:
    return any(attr in _instance_attributes(c) for c in cls.__mro__ if c.__module__.startswith("tinker_pipelines")
               or c is cls)


def _instance_attributes(cls: type) -> set[str]:
    """Names `cls.__init__` assigns on self (read from the source)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    return {t.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]) for t in ast.walk(target)
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def _conforms(learner: object) -> None:
    assert isinstance(learner, TrainingClient)
    assert isinstance(learner.cfg, LearnerSettings)
    assert isinstance(learner.device, torch.device) and isinstance(learner.dtype, torch.dtype)
    assert isinstance(learner.steps, int)


@pytest.mark.parametrize("cls", LEARNERS, ids=lambda c: c.__name__)
def test_every_learner_has_the_protocols_signatures(cls):
    assert signature_drift(cls) == []


def test_a_drifted_signature_is_caught():
    class Drifted(RemoteLearner):
        def forward_backward(self, datums, loss, loss_cfg=None):  # renamed and re-defaulted
            raise AssertionError

        def optim_step(self, clip):  # a new required parameter
            raise AssertionError

    problems = signature_drift(Drifted)
    assert any("forward_backward: parameter 'loss'" in p for p in problems), problems
    assert any("optim_step: extra parameter 'clip'" in p for p in problems), problems
    assert len(_protocol_methods()) >= 9  # the check ran over the Protocol's methods


def test_the_in_process_learner_conforms(tiny):
    model, tok = tiny
    learner = Learner(model, LearnerConfig(mode="lora"), tok.pad_token_id)
    _conforms(learner)
    assert learner.dtype == torch.float32 and learner.device == torch.device("cpu")


def test_a_bf16_learner_reports_its_compute_dtype():
    from tinker_pipelines.models import load_model

    model, tok = load_model("tiny", seed=0, dtype="bfloat16")
    learner = Learner(model, LearnerConfig(mode="lora"), tok.pad_token_id)
    assert learner.dtype == torch.bfloat16
    assert not torch.cuda.is_initialized()


@pytest.mark.e2e
def test_a_remote_learner_conforms_without_placeholders(tmp_path):
    address = tmp_path / "w.sock"
    proc = start_worker("tiny", address, device="cpu", dtype="float32", extra=["--threads", "1"], log=tmp_path / "log")
    try:
        client = WorkerClient(address)
        learner = RemoteLearner(client, "exp", LearnerConfig(), seed=0)
        _conforms(learner)
        assert learner.dtype == torch.float32 and learner.device == torch.device(client.info["device"])
        for placeholder in ("model", "value_head", "params", "optimizer"):  # its modules stay on the worker
            assert not hasattr(learner, placeholder), placeholder
        client.close()
    finally:
        proc.kill()
        proc.wait()


DS_PROBE = r"""
import json, sys
from tinker_pipelines.training.deepspeed_learner import DeepSpeedLearner
from tinker_pipelines.training.learner import LearnerConfig
from tinker_pipelines.models import load_model
from tinker_pipelines.training.interface import LearnerSettings, TrainingClient
model, tok = load_model("tiny", seed=0)
lr = DeepSpeedLearner(model, LearnerConfig(mode="full", value_head=True), tok.pad_token_id, stage=2)
print(json.dumps({"protocol": isinstance(lr, TrainingClient), "settings": isinstance(lr.cfg, LearnerSettings),
                  "dtype": str(lr.dtype), "device": str(lr.device), "steps": lr.steps}))
"""


def test_a_deepspeed_learner_conforms(tmp_path):
    """One process (the learner makes its own one-rank gloo group), apart from this one."""
    pytest.importorskip("deepspeed")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", DS_PROBE], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r == {"protocol": True, "settings": True, "dtype": "torch.float32", "device": "cpu", "steps": 0}


def test_the_loops_are_typed_against_the_protocol():
    hints = typing.get_type_hints(Experiment.start_rl)
    assert hints["return"] is TrainingClient
    assert typing.get_type_hints(train_epochs)["learner"] is TrainingClient
    source = inspect.getsource(Experiment.__init__)
    assert "self.learner: TrainingClient | None" in source


def _imports_anywhere(path: Path) -> set[str]:
    """Modules `path` imports, `if TYPE_CHECKING:` blocks and function bodies included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def test_the_checkpoint_code_does_not_import_the_learner():
    """The circle learner <-> learner_checkpoint is gone, type-only imports included: the
    checkpoint code sees a learner through `training.interface.ResidentLearner`."""
    ckpt = _imports_anywhere(ROOT / "tinker_pipelines" / "training" / "learner_checkpoint.py")
    assert "tinker_pipelines.training.learner" not in ckpt and "tinker_pipelines.training.interface" in ckpt
    assert not {m for m in _imports_anywhere(ROOT / "tinker_pipelines" / "training" / "interface.py")
                if m.startswith("tinker_pipelines.") and "learner" in m}
