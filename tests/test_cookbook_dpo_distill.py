"""tinker-cookbook's DPO and SDFT trainers, unmodified, from their own environment
(`.venv-cookbook`), through our driver script and local data, against our Tinker service."""

from __future__ import annotations

import json

import pytest

from benchmarks import cookbook_dpo_distill as cd
from benchmarks import cookbook_runs as cr


def test_the_local_data_is_what_each_trainer_reads():
    pairs = cd.arithmetic_pairs(50, seed=3)
    assert all(p["chosen"] != p["rejected"] for p in pairs)
    for p in pairs:
        a, b = (int(x) for x in p["prompt"].removeprefix("What is ").removesuffix("?").split(" + "))
        assert int(p["chosen"]) == a + b and abs(int(p["rejected"]) - (a + b)) in (1, 2, 10)
    demo = cd.arithmetic_demos(1, seed=3)[0]
    assert demo["question"] == pairs[0]["prompt"] and demo["answer"].endswith(f"= {pairs[0]['chosen']}")
    warm = cd.warm_start_conversations(2)
    assert [m["role"] for m in warm[0]["messages"]] == ["user", "assistant"]
    assert warm[0]["messages"][1]["content"] == cd.WARM_REPLY


def test_kl_is_the_student_minus_the_teacher_logprob_at_steps_logging_both():
    rows = [{"step": 0, cd.SDFT_STUDENT_LP: -0.5, cd.SDFT_TEACHER_LP: -4.0},
            {"step": 1, cd.SDFT_STUDENT_LP: -1.0},
            {"step": 2, cd.SDFT_STUDENT_LP: -2.0, cd.SDFT_TEACHER_LP: -2.5}]
    assert cd.kl_curve(rows) == [(0, 3.5), (2, 0.5)]
    assert cd._ends([(0, 1.0), (1, 2.0), (2, 3.0), (3, 5.0)], k=3) == (1.5, 4.0)  # never overlapping ends
    assert cd._ends([], k=3) == (None, None)


def test_bad_arguments_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="pairs .* must be >= batch_size"):
        cd.run_dpo("http://127.0.0.1:1", tmp_path, tmp_path, pairs=4, batch_size=8)
    with pytest.raises(ValueError, match="group_size must be > 0"):
        cd.run_distill("http://127.0.0.1:1", tmp_path, tmp_path, group_size=0)
    with pytest.raises(ValueError, match="learning_rate must be > 0"):
        cd.run_distill("http://127.0.0.1:1", tmp_path, tmp_path, learning_rate=-1.0)
    with pytest.raises(ValueError, match="kind must be"):
        cd.driver_argv("ppo", {})


@pytest.mark.e2e
def test_dpo_and_sdft_run_against_the_service_and_their_metrics_move(tmp_path):
    from tinker_pipelines.models.hf_dir import write_model_dir
    from tinker_pipelines.serving.tinker.launch import start_service

    assert cr.COOKBOOK_PYTHON.exists(), "no .venv-cookbook: run scripts/setup_cookbook (CI does)"
    model_dir, _ = write_model_dir("tiny", tmp_path / "tiny-dir")
    handle = start_service(str(model_dir), home=tmp_path / "service", api_key=cr.API_KEY, device="cpu",
                           dtype="float32")
    try:
        assert cd.model_kind(model_dir) == "tiny"  # its presets: one batch of 16 pairs, 4 epochs
        dpo = cd.run_dpo(handle.url, model_dir, tmp_path / "dpo", timeout_s=300)
        assert dpo["completed"], dpo["error"]
        assert dpo["steps"] == 4
        assert dpo["accuracy_last"] > dpo["accuracy_first"] and dpo["margin_last"] > dpo["margin_first"]

        distill = cd.run_distill(handle.url, model_dir, tmp_path / "distill", timeout_s=300)
        assert distill["completed"], distill["error"]
        assert distill["student_start"].startswith("tinker://") and distill["steps"] == 6
        assert distill["kl_first"] > 1.0 > distill["kl_last"], distill["kl_curve"]
        # three training runs on the worker, with their optimizer steps: DPO's 4, the warm start's 8
        # (32 conversations // 8 x 2 epochs), and the SDFT student's 6 counted on from the warm
        # start's 8: it was created from that checkpoint (`load_checkpoint_path`)
        runs = [json.loads(p.read_text()) for p in (tmp_path / "service" / "runs").glob("*.json")]
        assert sorted(r["steps"] for r in runs) == [4, 8, 14]
    finally:
        handle.stop()
