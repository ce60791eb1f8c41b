"""A demo's acceptance run in a fresh interpreter, as the command line runs it: the suite's long-lived process
slowed such runs 2-2.4x, whatever earlier tests left behind in it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Not this process's own process-group variables: its one-rank group holds MASTER_PORT.
GROUP_VARS = ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def run_fresh(runner: str, *args: str) -> dict:
    """Run ``runner`` (Python source reading ``sys.argv[1:]``) in a new interpreter; the JSON of its RESULT line."""
    env = {k: v for k, v in os.environ.items() if k not in GROUP_VARS}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", runner, *args], capture_output=True, text=True, env=env, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))
