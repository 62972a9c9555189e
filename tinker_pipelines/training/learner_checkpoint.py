"""A learner's checkpoints: write, verify and restore them (`Learner.save_state` and friends),
through `training.interface.ResidentLearner`.

A checkpoint directory holds the adapter (`adapter_model.safetensors` + PEFT's config, loadable
with `PeftModel.from_pretrained`) or the full weights (`save_pretrained`), the value head where
there is one, the optimizer and RNG states, and a record with a content hash (`checkpoint.py`).
A bf16 full-parameter learner adds its fp32 master weights (`master_weights.MASTER_FILE`); an
fp32 one writes exactly what it always did.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from peft import get_peft_model_state_dict
from safetensors.torch import load_file, save_file

from tinker_pipelines import checkpoint as ckpt
from tinker_pipelines.training.master_weights import MASTER_FILE

if TYPE_CHECKING:  # the checkpoint sees a learner through this view, not `learner.Learner` (which imports it)
    from tinker_pipelines.training.interface import ResidentLearner

VALUE_HEAD_FILE = "value_head.safetensors"
"""The value head's weights, beside the adapter or the model's."""


def adapter_state(learner: ResidentLearner) -> dict[str, torch.Tensor]:
    """The adapter's own tensors. Not PEFT's default for an adapter on lm_head or the embedding
    (`save_embedding_layers`), which adds a copy of that frozen base layer: vocab x hidden of the
    base in every checkpoint, and, loaded, written over the base all adapters share."""
    return dict(get_peft_model_state_dict(learner.model, adapter_name=learner.adapter_name,
                                          save_embedding_layers=False))


def save_state(learner: ResidentLearner, path: str | Path, record: dict[str, Any] | None = None,
               extra_rng: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write a checkpoint atomically; returns its record (with the content hash)."""
    with ckpt.atomic_directory(path) as tmp:
        if learner.cfg.mode == "lora":
            # Saved as the default adapter so `PeftModel.from_pretrained(base, path)` loads it.
            learner.activate()
            state = adapter_state(learner)
            save_file({k: v.contiguous() for k, v in state.items()}, str(tmp / "adapter_model.safetensors"))
            learner.model.peft_config[learner.adapter_name].save_pretrained(str(tmp))
        else:
            learner.model.save_pretrained(str(tmp))
            if learner.masters is not None:  # not derivable from the bf16 weights: their low bits
                save_file(learner.masters.state(), str(tmp / MASTER_FILE))
        if learner.value_head is not None:
            save_file({k: v.contiguous() for k, v in learner.value_head.state_dict().items()},
                      str(tmp / VALUE_HEAD_FILE))
        torch.save({"optimizer": learner.optimizer.state_dict(), "steps": learner.steps}, tmp / "optimizer.pt")
        torch.save({**ckpt.rng_state(), **(extra_rng or {})}, tmp / "rng.pt")
        full = {"mode": learner.cfg.mode, "base_model": learner.base_name, "learner": asdict(learner.cfg),
                "learner_steps": learner.steps, **(record or {})}
        full = ckpt.write_record(tmp, full)
    return full


@torch.no_grad()
def verify(learner: ResidentLearner, path: str | Path, probe_tokens: list[int]) -> dict[str, Any]:
    """Check a checkpoint `learner` wrote without loading a second model: its weight files
    match the recorded content hash, load with safetensors, and every tensor equals the
    resident one bit for bit (so a policy loaded from them is the learner's), whose logits on
    `probe_tokens` must be finite. Raises when the record or the hash is wrong."""
    path = Path(path)
    record = ckpt.read_record(path, verify=True)
    loaded: dict[str, torch.Tensor] = {}
    if record["mode"] == "lora":
        loaded.update(load_file(str(path / "adapter_model.safetensors")))
        resident = adapter_state(learner)
    else:
        for f in sorted(path.glob("model*.safetensors")):
            loaded.update(load_file(str(f)))
        resident = dict(learner.model.state_dict())
        if (path / MASTER_FILE).exists() or learner.masters is not None:
            loaded.update({f"master.{k}": v for k, v in load_file(str(path / MASTER_FILE)).items()})
            if learner.masters is not None:
                resident.update({f"master.{k}": v for k, v in learner.masters.state().items()})
    if learner.value_head is not None or (path / VALUE_HEAD_FILE).exists():
        loaded.update({f"value_head.{k}": v for k, v in load_file(str(path / VALUE_HEAD_FILE)).items()})
        if learner.value_head is not None:
            resident.update({f"value_head.{k}": v for k, v in learner.value_head.state_dict().items()})
    missing, unexpected = ckpt.state_fit(set(loaded), set(resident), ckpt.tied_aliases(learner.model))
    differ = sorted(k for k in set(loaded) & set(resident) if not torch.equal(loaded[k], resident[k].cpu()))
    learner.activate()
    ids = torch.tensor([probe_tokens[:32] or [0]], device=learner.device)
    finite = bool(torch.isfinite(learner.model(input_ids=ids).logits).all())
    return {"finite_logits": finite, "tensors_loaded": len(loaded), "differing": differ, "missing": missing,
            "unexpected": unexpected}


def load_state(learner: ResidentLearner, path: str | Path, optimizer: bool = True) -> dict[str, Any]:
    """Restore weights, optimizer and RNG states from `save_state`; returns the record. Without
    `optimizer` (Tinker's `load_weights` with optimizer=False), only the weights: the optimizer
    starts afresh (its moments cleared, its settings kept) and the RNG states are left alone."""
    path = Path(path)
    record = ckpt.read_record(path)
    if record.get("mode") != learner.cfg.mode:
        raise ckpt.CheckpointError(f"checkpoint {path} was trained with mode={record.get('mode')!r}, "
                                   f"not {learner.cfg.mode!r}")
    if learner.base_name and record.get("base_model") and record["base_model"] != learner.base_name:
        raise ckpt.CheckpointError(f"checkpoint {path} was made with model {record['base_model']!r}, "
                                   f"not {learner.base_name!r}")
    # a gradient accumulated before the load belongs to the weights it replaces
    learner.optimizer.zero_grad(set_to_none=True)
    try:
        _load_tensors(learner, path, optimizer)
    except (RuntimeError, KeyError) as e:  # shapes or names of another architecture
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ckpt.CheckpointError(f"checkpoint {path} (made with model {record.get('base_model')!r}) does not "
                                   f"fit this model: {first[:300]}") from None
    return record


def _load_tensors(learner: ResidentLearner, path: Path, optimizer: bool = True) -> None:
    if learner.value_head is not None:
        if not (path / VALUE_HEAD_FILE).exists():
            raise ckpt.CheckpointError(f"checkpoint {path} has no {VALUE_HEAD_FILE}, but this learner trains a "
                                       "value head")
        learner.value_head.load_state_dict(load_file(str(path / VALUE_HEAD_FILE), device=str(learner.device)))
    if learner.cfg.mode == "lora":
        from peft import set_peft_model_state_dict

        state = load_file(str(path / "adapter_model.safetensors"), device=str(learner.device))
        # a copy of a frozen base layer (older checkpoints of adapters on lm_head hold one) would
        # overwrite the base that every adapter on this model shares
        set_peft_model_state_dict(learner.model, {k: v for k, v in state.items() if ".base_layer." not in k},
                                  adapter_name=learner.adapter_name)
    else:
        state, files = {}, sorted(path.glob("model*.safetensors"))
        for f in files:
            state.update(load_file(str(f), device=str(learner.device)))
        missing, unexpected = ckpt.state_fit(set(state), set(learner.model.state_dict()),
                                             ckpt.tied_aliases(learner.model))
        if missing or unexpected:
            raise ckpt.CheckpointError(ckpt.misfit_message(path, files, missing, unexpected))
        ckpt.check_ties(path, state, ckpt.tied_aliases(learner.model))
        learner.model.load_state_dict(state, strict=False)  # strict would want both names of a tie
        if learner.masters is not None:
            masters = (load_file(str(path / MASTER_FILE), device=str(learner.device))
                       if (path / MASTER_FILE).exists() else None)
            learner.masters.load(masters, state, ckpt.tied_aliases(learner.model), where=str(path))
    if not optimizer:
        learner.optimizer.state.clear()
        learner.steps = int(ckpt.read_record(path).get("learner_steps", 0))
        return
    opt = ckpt.load_torch_file(path / "optimizer.pt", map_location=learner.device)
    learner.optimizer.load_state_dict(opt["optimizer"])
    learner.steps = opt["steps"]
    ckpt.set_rng_state(ckpt.load_torch_file(path / "rng.pt"))
