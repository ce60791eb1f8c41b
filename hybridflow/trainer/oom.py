"""The driver's side of an out-of-memory error: the plan's estimate for the phase, and one line on every rank.

A rank that runs out of device memory in a phase raises ``DeviceOutOfMemory`` (``workers.oom``). Here the
driver adds what the layout planner (``plan.search``) estimates that phase needs per GPU under the run's
own config and layout, so that the line compares the two. Under torchrun every rank runs the driver: the
failing rank leaves its line for the others (``utils.peers.post_user_error``), and a rank whose collective
that stop broke raises the same line instead of reporting a failed peer.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from hybridflow.config import Config
from hybridflow.config.validate import get_path
from hybridflow.plan.memory import estimate_phases
from hybridflow.plan.report import GB
from hybridflow.plan.search import LAYOUT_KEYS, Layout, meta_model
from hybridflow.utils.errors import UserError
from hybridflow.utils.peers import post_user_error, posted_user_error
from hybridflow.workers.oom import DeviceOutOfMemory, Phase, fix_keys, out_of_memory

logger = logging.getLogger(__name__)


def run_layout(cfg: Config) -> Layout:
    """The layout ``cfg`` runs with (the planner's ``Layout`` of its keys), for the planner's estimates."""
    values = [get_path(cfg, path) for path in LAYOUT_KEYS]  # tp_train, pp, sp, tp_generate, offloads
    sizes = [int(v or 1) for v in values[:4]]
    return Layout(cfg.trainer.world_size, *sizes, bool(values[4]), bool(values[5]))


def gigabytes(n: int) -> str:
    """Bytes in the planner's unit (GB, 1e9), with MB below 10 MB so that tiny models do not read 0.00 GB."""
    return f"{n / GB:.2f} GB" if n >= 0.01 * GB else f"{n / 1e6:.2f} MB"


def plan_estimate(cfg: Config, phase: Phase) -> str:
    """What the planner estimates ``phase`` needs per GPU under ``cfg``'s layout, as the line says it."""
    if phase.estimate is None:
        return "the layout planner has no estimate for this phase"
    from hybridflow.models.loader import load_config as load_model_config

    layout = run_layout(cfg)
    try:
        model_config = load_model_config(cfg.model.path, cfg.model.trust_remote_code)
        phases = estimate_phases(cfg, model_config, meta_model(model_config), layout)
    except Exception:  # the line must still come out: say the estimate is missing, never make one up
        logger.debug("no estimate for the phase", exc_info=True)
        return "the layout planner could not estimate this phase for this model"
    needed = phases.get(phase.estimate)
    if needed is None:
        return "the layout planner has no estimate for this phase"
    return (
        f"the plan estimates {gigabytes(needed)} per GPU for it ({phase.estimate}, {layout.describe()}; "
        "hybridflow plan shows every phase)"
    )


def completed(error: DeviceOutOfMemory, cfg: Config) -> DeviceOutOfMemory:
    """``error`` with the plan's estimate and the run's values of the keys its fix names."""
    error.estimate = plan_estimate(cfg, error.phase)
    for key in fix_keys(error.phase):
        with contextlib.suppress(AttributeError):  # a key of another section's spelling: named without it
            error.values[key] = get_path(cfg, key)
    return error


@contextlib.contextmanager
def out_of_memory_errors(cfg: Config, role: str = "driver", method: str = "step") -> Iterator[None]:
    """Stop an out-of-memory error in a phase with its one line (a ``UserError``) on every rank.

    An OOM that did not come through a rank's phase call is taken as ``role.method``: the driver's own
    work by default.
    """
    try:
        yield
    except DeviceOutOfMemory as exc:
        post_user_error(str(completed(exc, cfg)))
        raise
    except torch.OutOfMemoryError as exc:
        error = completed(out_of_memory(exc, role, method), cfg)
        post_user_error(str(error))
        raise error from exc
    except Exception as exc:
        posted = posted_user_error(exc)
        if posted is None:
            raise
        raise UserError(posted) from exc
