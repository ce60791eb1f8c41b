"""benchmarks/switch.py's plan table runs anywhere (its GPU timing needs a GPU and refuses without one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "switch.py"


def test_the_plan_table_has_every_layout_and_names_what_tp_cannot_split() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--plan-only", "--model-size", "0.5b"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("| 0.5b")]
    assert len(rows) == 9  # W in 2, 4, 8 and each tp up to W
    by_layout = {(r[1], r[2]): r for r in rows}
    assert by_layout[("4", "1")][-1] == "0.75 of a copy |"  # a replica lacks 3/4 of the weights at W = 4
    assert by_layout[("4", "2")][-1] == "0.25 of a copy |"  # half a copy, of which it holds a quarter
    assert "num_attention_heads=14" in by_layout[("8", "4")][-1]  # 14 heads do not split 4 ways


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is there: the timing would run")
def test_the_timing_needs_a_gpu() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--model-size", "0.5b"], capture_output=True, text=True
    )
    assert done.returncode != 0 and "needs a GPU" in done.stderr


def test_the_views_table_gives_each_training_view_its_memory_and_switch() -> None:
    script = SCRIPT.parent / "views.py"
    done = subprocess.run(
        [sys.executable, str(script), "--model-size", "0.5b", "--world", "2", "--moe-size"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {
        (r[1], r[2]): r for r in (line.split(" | ") for line in done.stdout.splitlines()) if r[0] == "| 0.5b"
    }
    assert sorted(rows) == [
        ("(fsdp=2)", "(tp=1)"),
        ("(fsdp=2)", "(tp=2)"),
        ("(tp=1, pp=2, dp=1)", "(tp=1)"),
        ("(tp=1, pp=2, dp=1)", "(tp=2)"),
        ("(tp=2, pp=1, dp=1)", "(tp=1)"),
        ("(tp=2, pp=1, dp=1)", "(tp=2)"),
    ]
    # two stages: each rank holds one stage's layers and receives the other's at the switch
    stages = rows[("(tp=1, pp=2, dp=1)", "(tp=1)")]
    assert float(stages[3]) < float(rows[("(fsdp=2)", "(tp=1)")][3]) * 1.5 and float(stages[6]) > 0
    # the same tensor-parallel split in both views at dp = 1: the shards are used where they are
    assert rows[("(tp=2, pp=1, dp=1)", "(tp=2)")][6] == "0.000"
    # a whole replica per rank needs the half of every weight the other rank holds
    assert float(rows[("(fsdp=2)", "(tp=1)")][6]) > 0


def test_the_views_table_shows_expert_parallel_training_into_sliced_or_split_experts() -> None:
    script = SCRIPT.parent / "views.py"
    argv = [sys.executable, str(script), "--model-size", "--moe-size", "mixtral-8x7b", "--moe-world", "16"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {(r[1], r[2]): r for r in (line.split(" | ") for line in done.stdout.splitlines()) if len(r) > 3}
    sliced = rows[("(tp=8, pp=1, dp=2, ep=2)", "(tp=4)")]  # the write-ups' train tp=8, ep=2 -> generate tp=4
    split = rows[("(tp=8, pp=1, dp=2, ep=2)", "(tp=4, ep=4)")]
    assert sliced[5] == split[5] == "23.35"  # a quarter of the bf16 weights either way
    # the ep = 2 training ranks hold half of the experts whole: the sliced rollout gathers a quarter of every
    # expert's slice from them, the split one whole experts (each rank's two, of which it holds none or all)
    assert 0 < float(sliced[6]) < float(split[6])
    assert "num_local_experts=8" in rows[("(fsdp=16, ep=16)", "(tp=16, ep=16)")][-1]
    # the experts over two rollout groups (ep 8 = tp 4 x 2): one expert a rank, half the generation weights of
    # the group-wide split, and no more bytes received than the sliced rollout's
    wide = rows[("(tp=8, pp=1, dp=2, ep=2)", "(tp=4, ep=8)")]
    assert float(wide[5]) < float(split[5]) and float(wide[6]) <= float(sliced[6])
