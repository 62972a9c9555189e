"""Export and the base that travels with an adapter: PEFT directory, base and merged safetensors
loaded back with plain transformers / PEFT and compared with the trained policy; an adapter
trained after an SFT warm start resolved to that very warm start through the registry after the
store's copy was replaced; a wrong base refused, on resume, export and serving."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dagster_env import NO_SFT, tracker
from peft import AutoPeftModelForCausalLM, PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from tinker_pipelines.bases import BaseMissing, register_base, resolve_base, sft_model_name
from tinker_pipelines.checkpoint import CheckpointError, read_record
from tinker_pipelines.config import config_from_dict
from tinker_pipelines.loops.experiment import Experiment
from tinker_pipelines.serving.export import ExportError, export_checkpoint, export_version, vllm_format_problems
from tinker_pipelines.serving import ServingError
from tinker_pipelines.serving.registry import Registry
from tinker_pipelines.tracking import registered_model_name
from tinker_pipelines.tracking.mlflow_tracker import EXPERIMENT_TAG, checks_tags

CFG = {**NO_SFT, "model": {"name": "tiny", "kwargs": {"num_layers": 2}, "dtype": "float32"}}
SFT = {**CFG, "sft": {"steps": 2, "batch_size": 4, "examples": 8, "learning_rate": 3e-2}}
SFT_RERUN = {**SFT, "sft": {**SFT["sft"], "learning_rate": 1e-2}}
"""The same experiment's warm start run again with another setting: the same catalogue base
under it, other warm-started weights."""
IDS = torch.tensor([[5, 6, 7, 8, 9, 10], [40, 41, 3, 2, 1, 0]])


def _logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def _trained(cfg: dict, base_dir: Path | None = None, seed: int = 1) -> Experiment:
    """An experiment whose adapter is far from zero (lora_B drawn at random: training the tiny
    model until its policy moves costs minutes), after its warm start (saved to `base_dir`)
    when `cfg` has one."""
    c = config_from_dict(cfg)
    exp = Experiment(c)
    if c.sft.steps:
        exp.sft()
        if base_dir is not None:
            exp.save_base(base_dir)
    exp.start_rl()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in exp.learner.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return exp


def test_export_of_a_catalogue_adapter_reloads_as_the_trained_policy(tmp_path):
    exp = _trained(CFG)
    exp.save(tmp_path / "ckpt")
    record = export_checkpoint(tmp_path / "ckpt", tmp_path / "out")
    out = tmp_path / "out"
    assert sorted(record["parts"]) == ["adapter", "base", "merged"] and record["vllm_format_problems"] == []
    read_record(out, verify=True)  # every exported file is hashed
    want = _logits(exp.policy)
    base = AutoModelForCausalLM.from_pretrained(out / "base", dtype=torch.float32).eval()
    assert (_logits(base) - want).abs().max() > 0.05  # the adapter matters: the base alone is another policy
    peft = PeftModel.from_pretrained(base, out / "adapter").eval()
    assert torch.allclose(_logits(peft), want, atol=1e-5)
    auto = AutoPeftModelForCausalLM.from_pretrained(out / "adapter").eval()  # finds its base by the config's path
    assert torch.allclose(_logits(auto), want, atol=1e-5)
    merged = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32).eval()
    assert not any("lora" in k for k in merged.state_dict())
    assert torch.allclose(_logits(merged), want, atol=1e-4)
    tok = AutoTokenizer.from_pretrained(out / "merged")
    msgs = [{"role": "user", "content": "What is 2 + 3?"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == exp.tokenizer.apply_chat_template(msgs, tokenize=False)
    assert record["max_logit_diff"]["adapter"] <= 1e-4 and record["max_logit_diff"]["merged"] <= 1e-4
    assert "value_head.safetensors" not in {p.name for p in (out / "adapter").iterdir()}


def test_export_refuses_an_existing_directory_a_full_checkpoint_and_a_missing_or_wrong_base(tmp_path):
    exp = _trained(CFG)
    exp.save(tmp_path / "ckpt")
    (tmp_path / "taken").mkdir()
    with pytest.raises(ExportError, match="already exists"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "taken")
    full = Experiment(config_from_dict({**CFG, "training": {**CFG["training"], "mode": "full"}}))
    full.save(tmp_path / "full")
    with pytest.raises(ExportError, match="trains every parameter"):
        export_checkpoint(tmp_path / "full", tmp_path / "o1")
    warm = _trained(SFT, tmp_path / "sft")
    warm.save(tmp_path / "warm")
    with pytest.raises(ExportError, match="pass its base"):
        export_checkpoint(tmp_path / "warm", tmp_path / "o2")
    with pytest.raises(ExportError, match="catalogue base 'tiny'"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "o3", base=tmp_path / "sft")
    _trained(SFT_RERUN, tmp_path / "sft9")
    with pytest.raises(ExportError, match="was trained on the warm start"):
        export_checkpoint(tmp_path / "warm", tmp_path / "o4", base=tmp_path / "sft9")
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 5))  # nothing half-written
    record = export_checkpoint(tmp_path / "warm", tmp_path / "o5", base=tmp_path / "sft")
    assert record["base"]["sft_content_hash"] == warm.sft_record["content_hash"]
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "o5" / "base"),
                                     tmp_path / "o5" / "adapter")
    assert torch.allclose(_logits(peft), _logits(warm.policy), atol=1e-5)


def test_an_export_whose_parts_differ_from_the_policy_fails_and_leaves_nothing(tmp_path):
    exp = _trained(CFG)
    exp.save(tmp_path / "ckpt")
    with pytest.raises(ExportError, match="exported merged give logits up to"):  # merging rounds: never exact
        export_checkpoint(tmp_path / "ckpt", tmp_path / "out", tolerance=1e-12)
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == [tmp_path / "ckpt"]


def test_a_resume_on_another_warm_start_is_refused(tmp_path):
    warm = _trained(SFT, tmp_path / "sft")
    warm.save(tmp_path / "ckpt")
    record = read_record(tmp_path / "ckpt")
    assert record["base"] == {"name": "tiny", "identity": "tiny(num_layers=2,seed=3)",
                              "sft_content_hash": warm.sft_record["content_hash"]}
    _trained(SFT_RERUN, tmp_path / "sft9")
    exp = Experiment(config_from_dict(SFT))
    exp.use_base(tmp_path / "sft9")
    with pytest.raises(CheckpointError, match="trained on the SFT warm start"):
        exp.resume(tmp_path / "ckpt")
    plain = Experiment(config_from_dict(SFT))  # the catalogue base: the warm start not loaded at all
    with pytest.raises(CheckpointError, match="no warm start is loaded"):
        plain.resume(tmp_path / "ckpt")
    exp = Experiment(config_from_dict(SFT))
    exp.use_base(tmp_path / "sft")
    exp.resume(tmp_path / "ckpt")
    assert torch.equal(_logits(exp.policy), _logits(warm.policy))


def _register(t, exp_name: str, exp: Experiment, tmp: Path) -> str:
    record = exp.save(tmp / f"a-{exp_name}")
    return t.register_adapter(t.experiment_run(exp_name), registered_model_name(exp_name), tmp / f"a-{exp_name}",
                              "adapters/iter_00000", tags={"partition": f"{exp_name}:0",
                                                           "content_hash": record["content_hash"],
                                                           EXPERIMENT_TAG: exp_name, **checks_tags([])})


def test_a_registered_adapter_finds_its_warm_start_after_the_sft_was_rerun(tmp_path):
    """The issue's case: the experiment's SFT is re-run (the store's `<experiment>/sft` replaced);
    the adapter trained on the first warm start is exported and served on *that* one, fetched
    from the registry (`sft-<experiment>`) by the content hash in its record."""
    from assets.definitions import defs

    name, t = "export-rerun", tracker()
    store = defs.resources["artifact_store"].store()
    local = store.write_dir(f"{name}/sft")
    warm = _trained(SFT, local)
    store.put_dir(local, f"{name}/sft")
    assert register_base(t, t.experiment_run(name), name, local) == "1"
    assert register_base(t, t.experiment_run(name), name, local) == "1"  # idempotent per content hash
    version = _register(t, name, warm, tmp_path)
    local = store.write_dir(f"{name}/sft")
    _trained(SFT_RERUN, local)  # the warm start re-run: the store now holds other weights
    store.put_dir(local, f"{name}/sft")
    record = export_version(f"{registered_model_name(name)}/{version}", tmp_path / "out",
                            Registry(t, store, cache_dir=tmp_path / "cache"))
    assert record["base"]["sft_content_hash"] == warm.sft_record["content_hash"]
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "base"),
                                     tmp_path / "out" / "adapter")
    assert torch.allclose(_logits(peft), _logits(warm.policy), atol=1e-5)
    # the catalogue base under the same adapter is another policy (the bug this fixes)
    wrong = PeftModel.from_pretrained(Experiment(config_from_dict(CFG)).base_model, tmp_path / "out" / "adapter")
    assert (_logits(wrong) - _logits(warm.policy)).abs().max() > 0.5
    # the registered base gone too: a clear refusal naming the hash, not another policy
    t.client.delete_model_version(sft_model_name(name), "1")
    v = config_from_dict(SFT)
    with pytest.raises(BaseMissing, match=warm.sft_record["content_hash"][:16]):
        resolve_base(read_record(tmp_path / f"a-{name}"), v, name, tmp_path / "c2", t, store)
    with pytest.raises(ServingError) as e:
        Registry(t, store, cache_dir=tmp_path / "c3").fetch(registered_model_name(name), version)
    assert e.value.status == 409 and "re-run since" in e.value.message


def test_vllm_format_check_names_what_vllm_would_refuse(tmp_path):
    exp = _trained(CFG)
    exp.save(tmp_path / "ckpt")
    assert vllm_format_problems(tmp_path / "ckpt") == []
    conf = json.loads((tmp_path / "ckpt" / "adapter_config.json").read_text())
    conf.update(use_dora=True, modules_to_save=["lm_head"], target_modules=["q_proj", "embed_tokens"])
    (tmp_path / "ckpt" / "adapter_config.json").write_text(json.dumps(conf))
    problems = " | ".join(vllm_format_problems(tmp_path / "ckpt"))
    assert "use_dora" in problems and "modules_to_save" in problems and "embed_tokens" in problems


def test_cli_export_prints_its_parts_and_one_line_errors(tmp_path):
    exp = _trained(CFG)
    exp.save(tmp_path / "ckpt")

    def cli(*args):
        return subprocess.run([sys.executable, "-m", "tinker_pipelines", "export", *map(str, args)],
                              capture_output=True, text=True, timeout=600)

    ok = cli(tmp_path / "ckpt", "--out", tmp_path / "out", "--no-merged")
    assert ok.returncode == 0, ok.stderr
    assert "adapter:" in ok.stdout and "merged:" not in ok.stdout and not (tmp_path / "out" / "merged").exists()
    for args, needle in [((tmp_path / "ckpt", "--out", tmp_path / "out"), "already exists"),
                         ((tmp_path / "ckpt", "--out", tmp_path / "o", "--tolerance", "0"), "--tolerance"),
                         (("nosuch@champion", "--out", tmp_path / "o", "--base", tmp_path), "--base is for")]:
        bad = cli(*args)
        assert bad.returncode != 0 and bad.stderr.startswith("error: ") and needle in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr
