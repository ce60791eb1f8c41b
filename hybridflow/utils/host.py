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
