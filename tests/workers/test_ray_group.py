"""Ray worker groups on CPU: same metrics as the torchrun-style 2-process run, split placement, dead ranks.

The Ray runs of the module join one local cluster (``ray_util.ray_cluster``): a cluster start costs more
than a tiny run. The runs are separate drivers as before, each with its own actors and placement groups.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.dist_util import run_world
from support.ray_util import clean_env, ray_cluster
from support.realistic import REWARD_SOURCE, build_stopping_model, realistic_rows, sft_rows, write_jsonl
from support.sft_util import assert_same_sft, sft_argv

from hybridflow.cli.main import main

pytestmark = [pytest.mark.ray, pytest.mark.slow]

GRPO = [
    "data.train_batch_size=4",
    "rollout.n=2",
    "actor.ppo_mini_batch_size=4",
    "actor.ppo_micro_batch_size_per_gpu=2",
    "critic.ppo_micro_batch_size_per_gpu=2",
    "data.max_prompt_length=400",
    "data.max_response_length=8",
    "trainer.val_before_train=false",
    "trainer.device=cpu",
    "trainer.logger=[console]",
    "algorithm.adv_estimator=grpo",
    "actor.use_kl_loss=true",
]
VOLATILE = ("timing_s/", "perf/")


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ray")
    (root / "empty.yaml").write_text("{}\n")
    (root / "reward.py").write_text(REWARD_SOURCE)
    return {
        "model": build_stopping_model(root / "model"),  # prompts of very different lengths, EOS anywhere
        "train": write_jsonl(realistic_rows(16), root / "train.jsonl"),
        "val": write_jsonl(realistic_rows(8, seed=1), root / "val.jsonl"),
        "config": root / "empty.yaml",
        "reward": root / "reward.py",
    }


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """The address of the module's Ray cluster (8 CPU slots: 4 ranks, or 2 + 2 in split placement)."""
    with ray_cluster(num_cpus=8) as address:
        yield address


def argv(setup: dict[str, Path], run_dir: Path, *extra: str, world: int = 2) -> list[str]:
    return [
        "train",
        str(setup["config"]),
        f"model.path={setup['model']}",
        f"data.train_files=[{setup['train']}]",
        f"data.val_files=[{setup['val']}]",
        f"reward.custom_function.path={setup['reward']}",
        f"trainer.default_local_dir={run_dir}",
        f"trainer.n_gpus_per_node={world}",
        *GRPO,
        *extra,
    ]


def metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in rows}


def spmd_rank(rank: int, args: list[str]) -> int:
    """One rank of a torchrun-style run: every process runs the driver, the roles span both."""
    return main(args)


def start_cli(args: list[str], log: Path) -> subprocess.Popen:
    code = "import sys; from hybridflow.cli.main import main; sys.exit(main(sys.argv[1:]))"
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, "-c", code, *args], env=clean_env(), stdout=out, stderr=out)


def test_ray_backend_matches_the_torchrun_style_run(
    tmp_path: Path, setup: dict[str, Path], cluster: str
) -> None:
    """GRPO on prompts of very different lengths: Ray and torchrun give the same metrics at 4 ranks, two
    data-parallel rollout groups of 2 tensor-parallel ranks (one layout covers both dimensions)."""
    world = 4
    extra = (
        "trainer.total_training_steps=2",
        "trainer.test_freq=2",
        "rollout.tensor_model_parallel_size=2",
    )
    assert (
        run_world(world, spmd_rank, argv(setup, tmp_path / "spmd", *extra, world=world), timeout=600)
        == [0] * world
    )
    log = tmp_path / "ray.log"
    ray = ("trainer.backend=ray", f"trainer.ray_address={cluster}")
    proc = start_cli(argv(setup, tmp_path / "ray", *extra, *ray, world=world), log)
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    want, got = metrics(tmp_path / "spmd"), metrics(tmp_path / "ray")
    assert sorted(got) == sorted(want) == [1, 2]
    for step in (1, 2):
        assert got[step].keys() == want[step].keys()
        for key, value in want[step].items():
            assert got[step][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (step, key)
        assert got[step]["rollout_corr/log_prob_abs_diff_max"] <= 1e-5  # rollout = trainer, float32
    assert "val-core/chat/vary/reward/mean@1" in got[2]
    assert f"worker group main: {world} rank(s)" in log.read_text()


def test_ray_sft_equals_one_rank(tmp_path: Path, setup: dict[str, Path], cluster: str) -> None:
    """``hybridflow sft`` on two Ray ranks (FSDP2 over both; the driver holds the rows and sends each rank its
    share) takes one rank's steps: the losses and the trained weights (1e-5), on rows of different lengths."""
    data = write_jsonl(sft_rows(8, seed=1), tmp_path / "sft.jsonl")
    assert main(sft_argv(setup["model"], data, tmp_path / "one")) == 0
    log = tmp_path / "ray.log"
    ray = ("trainer.backend=ray", f"trainer.ray_address={cluster}")
    proc = start_cli(sft_argv(setup["model"], data, tmp_path / "ray", 2, *ray), log)
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    assert_same_sft(tmp_path / "one", tmp_path / "ray")
    assert "worker group main: 2 rank(s) holding actor (pids" in log.read_text()


def test_split_placement_runs_ppo_with_the_critic_on_its_own_pool(
    tmp_path: Path, setup: dict[str, Path], cluster: str
) -> None:
    log = tmp_path / "split.log"
    args = argv(
        setup,
        tmp_path / "run",
        "trainer.total_training_steps=2",
        "trainer.backend=ray",
        f"trainer.ray_address={cluster}",
        "trainer.placement=split",
        "algorithm.adv_estimator=gae",
        "actor.use_kl_loss=false",
    )
    proc = start_cli(args, log)
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    text = log.read_text()
    assert "worker group main: 2 rank(s) holding actor (pids" in text
    assert "worker group critic: 2 rank(s) holding critic" in text
    rows = metrics(tmp_path / "run")
    assert sorted(rows) == [1, 2] and all("critic/vf_loss" in r for r in rows.values())
    assert (tmp_path / "run" / "global_step_2" / "critic" / "model_optim" / ".metadata").is_file()


def test_a_killed_worker_stops_the_driver_with_a_named_error(
    tmp_path: Path, setup: dict[str, Path], cluster: str
) -> None:
    log = tmp_path / "kill.log"
    ray = ("trainer.backend=ray", f"trainer.ray_address={cluster}")
    proc = start_cli(argv(setup, tmp_path / "run", "trainer.total_training_steps=200", *ray), log)
    deadline = time.monotonic() + 300
    while "Step 1/200" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    pids = re.search(r"worker group main: 2 rank\(s\) holding .* \(pids (\d+), (\d+)\)", log.read_text())
    os.kill(int(pids.group(2)), signal.SIGKILL)  # rank 1 dies mid-run, rank 0 is left in its collectives
    killed = time.monotonic()
    code = proc.wait(timeout=120)
    assert time.monotonic() - killed < 60
    text = log.read_text()
    assert code != 0
    assert "rank 1 of worker group 'main' (roles: actor, ref)" in text and "died" in text
