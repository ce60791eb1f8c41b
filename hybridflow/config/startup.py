"""What a job checks in its own process at start, once the device is known: the rollout dtype that
``trainer.device=auto`` left open, and verl's ``VERL_*`` environment variables, honoured or reported.

hybridflow reads no ``VERL_*`` variable. Where one asks for what hybridflow always does (the tensor
lifecycle: every batch key is dropped after the last stage that reads it), rank 0 says so once; every other
one is named in one warning line with what to use instead, so none is silently ignored.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from hybridflow.config.dtypes import check_rollout_dtype_on
from hybridflow.config.schema import Config

logger = logging.getLogger(__name__)
_reported: set[str] = set()  # lines already logged in this process

LIFECYCLE = "VERL_TENSOR_LIFECYCLE_ENABLE"
_ALWAYS_ON = (
    "the tensor lifecycle is always on in hybridflow: each step drops every batch key right after the last "
    "stage that reads it (perf/lifecycle_freed_bytes says how much)"
)
_OFF = ("0", "false", "no", "off", "")
# verl's variables with what hybridflow does instead; any other VERL_* variable is reported as unknown.
VERL_ENV: dict[str, str] = {
    "VERL_TLM_GC_INTERVAL": "batch keys are freed as soon as their last reader has run, not on an interval",
    "VERL_LOGGING_LEVEL": "pass --log-level to hybridflow (or set the 'hybridflow' logger's level)",
    "VERL_PPO_LOGGING_LEVEL": "pass --log-level to hybridflow (or set the 'hybridflow' logger's level)",
    "VERL_USE_MODELSCOPE": "models load from local directories (model.path); nothing is downloaded",
}
_ENGINES = ("VERL_VLLM", "VERL_SGLANG")  # prefixes: the built-in rollout engine runs in their place


def verl_environment_lines(environ: Mapping[str, str]) -> list[tuple[int, str]]:
    """The ``(level, line)`` reports of the ``VERL_*`` variables in ``environ`` (none when there is none)."""
    lines: list[tuple[int, str]] = []
    ignored: list[str] = []
    for name in sorted(k for k in environ if k.startswith("VERL_")):
        value = environ[name]
        if name == LIFECYCLE:
            if value.strip().lower() in _OFF:
                lines.append((logging.WARNING, f"{name}={value} is ignored: {_ALWAYS_ON}"))
            else:
                lines.append((logging.INFO, f"{name}={value}: {_ALWAYS_ON}"))
            continue
        why = VERL_ENV.get(name)
        if why is None and name.startswith(_ENGINES):
            why = "the built-in rollout engine runs in place of vLLM and SGLang"
        ignored.append(f"{name}={value} ({why or 'unknown to hybridflow'})")
    if ignored:
        lines.append(
            (logging.WARNING, "environment variables hybridflow does not read: " + "; ".join(ignored))
        )
    return lines


def check_start(cfg: Config, environ: Mapping[str, str], on_gpu: bool) -> None:
    """A job's checks at start: the rollout dtype on this device (ConfigError), then the ``VERL_*`` report.

    The report is rank 0's (``RANK``), once per process for each distinct line.
    """
    check_rollout_dtype_on(cfg, on_gpu)
    if int(environ.get("RANK", "0") or 0) != 0:
        return
    for level, line in verl_environment_lines(environ):
        if line not in _reported:
            _reported.add(line)
            logger.log(level, line)
