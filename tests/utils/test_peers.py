"""A collective broken by a peer rank is reported as that, naming the rank when it is gone, never as a bug.

Two real processes joined by gloo; rank 1 exits, hangs, or both ranks hit an error of their own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridflow.utils.dist import free_port

REPO = Path(__file__).resolve().parents[2]
RANK = """
import json, os, sys, time
import torch
from hybridflow.utils.dist import all_reduce_sum, init_distributed
from hybridflow.utils.peers import peer_failure

mode, rank = sys.argv[1], int(os.environ["RANK"])
init_distributed(timeout_s=3)
if rank == 1 and mode == "exit":
    os._exit(3)
if rank == 1 and mode == "hang":
    time.sleep(30)
try:
    if mode == "bug":
        raise RuntimeError("shape '[2, 3]' is invalid for input of size 5")
    time.sleep(0.5)  # rank 1 has gone by now
    all_reduce_sum(torch.ones(2))
except Exception as exc:
    print(json.dumps(peer_failure(exc)))
    os._exit(0)  # the group is broken: no clean shutdown to wait for
"""


def run_pair(mode: str) -> str | None:
    """Rank 0's report of its failed collective (None: not a peer's failure)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    env.update(MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, mode],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(2)
    ]
    try:
        out, err = procs[0].communicate(timeout=120)
    finally:
        procs[1].kill()
        procs[1].wait()
    assert procs[0].returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize(
    ("mode", "said"),
    [
        ("exit", r"rank 0 of 2 stops because rank 1 \(pid \d+\) has exited or was killed: the collective "),
        (
            "hang",
            "rank 0 of 2 stops because a peer rank stopped answering: the collective all_reduce, called ",
        ),
    ],
)
def test_a_collective_broken_by_a_peer_names_it(mode: str, said: str) -> None:
    import re

    line = run_pair(mode)
    assert line is not None and re.search(said, line), line
    assert "called from hybridflow/utils/dist.py" in line and "Look at the other ranks' output" in line
    if mode == "hang":
        assert "timed out after trainer.nccl_timeout" in line


def test_an_error_of_the_rank_itself_is_not_blamed_on_a_peer() -> None:
    assert run_pair("bug") is None
