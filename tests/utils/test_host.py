"""The host memory facts that size a job's pinned buffers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hybridflow.utils.host import available_host_bytes, ranks_on_host


def test_available_host_memory_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       4096 kB\nMemFree:        1024 kB\nMemAvailable:   2048 kB\n")
    assert available_host_bytes(meminfo) == 2048 * 1024
    meminfo.write_text("MemTotal:       4096 kB\n")  # an old kernel without the line
    assert available_host_bytes(meminfo) is None
    assert available_host_bytes(tmp_path / "missing") is None
    if sys.platform == "linux":
        assert available_host_bytes() > 0


@pytest.mark.parametrize(("value", "ranks"), [("8", 8), ("x", 1), ("0", 1), (None, 1)])
def test_ranks_on_host_reads_local_world_size(monkeypatch: pytest.MonkeyPatch, value, ranks: int) -> None:
    if value is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    assert ranks_on_host() == ranks
