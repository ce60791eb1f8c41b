"""On two GPUs (NCCL): torchrun-style runs train, save, resume and reshard; the CPU suite runs these on gloo.

NCCL reduces only CUDA tensors and each rank owns its own device, which gloo on CPU never checks. Run on a
machine with two GPUs with ``pytest -m gpu tests/trainer/test_multi_gpu.py``; skipped with fewer.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from support.dist_util import run_world
from test_checkpointing import argv, metrics
from test_jobs_gpu import grpo_with_reward_model, scored_steps
from test_preference_job import pairs, rows_of, run, write_jsonl

from hybridflow.checkpoint import read_meta
from hybridflow.cli.main import main
from hybridflow.models import build_tiny_model_and_tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA devices"
    ),
]

TWO = [
    "trainer.n_gpus_per_node=2",
    "actor.ppo_micro_batch_size_per_gpu=4",  # a rank's share of a mini-batch of 8 samples
    "critic.ppo_micro_batch_size_per_gpu=4",
    "actor.use_torch_compile=false",
    "critic.use_torch_compile=false",
]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model")
    build_tiny_model_and_tokenizer(out_dir=out, hidden_size=32, num_hidden_layers=2)
    return out


def spmd(rank: int, args: list[str]) -> int:
    """One rank of a torchrun-style run: every process runs the driver."""
    return main(args)


def compare(want: dict[int, dict], got: dict[int, dict], steps: tuple[int, ...]) -> None:
    for step in steps:
        assert got[step].keys() == want[step].keys()
        for key, value in want[step].items():
            if not key.startswith("memory/"):  # the allocator's peaks differ between processes
                assert got[step][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (step, key)


@pytest.mark.parametrize("offload", [False, True])
def test_ppo_on_two_gpus_resumes_and_reshards(tmp_path: Path, tiny_model: Path, offload: bool) -> None:
    extra = [*TWO, "trainer.total_training_steps=4", "trainer.save_freq=2"]
    if offload:
        extra += [f"{r}.fsdp.{w}_offload=true" for r in ("actor", "critic") for w in ("param", "optimizer")]
    straight = tmp_path / "straight" / "run"
    straight.parent.mkdir()
    assert run_world(2, spmd, argv(tiny_model, straight, *extra), timeout=600) == [0, 0]
    assert read_meta(straight / "global_step_4")["world_size"] == 2

    resumed = tmp_path / "resumed" / "run"
    resumed.parent.mkdir()
    resume = f"trainer.resume={straight / 'global_step_2'}"
    assert run_world(2, spmd, argv(tiny_model, resumed, *extra, resume), timeout=600) == [0, 0]
    want, got = metrics(straight), metrics(resumed)
    assert sorted(got) == [3, 4]
    compare(want, got, (3, 4))

    # One GPU picks up the two-GPU checkpoint: weights and optimizer state reshard onto one rank.
    single = tmp_path / "single" / "run"
    single.parent.mkdir()
    one = [
        a.replace("n_gpus_per_node=2", "n_gpus_per_node=1") for a in argv(tiny_model, single, *extra, resume)
    ]
    assert run_world(1, spmd, one, timeout=600) == [0]
    rows = metrics(single)
    assert sorted(rows) == [3, 4] and all(math.isfinite(v) for r in rows.values() for v in r.values())


@pytest.mark.parametrize("offload", [False, True])
def test_dpo_on_two_gpus(tmp_path: Path, tiny_model: Path, offload: bool) -> None:
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs(8))
    codes = run_world(2, run_dpo, str(tmp_path), str(tiny_model), str(data), offload, timeout=600)
    assert codes == [0, 0]
    rows = rows_of(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[0]["loss"] == pytest.approx(0.6931472, abs=1e-4) and rows[1]["rewards/margins"] != 0.0
    assert (tmp_path / "run" / "final_model" / "config.json").is_file()  # the export gathers every shard


def run_dpo(rank: int, tmp: str, model: str, data: str, offload: bool) -> int:
    flags = [
        "ref.fsdp.param_offload=true",
        "actor.fsdp.param_offload=true",
        "actor.fsdp.optimizer_offload=true",
    ]
    return run("dpo", Path(tmp), Path(model), Path(data), *TWO, *(flags if offload else []))


def test_grpo_with_a_reward_model_and_validation_on_two_gpus(tmp_path: Path, tiny_model: Path) -> None:
    extra = [*TWO, "trainer.val_before_train=true", "reward.model.micro_batch_size_per_gpu=2"]
    extra += ["reward.model.param_offload=true", "ref.fsdp.param_offload=true"]
    assert run_world(2, spmd, grpo_with_reward_model(tiny_model, tmp_path, *extra), timeout=600) == [0, 0]
    assert any(k.startswith("val") for k in rows_of(tmp_path / "run")[0])  # validation ran before step 1
    train = scored_steps(tmp_path / "run")
    assert [m["step"] for m in train] == [1, 2] and train[0]["critic/score/mean"] != 0.0
