"""benchmarks/cpu_contention.py times a command alone and beside busy processes, and stops them after."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_benchmark_times_a_command_alone_and_beside_busy_loops(tmp_path: Path) -> None:
    out = tmp_path / "rows.json"
    command = [sys.executable, "-c", "import os, time; time.sleep(0.2); print(os.environ['MARK'])"]
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "cpu_contention.py"), "--busy", "0", "1", "--settle-s", "0.2",
         "--env", "MARK=seen", "--logs", str(tmp_path / "logs"), "--out", str(out), "--", *command],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["busy"], r["returncode"]) for r in rows] == [(0, 0), (1, 0)]
    # It slept most of its time: the busy loops' CPU is not counted as its own.
    assert all(r["wall_s"] >= 0.2 and r["cpu_s"] < r["wall_s"] for r in rows)
    assert (tmp_path / "logs" / "busy1_run0.log").read_text() == "seen\n"
    assert "busy  run" in done.stdout
