"""Dtype names of the config as torch dtypes."""

from __future__ import annotations

import torch

from hybridflow.models.loader import resolve_dtype


def to_dtype(name: str | torch.dtype) -> torch.dtype:
    """Map a dtype name from the config ('bfloat16', 'bf16', 'float32', ...) to a torch dtype."""
    return resolve_dtype(name)
