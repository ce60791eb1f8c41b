"""Helpers of the reliability tests: damaging files the way disks, copies and kills do, and tiny runs."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# A tiny RL run on the built-in task: one update per step, a few seconds a step on a CPU.
TINY_RUN = (
    "data.train_batch_size=4",
    "rollout.n=2",
    "actor.ppo_mini_batch_size=4",
    "actor.ppo_micro_batch_size_per_gpu=8",
    "data.max_response_length=6",
    "data.task_train_size=12",
    "data.task_val_size=4",
    "trainer.val_before_train=false",
    "trainer.test_freq=0",
    "trainer.logger=[console]",
    "actor.optim.lr=1e-3",
)


def train_argv(model: Path, run_dir: Path, *extra: str) -> list[str]:
    """``hybridflow train`` of the tiny run on ``model`` into ``run_dir``, then ``extra`` overrides."""
    return ["train", f"model.path={model}", f"trainer.default_local_dir={run_dir}", *TINY_RUN, *extra]


def flip_bytes(path: Path, count: int = 4096, start: int | None = None) -> None:
    """Invert ``count`` bytes of ``path`` from ``start`` (default: the middle); the size stays the same."""
    data = bytearray(path.read_bytes())
    start = max(0, len(data) // 2 - count // 2) if start is None else start
    data[start : start + count] = bytes(b ^ 0xFF for b in data[start : start + count])
    path.write_bytes(bytes(data))


def truncate(path: Path, keep: float = 0.5) -> None:
    """Cut ``path`` to ``keep`` of its length, as an interrupted copy leaves it."""
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def copy_of(src: Path, dst: Path) -> Path:
    """A copy of the folder ``src`` at ``dst`` (a test damages its own copy)."""
    return Path(shutil.copytree(src, dst))


def shard_of(ckpt: Path, role: str = "actor") -> Path:
    """The first ``.distcp`` shard of a role in a checkpoint folder."""
    return sorted((ckpt / role / "model_optim").glob("*.distcp"))[0]


def metrics_steps(run_dir: Path) -> list[int]:
    """The step of every line of a run's metrics.jsonl, in file order."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]
