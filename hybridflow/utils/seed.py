"""Seeding every random number generator the framework uses, and the switch to deterministic kernels."""

from __future__ import annotations

import os
import random

import numpy as np
import torch


def set_seed(seed: int, deterministic: bool = False) -> None:
    """Seed Python's, NumPy's and torch's (CPU and CUDA) generators; ``deterministic``: see ``make_deterministic``."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if deterministic:
        make_deterministic()


def make_deterministic() -> None:
    """Kernels that give the same bits on every run on the same GPU (``trainer.deterministic``).

    cuBLAS keeps one fixed workspace per stream (its reductions otherwise depend on which workspace a call
    got); torch's ops take their deterministic implementations (``index_add_``, ``scatter_add_`` and embedding
    backward sort instead of using atomics) and raise on an op that has none; cuDNN neither autotunes nor picks
    non-deterministic algorithms; Inductor skips on-device autotuning, whose choice depends on timings. The
    environment variable must be set before the process's first cuBLAS call: every job and rank calls this
    at its start."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    from torch._inductor import config as inductor

    if hasattr(inductor, "deterministic"):  # torch >= 2.6
        inductor.deterministic = True
