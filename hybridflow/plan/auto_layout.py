"""The automatic layout of a PPO-family run, as every entry point applies it (CLI, notebook and step-wise APIs).

``plan_run(cfg, given)`` plans the layout (``plan.search``) for the model at ``model.path`` and this
machine's GPU, and returns the config with the planned values in the layout keys the user did not set
(``given``: the keys of the config file and the overrides); a key the user set is never changed, even when
the plan says that layout does not fit (it runs as asked, with a warning giving the plan's estimate).
``trainer.auto_layout=false`` or the baseline (``actor.hybrid_engine=false``) plans nothing. Without a GPU
(CPU runs) the plan is the plain layout, whose values are the defaults: a CPU run is the same with or
without the plan. ``log_plan`` is the one log line naming the planned keys and their values.

The layout keys the user did not set (``plan_chooses``) are not validated when the config is loaded
(``load_config(..., defer=...)``): their defaults may not suit the run (a micro-batch that does not divide
the per-GPU mini-batch), and the plan chooses them; ``plan_run`` validates the config once they are chosen,
or as it is where nothing is planned. A key the user set is validated as set, on loading.
"""

from __future__ import annotations

import logging
from typing import Any

from hybridflow.config import Config, check_config
from hybridflow.config.aliases import resolve_alias
from hybridflow.plan.memory import gpu_memory_bytes, host_memory_bytes
from hybridflow.plan.search import LAYOUT_KEYS, Layout, apply_layout, explicit_layout_keys, plan_layout

logger = logging.getLogger(__name__)

THIS_GPU = -1  # ``plan_run``'s ``gpu_bytes`` default: read this machine's GPU (none on a CPU run)


def plan_chooses(given: set[str]) -> set[str]:
    """The layout keys the plan chooses: those not in ``given`` (the keys the user set)."""
    return {path for path in LAYOUT_KEYS if resolve_alias(path)[0] not in given}


def plan_run(cfg: Config, given: set[str], gpu_bytes: int | None = THIS_GPU) -> tuple[Config, Layout | None]:
    """``cfg`` with the planned layout in the layout keys not in ``given``, and the plan (None: not planned);
    validated either way (``cfg`` may have been loaded without the keys the plan chooses validated).

    ``gpu_bytes``: the memory of one GPU to plan for (default: this machine's first GPU, None on CPU; with
    it, this machine's host memory bounds what offload and the CPU step may keep there), at most
    ``trainer.gpu_memory_gb``.
    """
    if not (cfg.trainer.auto_layout and cfg.actor.hybrid_engine) or cfg.model.path is None:
        return check_config(cfg), None
    from hybridflow.models.loader import load_config as load_model_config

    model_config = load_model_config(cfg.model.path, cfg.model.trust_remote_code)
    host = None
    if gpu_bytes == THIS_GPU:
        gpu_bytes = gpu_memory_bytes() if cfg.trainer.device != "cpu" else None
        host = host_memory_bytes()
    if gpu_bytes is not None and cfg.trainer.gpu_memory_gb is not None:  # the run uses only this share
        gpu_bytes = min(gpu_bytes, int(cfg.trainer.gpu_memory_gb * 1e9))
    layout = plan_layout(cfg, model_config, gpu_bytes, given=given, host_memory=host)
    layout.kept = explicit_layout_keys(cfg, given)
    return apply_layout(cfg, layout), layout


def planned_keys(layout: Layout) -> dict[str, Any]:
    """The layout keys the plan chose (those the config did not set) and their values."""
    return {k: v for k, v in layout.overrides().items() if k not in layout.kept}


def log_plan(cfg: Config, layout: Layout | None) -> None:
    """One line: the plan, the keys it set and their values (a warning when it does not fit), or why none."""
    if layout is None:
        if not cfg.actor.hybrid_engine:
            logger.info(
                "use_3d_hybrid=False: the baseline (every rank keeps a whole copy, no layout planned)"
            )
        elif not cfg.trainer.auto_layout:
            keys = ", ".join(f"{k}={_text(v)}" for k, v in explicit_layout_keys(cfg).items())
            logger.info("trainer.auto_layout=false: the layout as configured (%s)", keys or "the defaults")
        return
    planned = planned_keys(layout)
    keys = (
        " ".join(f"{k}={_text(v)}" for k, v in planned.items()) or "none (the config sets every layout key)"
    )
    if layout.fits:
        logger.info("%s; planned keys: %s", layout.line(), keys)
        return
    kept = [k for k in LAYOUT_KEYS if k in layout.kept]  # the keys the config set
    as_set = f"; runs as configured ({', '.join(kept)} as set), it may run out of memory" if kept else ""
    logger.warning("%s; planned keys: %s%s", layout.line(), keys, as_set)


def _text(value: Any) -> str:
    """A value as an override spells it (``true``, not ``True``)."""
    return str(value).lower() if isinstance(value, bool) else str(value)
