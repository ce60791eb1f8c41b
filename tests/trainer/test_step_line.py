"""The console line per step reads as the HybridFlow write-ups show it, for RL, DPO/KTO and SFT runs."""

from __future__ import annotations

from hybridflow.trainer.tracking import format_step_line


def test_the_write_ups_line_and_what_follows_it() -> None:
    metrics = {
        "actor/pg_loss": 2.14,
        "critic/score/mean": 0.72,
        "perf/time_per_step": 0.58,
        "val/accuracy": 0.5,
    }
    assert (
        format_step_line(1, 100, metrics)
        == "Step 1/100 | Loss: 2.14 | Reward: 0.72 | Time: 0.58s | Val acc: 0.5"
    )


def test_the_loss_of_preference_and_sft_steps() -> None:
    assert (
        format_step_line(2, 40, {"loss": 0.6931, "perf/time_per_step": 0.1})
        == "Step 2/40 | Loss: 0.6931 | Time: 0.10s"
    )
    assert format_step_line(3, 9, {"sft/loss": 1.5}) == "Step 3/9 | Loss: 1.5"
    both = {"actor/pg_loss": 0.5, "loss": 9.0}  # the policy loss wins over any other
    assert format_step_line(1, 1, both) == "Step 1/1 | Loss: 0.5"


def test_a_loop_without_a_step_limit_shows_the_step_alone() -> None:
    assert format_step_line(3, None, {"actor/pg_loss": 0.5}) == "Step 3 | Loss: 0.5"
