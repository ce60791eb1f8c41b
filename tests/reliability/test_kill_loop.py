"""kill -9 at chosen moments of saves and metrics writes, several times in a row, on 1 and 2 ranks.

Each killed run is resumed (trainer.resume=auto) until one finishes; the run then has every step's line in
metrics.jsonl exactly once, with the values of an uninterrupted run, and the same final weights. The kills
are SIGKILLs the process sends itself at a named point (``HYBRIDFLOW_TEST_KILL_AT``), so the moments are
exact: between the shards and the rest of a checkpoint, before its commit, between the commit and the
step's metrics line, and right after the line.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from reliability_util import metrics_steps, train_argv
from safetensors.torch import load_file

from hybridflow.cli.main import main
from hybridflow.models import build_tiny_model_and_tokenizer
from hybridflow.utils.dist import free_port
from hybridflow.utils.faults import KILL_ENV

REPO = Path(__file__).resolve().parents[2]
POINTS = ("save_shards", "save_commit", "save_committed", "metrics_written")
VOLATILE = ("timing_s/", "perf/")
STEPS = 3
# Runs argv lists one after another in one process (a process start costs more than a tiny run); each
# entry is [argv, kill spec or null]. Exits with the first non-zero status.
RUNNER = """
import json, os, sys
from hybridflow.cli.main import main
from hybridflow.utils.faults import KILL_ENV
for argv, kill in json.loads(sys.argv[1]):
    os.environ.pop(KILL_ENV, None)
    if kill:
        os.environ[KILL_ENV] = kill
    code = main(argv)
    if code:
        sys.exit(code)
"""


REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str) % 3 == 0)  # varies within groups of a random model: the weights move
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model")
    build_tiny_model_and_tokenizer(out_dir=out, hidden_size=32, num_hidden_layers=1)
    (out.parent / "reward.py").write_text(REWARD)
    return out


def run_argv(model: Path, run_dir: Path, *extra: str) -> list[str]:
    """The tiny run with a reward that varies, so that every step changes the weights."""
    return train_argv(model, run_dir, f"reward.custom_function.path={model.parent / 'reward.py'}", *extra)


def launch(runs: list[tuple[list[str], str | None]], world: int, log: Path) -> list[int]:
    """Start ``world`` ranks (torchrun's variables) running ``runs``; their exit codes once all ended.

    When one rank is killed the others would wait for it in a collective: they are killed too. A port
    taken by another process between ``free_port`` and the rendezvous (the machine is shared) fails the
    start before anything ran: that start is made again on another port.
    """
    for _ in range(3):
        codes = launch_once(runs, world, log)
        logs = [log.with_suffix(f".rank{r}.log").read_text() for r in range(world)]
        if codes == [0] * world or not any("EADDRINUSE" in t or "ddress already in use" in t for t in logs):
            return codes
    return codes


def launch_once(runs: list[tuple[list[str], str | None]], world: int, log: Path) -> list[int]:
    """One start of ``launch``'s ranks on a fresh port."""
    port = str(free_port())
    base = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", KILL_ENV)}
    procs = []
    for rank in range(world):
        env = {
            **base,
            "PYTHONPATH": os.pathsep.join([str(REPO), base.get("PYTHONPATH", "")]),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "OMP_NUM_THREADS": "1",
        }
        out = log.with_suffix(f".rank{rank}.log").open("w")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", RUNNER, json.dumps(runs)], env=env, stdout=out, stderr=out
            )
        )
    first = procs[0].wait(timeout=600)  # two tiny runs; generous for a loaded machine
    for proc in procs[1:]:
        if first != 0:
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=120)
    return [p.returncode for p in procs]


def kill_plan(seed: int, steps: int) -> list[str]:
    """One kill per step at a point drawn at random (seeded): 'POINT:STEP'."""
    rng = random.Random(seed)
    return [f"{rng.choice(POINTS)}:{step}" for step in range(1, steps + 1)]


def steady_metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows}


def assert_same_run(got: Path, want: Path, steps: int, model: Path) -> None:
    assert metrics_steps(got) == list(range(1, steps + 1))  # every step exactly once, in order
    got_m, want_m = steady_metrics(got), steady_metrics(want)
    for step in range(1, steps + 1):
        assert got_m[step].keys() == want_m[step].keys(), step
        for key, value in want_m[step].items():
            assert got_m[step][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (step, key)
    got_w = load_file(got / "final_model" / "model.safetensors")
    want_w = load_file(want / "final_model" / "model.safetensors")
    assert got_w.keys() == want_w.keys()
    for name in want_w:
        torch.testing.assert_close(got_w[name], want_w[name], rtol=1e-5, atol=1e-7)
    start = load_file(model / "model.safetensors")
    assert any(not torch.equal(start[k], want_w[k]) for k in want_w if k in start)  # training moved them


def test_kill_9_during_saves_and_metrics_writes_then_resume_on_one_rank(
    model_dir: Path, tmp_path: Path
) -> None:
    per_step = (f"trainer.total_training_steps={STEPS}", "trainer.save_freq=1")
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert main(run_argv(model_dir, straight, *per_step)) == 0
    plan = kill_plan(seed=29, steps=STEPS)
    for i, kill in enumerate(plan):
        codes = launch([(run_argv(model_dir, killed, *per_step), kill)], 1, tmp_path / f"kill{i}.log")
        assert codes == [-signal.SIGKILL], (kill, (tmp_path / f"kill{i}.rank0.log").read_text()[-3000:])
    assert main(run_argv(model_dir, killed, *per_step)) == 0  # the last resume finishes the run
    assert_same_run(killed, straight, STEPS, model_dir)


def test_kill_9_between_a_commit_and_its_metrics_line_on_two_ranks(model_dir: Path, tmp_path: Path) -> None:
    two = (
        "trainer.total_training_steps=1",
        "trainer.n_gpus_per_node=2",
        "actor.ppo_micro_batch_size_per_gpu=4",
    )
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    runs = [
        (run_argv(model_dir, straight, *two), None),
        (run_argv(model_dir, killed, *two), "save_committed:1"),
    ]
    codes = launch(runs, 2, tmp_path / "kill.log")
    assert codes[0] == -signal.SIGKILL, (tmp_path / "kill.rank0.log").read_text()[-3000:]
    assert (killed / "global_step_1" / "meta.json").is_file() and metrics_steps(killed) == []
    codes = launch([(run_argv(model_dir, killed, *two), None)], 2, tmp_path / "resume.log")
    assert codes == [0, 0], (tmp_path / "resume.rank0.log").read_text()[-3000:]
    assert_same_run(killed, straight, 1, model_dir)  # the lost line came back from the checkpoint


def test_the_survivor_of_a_killed_peer_names_it_and_exits_1(model_dir: Path, tmp_path: Path) -> None:
    """Rank 1 is killed as step 1 starts: rank 0 finds out in a collective, a failed rank, not a bug."""
    two = (
        "trainer.total_training_steps=1",
        "trainer.n_gpus_per_node=2",
        "actor.ppo_micro_batch_size_per_gpu=4",
    )
    codes = launch(
        [(run_argv(model_dir, tmp_path / "run", *two), "step_start:1@1")], 2, tmp_path / "peer.log"
    )
    log = (tmp_path / "peer.rank0.log").read_text()
    assert codes == [1, -signal.SIGKILL], log[-3000:]
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in log and "internal error" not in log, log[-3000:]
    pid = re.search(r"rank 1 \(pid (\d+)\) has exited or was killed: the collective (\w+)", errors[0])
    assert pid is not None and errors[0].startswith("error: rank 0 of 2 stops because "), errors[0]
    assert "called from hybridflow/" in errors[0] and "Look at the other ranks' output" in errors[0]
