"""Fault injection for the reliability tests: kill this process (SIGKILL) at a named point of a step.

``HYBRIDFLOW_TEST_KILL_AT="POINT:STEP[,POINT:STEP...]"`` kills the process the first time it reaches
``POINT`` at ``STEP``, exactly as ``kill -9`` from outside would, but at a moment the test chooses. Points:
``save_shards`` (shards written, the rest of the checkpoint not), ``save_commit`` (everything written, not
yet renamed into place), ``save_committed`` (committed, the step's metrics line not yet written),
``metrics_written`` (the line written) and ``step_start`` (a step about to run). ``POINT:STEP@RANK`` kills
only the process of that rank (``RANK``), so that its peers live on. Unset in normal runs: the check is one
dictionary look-up.
"""

from __future__ import annotations

import logging
import os
import signal

logger = logging.getLogger(__name__)

KILL_ENV = "HYBRIDFLOW_TEST_KILL_AT"


def kill_point(point: str, step: int) -> None:
    """SIGKILL this process if ``HYBRIDFLOW_TEST_KILL_AT`` names ``point`` at ``step`` (tests only)."""
    spec = os.environ.get(KILL_ENV)
    if not spec:
        return
    here = f"{point}:{step}"
    rank = os.environ.get("RANK", "0")
    if not any(p == here or p == f"{here}@{rank}" for p in spec.split(",")):
        return
    logger.warning("%s: killing this process at %s of step %d (tests only)", KILL_ENV, point, step)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.kill(os.getpid(), signal.SIGKILL)
