"""benchmarks/moe_kernel.py and benchmarks/rollout.py's mixture-of-experts shapes run on CPU (tiny sizes): the
GPU runs are the lead's; these keep the scripts from rotting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
TINY_LAYER = ["--hidden", "64", "--experts", "8", "--top-k", "2", "--intermediate", "32"]


def run(script: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_the_kernel_benchmark_writes_a_row_per_batch_and_implementation(tmp_path: Path) -> None:
    out = tmp_path / "rows.jsonl"
    args = ["--device", "cpu", "--dtype", "float32", *TINY_LAYER, "--batches", "1", "8"]
    run("moe_kernel.py", *args, "--warmup", "1", "--repeats", "2", "--out", str(out))
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["batch"], r["impl"]) for r in rows] == [
        (1, "grouped"),
        (1, "loop"),
        (8, "grouped"),
        (8, "loop"),
    ]
    assert all(r["us"] > 0 and r["gpu"] == "cpu" and not r["graph"] for r in rows)
    assert all(r["max_diff_vs_loop"] < 1e-5 for r in rows if r["impl"] == "grouped")


def test_the_rollout_benchmark_builds_a_mixture_of_experts_shape() -> None:
    args = ["--device", "cpu", "--batches", "2", "--prompt-len", "6", "--new-tokens", "4", "--repeats", "1"]
    stdout = run("rollout.py", "--model", "qwen3moe-tiny", *args, "--hf-tokens", "2")
    assert "model qwen3moe-tiny" in stdout
    rows = [line.split() for line in stdout.splitlines() if line.strip().startswith("2 ")]
    assert [r[1] for r in rows] == ["eager", "HF"] and all(float(r[-3].replace(",", "")) > 0 for r in rows)
