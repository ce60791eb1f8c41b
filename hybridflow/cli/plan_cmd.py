"""``hybridflow plan [CONFIG] [key=value ...]``: the automatic 3D layout and each phase's memory per GPU.

Nothing is started and no weights are read: the model's shape comes from ``model.path``'s config.json (or
``--model-shape``; a vision-language model's text model and vision tower), the GPUs from
``trainer.n_gpus_per_node`` x ``trainer.nnodes`` (or ``--gpus``) and their memory from this machine's first GPU
(at most ``trainer.gpu_memory_gb``) or ``--gpu-memory-gb``; the host memory that offload and the CPU step must
fit from ``--host-memory-gb``, or this machine's when planning for its own GPUs (else the output says it was
not checked and what the layout keeps there). Layout keys set in the config are kept, and checked as set; the
others are the plan's to choose, checked once chosen. The candidates table shows the chosen layout and the
best three of each verdict, ``--all`` every candidate.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hybridflow.config import Config, ConfigError

NAME = "plan"
HELP = (
    "Print the automatic 3D layout, the memory per GPU of each phase and the candidates it rejected, without "
    "starting a run."
)
SMALLEST_GB = 1.0  # no GPU (or node) has less: a smaller figure is a typo or a unit mistake (MB, TB)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``[CONFIG] [key=value ...]``, ``--gpus``, ``--gpu-memory-gb``, ``--host-memory-gb``, ``--model-shape``,
    ``--all``.

    The numbers are read as text and checked in ``run``, so that a bad one is a one-line error (exit 2).
    """
    parser.add_argument(
        "args", nargs="*", metavar="[CONFIG] [key=value ...]", help="YAML file, then overrides."
    )
    parser.add_argument(
        "--gpus", metavar="N", help="GPUs of the run (default: trainer.nnodes x n_gpus_per_node)."
    )
    parser.add_argument(
        "--gpu-memory-gb", metavar="GB", help="Memory of one GPU in GB (default: this machine's)."
    )
    parser.add_argument(
        "--host-memory-gb",
        metavar="GB",
        help="Host memory of one node in GB, which offload and the CPU step must fit (default: this machine's "
        "when planning for its GPU, else not checked).",
    )
    parser.add_argument(
        "--model-shape",
        help="A known model shape instead of model.path (qwen2.5-7b, llama-3-70b, qwen3-30b-a3b, deepseek-v3-671b, ...).",
    )
    parser.add_argument(
        "--all",
        action="store_true",
        dest="every",
        help="List every candidate scored (default: the chosen one and the best three of each verdict).",
    )


def gpu_count(text: str) -> int:
    """``--gpus``: a whole number of GPUs, at least 1."""
    from hybridflow.utils.errors import UserError

    try:
        value = int(text)
    except ValueError:
        raise UserError(f"--gpus: expected a whole number of GPUs, got {text!r}; e.g. --gpus 8") from None
    if value < 1:
        raise UserError(f"--gpus: must be at least 1, got {value}; e.g. --gpus 8")
    return value


def gpu_memory(text: str, option: str = "--gpu-memory-gb") -> int:
    """``--gpu-memory-gb`` (or ``option``): a finite number of GB, at least ``SMALLEST_GB``, in bytes."""
    from hybridflow.utils.errors import UserError

    try:
        value = float(text)
    except ValueError:
        value = math.nan
        shown = repr(text)
    else:
        shown = text
    if not (math.isfinite(value) and value >= SMALLEST_GB):
        raise UserError(
            f"{option}: expected the memory of one {'GPU' if option == '--gpu-memory-gb' else 'node'} in GB, "
            f"a number of at least {SMALLEST_GB:g} (GB, not MB), got {shown}; e.g. {option} 80"
        )
    return int(value * 1e9)


_WORLD_WORDS = ("n_gpus_per_node", "data-parallel size", " ranks")  # problems of the number of GPUs


def _with_flag(exc: ConfigError, gpus: int) -> ConfigError:
    """``exc`` with the problems ``--gpus`` caused saying so (it sets trainer.nnodes and n_gpus_per_node)."""
    from hybridflow.config import ConfigError

    note = f" (--gpus {gpus} sets trainer.nnodes=1, trainer.n_gpus_per_node={gpus})"
    problems = [
        dataclasses.replace(p, message=p.message + note) if any(w in str(p) for w in _WORLD_WORDS) else p
        for p in exc.problems
    ]
    return ConfigError(problems)


def run(args: argparse.Namespace) -> int:
    """Plan and print: the one-line choice, the phases' memory per GPU, the keys, then the candidates scored."""
    import hybridflow.trainer  # noqa: F401  (validates names registered by a reward module, as training does)
    from hybridflow.cli.config_cmd import split_file_and_overrides
    from hybridflow.config import ConfigError, load_config
    from hybridflow.config.loader import _read_yaml
    from hybridflow.config.user_keys import user_keys
    from hybridflow.plan.auto_layout import plan_chooses
    from hybridflow.plan.report import candidates_table
    from hybridflow.plan.search import apply_layout, plan_layout

    gpus = None if args.gpus is None else gpu_count(args.gpus)
    gpu = None if args.gpu_memory_gb is None else gpu_memory(args.gpu_memory_gb)
    host = None if args.host_memory_gb is None else gpu_memory(args.host_memory_gb, "--host-memory-gb")
    config, overrides = split_file_and_overrides(list(args.args))
    if gpus is not None:
        overrides += ["trainer.nnodes=1", f"trainer.n_gpus_per_node={gpus}"]
    given = user_keys(_read_yaml(config) if config is not None else {}, overrides)
    try:  # the layout keys the user left unset are the plan's to choose: checked once chosen
        cfg = load_config(config, overrides, defer=plan_chooses(given))
    except ConfigError as exc:
        raise exc if gpus is None else _with_flag(exc, gpus) from None
    model_config = _model_config(cfg, args.model_shape)
    gpu, host = _machine(cfg, gpu, host)
    layout = plan_layout(cfg, model_config, gpu, given=given, host_memory=host)
    try:
        apply_layout(cfg, layout)  # the config the run would get: its planned keys checked now
    except ConfigError as exc:
        raise exc if gpus is None else _with_flag(exc, gpus) from None
    print(layout.line())
    print(layout.table())
    print("config keys: " + " ".join(f"{k}={str(v).lower()}" for k, v in layout.overrides().items()))
    shown = "every candidate" if args.every else "the chosen one and the best three of each verdict"
    print(
        f"\ncandidates ({shown}; memory per GPU and step time are estimates; the fastest that fits is chosen):"
    )
    print(candidates_table(layout, every=args.every))
    return 0


def _model_config(cfg: Config, shape: str | None) -> Any:
    """The HF config to plan for: ``--model-shape``'s, else ``model.path``'s config.json."""
    from hybridflow.plan.shapes import MODEL_SHAPES, shape_config
    from hybridflow.utils.errors import UserError

    if shape is not None:
        return shape_config(shape)
    if cfg.model.path is None:
        raise UserError(
            f"no model to plan for: set model.path=DIR (its config.json is enough) or --model-shape (one of "
            f"{', '.join(MODEL_SHAPES)})"
        )
    from hybridflow.models.loader import load_config as load_model_config

    return load_model_config(cfg.model.path, cfg.model.trust_remote_code)


def _machine(cfg: Config, gpu: int | None, host: int | None) -> tuple[int, int | None]:
    """(one GPU's bytes, one node's host bytes or None: not checked) to plan for.

    Without ``--gpu-memory-gb``, this machine's GPU (at most ``trainer.gpu_memory_gb``), or on a machine
    without one the run's cap; the host is this machine's where the plan is for its own GPUs (no
    ``--gpu-memory-gb``, and no more GPUs per node than it has), else only ``--host-memory-gb``'s.
    """
    from hybridflow.plan import memory
    from hybridflow.utils.errors import UserError

    cap = cfg.trainer.gpu_memory_gb
    if gpu is None and memory.gpu_memory_bytes() is not None:  # this machine's GPU (capped)
        gpu = memory.gpu_memory_bytes(cap)
        if host is None and cfg.trainer.n_gpus_per_node <= memory.gpus_here():  # its own GPUs: its host
            host = memory.host_memory_bytes()
    if gpu is None and cap is not None:  # no GPU here: the run's cap stands for its GPU's size
        gpu = int(cap * 1e9)
    if gpu is None:
        raise UserError("no GPU here to read the memory of: pass --gpu-memory-gb, e.g. --gpu-memory-gb 80")
    return gpu, host
