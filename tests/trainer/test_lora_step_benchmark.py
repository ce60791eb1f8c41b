"""benchmarks/lora_step.py runs on the CPU (the tiny shape), so the GPU benchmark of issue 46 cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "lora_step.py"


@pytest.mark.slow
def test_the_lora_benchmark_smoke_run(tmp_path: Path) -> None:
    dist_vars = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in dist_vars}
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPT.parents[1]), *filter(None, [env.get("PYTHONPATH")])])
    args = ["--tiny", "--work", str(tmp_path / "work"), "--out", str(tmp_path), "--cases", "7b-lora64-24gb"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (summary,) = json.loads((tmp_path / "lora_step.json").read_text()).values()
    assert "model.lora_rank=64" in summary["run"]["overrides"] and len(summary["steps"]) == 2
    assert all(step["timing_s/ref"] > 0 and step["timing_s/update_actor"] > 0 for step in summary["steps"])
    log = (tmp_path / "lora_step_7b-lora64-24gb.log").read_text()
    assert "LoRA:" in log and "merged in place" in log  # the switch line names the in-place merge
    assert "| 7b-lora64-24gb |" in done.stdout
