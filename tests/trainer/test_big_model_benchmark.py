"""benchmarks/big_model.py runs end to end on the CPU (a tiny shape), so the GPU benchmark cannot rot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hybridflow.config.user_keys import file_values
from hybridflow.plan.search import LAYOUT_KEYS

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "big_model.py"


@pytest.mark.slow
def test_smoke_run_trains_through_the_cli_with_no_layout_key(tmp_path: Path) -> None:
    args = ["--model-size", "tiny", "--device", "cpu", "--prompts", "2", "--n", "4", "--prompt-len", "12"]
    args += ["--new-tokens", "6", "--steps", "2", "--work", str(tmp_path / "work"), "--out", str(tmp_path)]
    dist_vars = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in dist_vars}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    config = yaml.safe_load((tmp_path / "work" / "config.yaml").read_text())
    assert not set(file_values(config)) & set(LAYOUT_KEYS)  # the planner chooses every layout key
    summary = json.loads((tmp_path / "big_model_tiny_whole.json").read_text())
    assert len(summary["steps"]) == 2 and summary["median"]["perf/time_per_step"] > 0
    for stage in ("timing_s/gen", "timing_s/ref", "timing_s/update_actor"):
        assert all(step[stage] > 0 for step in summary["steps"]), stage
    assert set(summary["phases"]) == {"generate", "log_prob", "update_actor"}
    assert "the plain layout" in summary["plan"]  # a CPU run: nothing to fit
    assert summary["exported_gb"] > 0 and not (tmp_path / "work" / "run" / "final_model").exists()
    log = (tmp_path / "train_tiny_whole.log").read_text()
    assert "auto layout" in log and "| median 2.. |" in done.stdout
