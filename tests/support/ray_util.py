"""One local Ray cluster shared by the tests of a module: a cluster start costs more than a tiny run.

The cluster is started by a holder process of this test's own (``ray.init`` there starts the GCS, the raylet
and their workers as its children), so closing it stops exactly those processes and nothing else on the
machine. Runs join it with ``trainer.ray_address=ADDRESS``.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Starts a local instance, prints its address, and keeps it until its stdin closes.
HOLDER = """
import sys
import ray
ctx = ray.init(num_cpus=int(sys.argv[1]), include_dashboard=False, log_to_driver=False)
print(ctx.address_info["gcs_address"], flush=True)
sys.stdin.read()
ray.shutdown()
"""


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without the test process's own process-group variables, the repo on the path."""
    drop = ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    # A cluster started by ray.init in one process asks other drivers for a token unless auth is off.
    env.setdefault("RAY_AUTH_MODE", "disabled")
    return {**env, **extra}


@contextlib.contextmanager
def ray_cluster(num_cpus: int = 8, timeout_s: float = 180.0) -> Iterator[str]:
    """A local Ray cluster with ``num_cpus`` CPU slots (its workers see the repo); yields its address."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(num_cpus)],
        env=clean_env(RAY_USAGE_STATS_ENABLED="0"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        address = holder.stdout.readline().strip()
        assert address, "the Ray holder process exited before printing its address"
        yield address
    finally:
        holder.stdin.close()  # the holder shuts its cluster down
        try:
            holder.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            holder.kill()
            holder.wait()
