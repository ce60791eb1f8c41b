"""Checksums of checkpoint files: written at save, verified at load; damage is refused naming the file."""

from __future__ import annotations

import errno
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from hybridflow.checkpoint import CheckpointError, RoleState, find_latest, load, save
from hybridflow.checkpoint.manager import verify_checkpoint
from hybridflow.utils.errors import DiskFullError


def _role(seed: int) -> RoleState:
    torch.manual_seed(seed)
    module = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(module.parameters())
    module(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    return RoleState(module, optimizer)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory with two complete checkpoints (steps 1 and 2), saved once for the module."""
    run_dir = tmp_path_factory.mktemp("run")
    for step in (1, 2):
        save(run_dir, step, {"actor": _role(step)}, {"step": step}, {"world_size": 1})
    return run_dir


@pytest.fixture
def run_dir(saved: Path, tmp_path: Path) -> Path:
    """A copy of the saved run directory that a test may damage."""
    return Path(shutil.copytree(saved, tmp_path / "run"))


def _shard(ckpt: Path) -> Path:
    return next((ckpt / "actor" / "model_optim").glob("*.distcp"))


def test_every_file_has_a_checksum_and_a_clean_checkpoint_verifies(run_dir: Path) -> None:
    meta = verify_checkpoint(run_dir / "global_step_2")
    assert {"trainer_state.pt", "actor/model_optim/.metadata", "rng/main_rank_0.pt"} <= set(meta["files"])
    assert all(len(entry["sha256"]) == 64 and entry["bytes"] > 0 for entry in meta["files"].values())


def test_flipped_bytes_in_a_shard_are_refused_naming_the_file(run_dir: Path) -> None:
    ckpt = run_dir / "global_step_2"
    shard = _shard(ckpt)
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 4096] = bytes(b ^ 0xFF for b in data[middle : middle + 4096])  # 4 KiB flipped
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{shard.name} does not match the checksum"):
        load(ckpt, {"actor": _role(5)})


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        ("truncate", "were saved (truncated or overwritten)"),
        ("metadata", ".metadata is missing"),
        ("trainer_state", "trainer_state.pt is missing"),
    ],
)
def test_truncated_and_missing_files_are_refused(run_dir: Path, damage: str, said: str) -> None:
    ckpt = run_dir / "global_step_2"
    if damage == "truncate":
        shard = _shard(ckpt)
        shard.write_bytes(shard.read_bytes()[:100])
    elif damage == "metadata":
        (ckpt / "actor" / "model_optim" / ".metadata").unlink()
    else:
        (ckpt / "trainer_state.pt").unlink()
    with pytest.raises(CheckpointError, match="is damaged") as err:
        verify_checkpoint(ckpt)
    assert said in str(err.value) and str(ckpt) in str(err.value)


def test_auto_resume_falls_back_to_the_newest_undamaged_checkpoint(
    run_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (run_dir / "global_step_2" / "trainer_state.pt").write_bytes(b"garbage")
    with caplog.at_level(logging.WARNING):
        assert find_latest(run_dir, verify=verify_checkpoint) == run_dir / "global_step_1"
    assert "skipping the damaged checkpoint global_step_2" in caplog.text
    assert "trainer_state.pt has 7 bytes" in caplog.text and "using global_step_1 instead" in caplog.text
    (run_dir / "global_step_1" / "meta.json").write_text("{not json")  # both damaged: refused, naming each
    with pytest.raises(CheckpointError) as err:
        find_latest(run_dir, verify=verify_checkpoint)
    message = str(err.value)
    assert f"every checkpoint in {run_dir} is damaged" in message
    assert f"global_step_2: {run_dir / 'global_step_2' / 'trainer_state.pt'} has 7 bytes" in message
    assert f"global_step_1: {run_dir / 'global_step_1' / 'meta.json'} is not valid JSON" in message
    assert "trainer.resume=disable" in message and "Nothing was loaded or overwritten" in message


def test_a_checkpoint_without_checksums_is_still_read_and_its_damage_reported(run_dir: Path) -> None:
    ckpt = run_dir / "global_step_2"
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["files"]  # as saved before checksums existed
    (ckpt / "meta.json").write_text(json.dumps(meta))
    assert load(ckpt, {"actor": _role(5)}) == {"step": 2}
    shard = _shard(ckpt)
    shard.write_bytes(shard.read_bytes()[:64])  # no checksum to catch it: DCP's failure is translated
    with pytest.raises(CheckpointError, match=r"cannot be read .* the checkpoint is damaged"):
        load(ckpt, {"actor": _role(5)})
    (ckpt / "trainer_state.pt").unlink()
    with pytest.raises(CheckpointError, match=r"trainer_state\.pt is missing"):
        verify_checkpoint(ckpt)


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(
    run_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch.distributed.checkpoint.filesystem as dcp_fs

    def no_space(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp_fs, "_write_item", no_space)
    with pytest.raises(DiskFullError) as err:
        save(run_dir, 3, {"actor": _role(3)}, {"step": 3}, {"world_size": 1})
    message = str(err.value)
    assert "the disk is full" in message and str(run_dir) in message and "it needs about" in message
    assert not (run_dir / "global_step_3").exists() and not (run_dir / ".global_step_3.tmp").exists()
    assert find_latest(run_dir, verify=verify_checkpoint) == run_dir / "global_step_2"
