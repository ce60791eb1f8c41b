"""This rank's part of a parameter, whatever holds it (a plain tensor, or an FSDP2 / tensor-parallel DTensor)."""

from __future__ import annotations

import torch


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor behind ``t``, detached: a DTensor's local shard, or ``t`` itself (same storage)."""
    # The DTensor's own attribute: ``to_local()`` dispatches through autograd, ~16 us a call on an H200 host,
    # which over the ~300 weights of a rollout refresh was most of the switch (benchmarks/RESULTS.md).
    local = getattr(t, "_local_tensor", None)
    if local is None:
        local = t.to_local() if hasattr(t, "to_local") else t
    return local.detach()
