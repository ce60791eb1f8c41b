"""Facts about the host's memory, for sizing what a job pins there."""

from __future__ import annotations

import os
from pathlib import Path


def available_host_bytes(meminfo: str | os.PathLike = "/proc/meminfo") -> int | None:
    """The host memory the kernel counts as available for new allocations (Linux ``MemAvailable``), in bytes.

    None where it cannot be read (not Linux, or an unreadable file): callers then assume there is room.
    """
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def ranks_on_host() -> int:
    """Processes of this job on this host: ``LOCAL_WORLD_SIZE`` (torchrun and the Ray launcher set it), else 1."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def check_one_process(command: str) -> None:
    """Refuse a job that runs in one process only (``command``: eval) when launched on several ranks:
    every rank would repeat the whole job and write the same files."""
    from hybridflow.utils.errors import UserError

    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched > 1:
        raise UserError(
            f"hybridflow {command} runs in one process, but this is one of {launched} ranks; launch it "
            "without torchrun (train, sft, dpo and kto run on several ranks)"
        )
