"""Shared by the Triton kernel tests: whether a kernel module can run in this process."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch


def _interpreted() -> bool:
    """Whether triton's language was built for the CPU interpreter in this process."""
    import triton.language as tl

    return type(tl.zeros).__name__ == "InterpretedFunction"


def needs_kernels(module: ModuleType) -> pytest.MarkDecorator:
    """Skip unless ``module``'s kernels can launch: triton imports, and CUDA or the CPU interpreter.

    tests/conftest.py sets TRITON_INTERPRET=1 without CUDA; it must be set before triton is first imported.
    """
    usable = module.available() and (torch.cuda.is_available() or _interpreted())
    return pytest.mark.skipif(
        not usable,
        reason="needs triton (pip install triton); on CPU, TRITON_INTERPRET=1 set before triton is imported",
    )
