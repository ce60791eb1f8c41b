"""A full disk during a save on 2 ranks (torchrun-style and Ray): every rank exits 2 with the one-line message.

Only one rank's write fails in most cases (its RNG file, rank 0's trainer state or final model): the
others used to wait for it in the next collective until it broke, an internal error with exit 1. The full
disk is a patched write (``reliability_util.FULL_DISK_SITE``) in the processes the test starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from reliability_util import FULL_DISK_ENV, full_disk_site, train_argv

from hybridflow.models import build_tiny_model_and_tokenizer
from hybridflow.utils.dist import free_port

REPO = Path(__file__).resolve().parents[2]
TWO = ("trainer.total_training_steps=1", "trainer.n_gpus_per_node=2", "actor.ppo_micro_batch_size_per_gpu=4")
# (where the disk is full "WHAT@RANK", is step 1's checkpoint committed): DCP fails on every rank at once;
# the RNG file, the trainer state and the final model are one rank's writes.
CASES = {
    "shards": ("distcp@1", False),
    "rng": ("main_rank_1.pt@1", False),
    "trainer_state": ("trainer_state.pt@0", False),
    "final_model": ("final_model@0", True),
}
# Runs [argv, full-disk spec] pairs one after another in one process (a process start costs more than a
# run) and writes each run's exit status and stderr to ARGV[2].rank{r}.json.
RUNNER = """
import contextlib, io, json, os, sys
from hybridflow.cli.main import main
results = []
for argv, full in json.loads(sys.argv[1]):
    os.environ["HYBRIDFLOW_TEST_FULL_DISK"] = full
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    results.append([code, err.getvalue()])
    sys.stderr.write(err.getvalue())
with open(f"{sys.argv[2]}.rank{os.environ['RANK']}.json", "w") as out:
    json.dump(results, out)
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model")
    build_tiny_model_and_tokenizer(out_dir=out, hidden_size=32, num_hidden_layers=1)
    return out


def process_env(site: Path, **extra: str) -> dict[str, str]:
    """This environment without its process-group variables, the full-disk site first on the path."""
    drop = ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK", FULL_DISK_ENV)
    base = {k: v for k, v in os.environ.items() if k not in drop}
    path = os.pathsep.join([str(site), str(REPO), base.get("PYTHONPATH", "")])
    return {**base, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


def assert_user_error(code: int, err: str, run_dir: Path) -> None:
    assert code == 2, err[-3000:]
    assert "Traceback" not in err and "internal error" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "the disk is full" in errors[0] and str(run_dir) in errors[0], err[-3000:]


def assert_saved(run_dir: Path, committed: bool) -> None:
    """Step 1's checkpoint is committed or absent, with no partial save left beside it."""
    names = sorted(p.name for p in run_dir.iterdir() if "global_step" in p.name)
    assert names == (["global_step_1"] if committed else []), names
    assert not (run_dir / "final_model").exists()


def test_a_full_disk_on_one_of_two_torchrun_ranks_exits_2_on_both(model_dir: Path, tmp_path: Path) -> None:
    runs = [
        (train_argv(model_dir, tmp_path / name, *TWO, "trainer.nccl_timeout=120"), full)
        for name, (full, _) in CASES.items()
    ]
    env = process_env(full_disk_site(tmp_path / "site"), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    env["MASTER_PORT"] = str(free_port())
    procs = []
    for rank in range(2):
        log = (tmp_path / f"rank{rank}.log").open("w")
        command = [sys.executable, "-c", RUNNER, json.dumps(runs), str(tmp_path / "results")]
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        procs.append(subprocess.Popen(command, env=rank_env, stdout=log, stderr=log))
    for rank, proc in enumerate(procs):
        assert proc.wait(timeout=600) == 0, (tmp_path / f"rank{rank}.log").read_text()[-3000:]
    for rank in range(2):
        results = json.loads((tmp_path / f"results.rank{rank}.json").read_text())
        for (code, err), name in zip(results, CASES, strict=True):
            assert_user_error(code, err, tmp_path / name)
    for name, (_, committed) in CASES.items():
        assert_saved(tmp_path / name, committed)


@pytest.mark.ray
def test_a_full_disk_on_one_ray_rank_exits_2_with_the_message(model_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    env = process_env(full_disk_site(tmp_path / "site"), **{FULL_DISK_ENV: "main_rank_1.pt@1"})
    code = "import sys; from hybridflow.cli.main import main; sys.exit(main(sys.argv[1:]))"
    args = train_argv(model_dir, run_dir, *TWO, "trainer.backend=ray", "trainer.nccl_timeout=120")
    done = subprocess.run(
        [sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert_user_error(done.returncode, done.stderr, run_dir)
    assert_saved(run_dir, committed=False)
