"""benchmarks/grpo_step.py runs end to end on the CPU (a tiny shape), so the GPU benchmark cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "grpo_step.py"


@pytest.mark.slow
def test_w2_smoke_run_reports_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "results.jsonl"
    args = ["--workload", "W2", "--model-size", "tiny", "--device", "cpu", "--prompts", "2"]
    args += ["--prompt-len", "12", "--new-tokens", "6", "--steps", "1", "--warmup", "1", "--out", str(out)]
    # A fresh process group: this process may hold one already, whose port the child would try to bind.
    dist_vars = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in dist_vars}
    cmd = [sys.executable, str(SCRIPT), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads(out.read_text().splitlines()[-1])
    for key in ("timing_s/gen", "timing_s/ref", "timing_s/update_actor", "perf/throughput"):
        assert record[key] > 0, key
    assert record["perf/total_num_tokens"] == 2 * 8 * (12 + 6)  # prompts x samples x (prompt + response)
    assert record["rollout/decode_tokens"] == 2 * 8 * 5  # every sample's first token comes from prefill
    assert 0 < record["perf/rollout_decode_roofline_fraction"] < 1
    assert 0 < record["mfu/update_actor"] < 1
    assert "perf/throughput" in done.stdout
    assert "machine: " in done.stdout and record["machine"]["host_cores"] == str(os.cpu_count())
