"""Which device type this process computes on: CUDA when a GPU is visible, unless the run asks for the CPU.

``trainer.device`` sets it once per process (the jobs and each Ray rank call ``use_device_type``); everything
that would otherwise ask ``torch.cuda.is_available()`` (the engines' device, the process-group backend, the
memory figures) asks ``cuda_in_use()``.
"""

from __future__ import annotations

import os

import torch

from hybridflow.utils.errors import UserError

_KINDS = ("auto", "cuda", "cpu")
_cpu_only = False
_gpu_cap: int | None = None  # bytes of its GPU this process may allocate (``cap_gpu_memory``); None: all


def use_device_type(kind: str, setting: str = "trainer.device") -> None:
    """Compute on ``kind`` in this process: auto (CUDA when visible), cuda (a GPU must be visible) or cpu.

    ``setting`` names the user's option in the messages (a config key, or a command-line flag).
    """
    global _cpu_only
    if kind not in _KINDS:
        raise UserError(f"{setting}: unknown value {kind!r}; use one of: {', '.join(_KINDS)}")
    if kind == "cuda" and not torch.cuda.is_available():
        flag = setting.startswith("-")
        given, fix = (
            (f"{setting} cuda", f"pass {setting} auto")
            if flag
            else (f"{setting}=cuda", f"set {setting}=auto")
        )
        raise UserError(
            f"{given}, but this process sees no CUDA device; check CUDA_VISIBLE_DEVICES and the driver, or "
            f"{fix} (or cpu) to run on the CPU"
        )
    _cpu_only = kind == "cpu"


def cuda_in_use() -> bool:
    """Whether this process computes on CUDA."""
    return not _cpu_only and torch.cuda.is_available()


def local_gpu_index() -> int:
    """The GPU this process computes on: its local rank's (torchrun, Ray) modulo the visible devices."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))) % torch.cuda.device_count()


def cap_gpu_memory(gb: float | None, setting: str = "trainer.gpu_memory_gb") -> None:
    """Let this process allocate at most ``gb`` GB (1e9 bytes) of its GPU; None: the whole GPU.

    The caching allocator then refuses any allocation past the cap with an out-of-memory error, as a GPU of
    that size would. Call it before the first allocation.
    """
    global _gpu_cap
    if gb is None:
        return
    if not cuda_in_use():
        raise UserError(
            f"{setting}={gb:g} caps a GPU's memory, but this process computes on the CPU; remove {setting}"
        )
    index = local_gpu_index()
    total = torch.cuda.get_device_properties(index).total_memory
    if gb * 1e9 > total:
        raise UserError(
            f"{setting}={gb:g} is more than this GPU's {total / 1e9:.1f} GB; set at most "
            f"{setting}={int(total / 1e9)}, or remove it to use the whole GPU"
        )
    torch.cuda.set_per_process_memory_fraction(gb * 1e9 / total, index)
    _gpu_cap = int(gb * 1e9)


def gpu_memory_limit(device: torch.device | int | None = None) -> int:
    """Bytes of a GPU this process may allocate: the device's memory, or the cap when it is smaller."""
    total = int(torch.cuda.get_device_properties(device).total_memory)
    return total if _gpu_cap is None else min(total, _gpu_cap)
