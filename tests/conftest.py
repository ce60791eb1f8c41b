"""Shared pytest set-up: marker-based skips for GPU and Ray tests, and a quiet, deterministic torch."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Iterator

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run in its CPU interpreter, which must be chosen before triton is first imported
    # (importing torch does not import it; transformers does).
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One thread count for the whole suite, this process and every process it starts: many tests compare a run in
# this process with one in a subprocess (a kill and a resume, Ray against torchrun) to the last bits, and float32
# results on the CPU may move with the thread count, which the automatic policy (hybridflow/utils/threads.py)
# sizes to the machine's load at each start. Tests of that policy clear it. A count given to pytest is kept.
os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu` tests without CUDA and `ray` tests without Ray installed."""
    has_cuda = torch.cuda.is_available()
    has_ray = importlib.util.find_spec("ray") is not None
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "ray" in item.keywords and not has_ray:
            item.add_marker(pytest.mark.skip(reason="needs Ray: pip install 'hybridflow[ray]'"))


@pytest.fixture
def restore_cli_logging() -> Iterator[None]:
    """The CLI's main() installs a stderr handler bound to a test's captured stream: take it away afterwards
    (and restore the level and propagation caplog relies on)."""
    root = logging.getLogger("hybridflow")
    handlers, level, propagate = list(root.handlers), root.level, root.propagate
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    root.propagate = propagate


@pytest.fixture(autouse=True)
def _deterministic_torch() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _run_in_tmp(tmp_path: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test runs in its own empty directory: run directories (runs/...) never land in the repo, and a
    run never resumes from another test's checkpoints."""
    monkeypatch.chdir(tmp_path)
