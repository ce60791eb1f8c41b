"""``hybridflow train data.task=squares``: the vision demo's whole path on a shrunken budget (a tiny Qwen2.5-VL:
blind SFT warm-up, validation, GRPO on image prompts, validation), with the rollout's log-probs equal to the
trainer's recomputation on the image prompts."""

from __future__ import annotations

import json
from pathlib import Path

from hybridflow.cli.main import main
from hybridflow.models.vision import is_vision_language
from hybridflow.trainer.vision_demo import blind_rows, run_vision_demo

SMALL = [
    "data.task_train_size=64",
    "data.task_val_size=12",
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=4",
    "actor.ppo_micro_batch_size_per_gpu=16",
    "rollout.n=4",
    "trainer.total_training_steps=2",
    "trainer.test_freq=2",
]
SFT = ["trainer.total_training_steps=3", "data.train_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=8"]


def test_the_vision_demo_trains_a_tiny_vlm_on_image_prompts(tmp_path: Path) -> None:
    result = run_vision_demo([f"trainer.default_local_dir={tmp_path}", *SMALL], sft_overrides=SFT)
    assert 0.0 <= result["before"] <= 1.0 and 0.0 <= result["after"] <= 1.0 and result["num_val"] == 12
    assert len(result["history"]) == 2
    for step in result["history"]:
        # The engine decoded with the image features and M-RoPE; the trainer recomputed them (float32).
        assert step["rollout_corr/log_prob_abs_diff_max"] < 1e-5
        assert step["response_length/mean"] > 0
    for name in ("sft_model/preprocessor_config.json", "final_model/config.json", "metrics.jsonl"):
        assert (tmp_path / name).exists(), name
    config = json.loads((tmp_path / "final_model" / "config.json").read_text())
    assert config["model_type"] == "qwen2_5_vl"


def test_the_warm_up_rows_have_no_images() -> None:
    from hybridflow.data.tasks import make_task

    rows = make_task("squares", "train", 6, 0, style="short")
    blind = blind_rows(rows)
    assert all("images" not in r and "<image>" not in r["prompt"][0]["content"] for r in blind)
    assert [r["reward_model"] for r in blind] == [r["reward_model"] for r in rows]
    assert all("images" in r for r in rows)  # the task's own rows are untouched


def test_the_cli_runs_the_vision_demo_for_the_squares_task(tmp_path: Path, capsys) -> None:
    overrides = [f"trainer.default_local_dir={tmp_path}", *SMALL, "trainer.total_training_steps=1"]
    assert main(["train", "data.task=squares", *overrides]) == 0
    out = capsys.readouterr().out
    assert "after SFT" in out and "after GRPO" in out
    from transformers import AutoConfig

    assert is_vision_language(AutoConfig.from_pretrained(tmp_path / "final_model"))
