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


# A sitecustomize module for the processes a test starts (torchrun-style ranks, the Ray driver and its rank
# actors): with HYBRIDFLOW_TEST_FULL_DISK="WHAT@RANK" the disk is full for that rank's writes of WHAT (a
# file name, or "distcp" for torch.distributed.checkpoint's shard writes, or "final_model"), read at write
# time. The writes are patched once hybridflow.workers.rank is imported (torch and DCP are loaded by then).
FULL_DISK_ENV = "HYBRIDFLOW_TEST_FULL_DISK"
FULL_DISK_SITE = """
import errno, importlib.abc, importlib.util, os, sys

ENV = "HYBRIDFLOW_TEST_FULL_DISK"


def _full(what):
    spec = os.environ.get(ENV, "")
    if not spec or spec.split("@")[0] != what:
        return False
    import torch.distributed as dist
    rank = dist.get_rank() if dist.is_initialized() else 0
    return str(rank) == spec.split("@")[1]


def _no_space(path=None):
    raise OSError(errno.ENOSPC, "No space left on device", path)


def _patch(rank_module):
    import torch
    import torch.distributed.checkpoint.filesystem as dcp_fs

    save, write_item, save_hf = torch.save, dcp_fs._write_item, rank_module.save_hf_model

    def torch_save(obj, f, *args, **kwargs):
        if _full(os.path.basename(str(f))):
            _no_space(str(f))
        return save(obj, f, *args, **kwargs)

    def dcp_write(*args, **kwargs):
        if _full("distcp"):
            _no_space()
        return write_item(*args, **kwargs)

    def save_hf_model(state, config, tokenizer, out_dir, *args, **kwargs):
        if _full(os.path.basename(str(out_dir))):
            _no_space(os.path.join(str(out_dir), "model.safetensors"))
        return save_hf(state, config, tokenizer, out_dir, *args, **kwargs)

    torch.save, dcp_fs._write_item, rank_module.save_hf_model = torch_save, dcp_write, save_hf_model


class _Hook(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "hybridflow.workers.rank":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Hook())
"""


def full_disk_site(folder: Path) -> Path:
    """A folder holding the full-disk ``sitecustomize.py``; put it first on the PYTHONPATH of a process."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(FULL_DISK_SITE)
    return folder
