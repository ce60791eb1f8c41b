"""Which device type this process computes on: CUDA when a GPU is visible, unless the run asks for the CPU.

``trainer.device`` sets it once per process (the jobs and each Ray rank call ``use_device_type``); everything
that would otherwise ask ``torch.cuda.is_available()`` (the engines' device, the process-group backend, the
memory figures) asks ``cuda_in_use()``.
"""

from __future__ import annotations

import torch

from hybridflow.utils.errors import UserError

_KINDS = ("auto", "cuda", "cpu")
_cpu_only = False


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
