"""``hybridflow plan [CONFIG] [key=value ...]``: the automatic 3D layout and each phase's memory per GPU.

Nothing is started and no weights are read: the model's shape comes from ``model.path``'s config.json (or
``--model-shape``), the GPUs from ``trainer.n_gpus_per_node`` x ``trainer.nnodes`` (or ``--gpus``) and their
memory from this machine's first GPU (at most ``trainer.gpu_memory_gb``) or ``--gpu-memory-gb``; the host memory that offload and the CPU step
must fit from ``--host-memory-gb`` (or this machine's, when planning for its GPU). Layout keys set in the
config are kept.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridflow.config import ConfigError

NAME = "plan"
HELP = (
    "Print the automatic 3D layout, the memory per GPU of each phase and the candidates it rejected, without "
    "starting a run."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``[CONFIG] [key=value ...]``, ``--gpus``, ``--gpu-memory-gb``, ``--host-memory-gb``, ``--model-shape``.

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
        help="A known model shape instead of model.path (qwen2.5-0.5b, qwen2.5-7b, llama-3-70b, ...).",
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
    """``--gpu-memory-gb`` (or ``option``): a finite number of GB above 0, in bytes."""
    from hybridflow.utils.errors import UserError

    try:
        value = float(text)
    except ValueError:
        value = math.nan
        shown = repr(text)
    else:
        shown = text
    if not (math.isfinite(value) and value > 0):
        raise UserError(
            f"{option}: expected the memory of one {'GPU' if option == '--gpu-memory-gb' else 'node'} in GB, "
            f"a number greater than 0, got {shown}; e.g. {option} 80"
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
    """Plan and print: the one-line choice, the phases' memory per GPU, the keys, then every candidate scored."""
    from hybridflow.cli.config_cmd import split_file_and_overrides
    from hybridflow.config import ConfigError, load_config
    from hybridflow.trainer.keywords import given_overrides
    from hybridflow.trainer.layout import candidates_table, gpu_memory_bytes, host_memory_bytes, plan_layout
    from hybridflow.trainer.model_shapes import MODEL_SHAPES, shape_config
    from hybridflow.utils.errors import UserError

    gpus = None if args.gpus is None else gpu_count(args.gpus)
    gpu = None if args.gpu_memory_gb is None else gpu_memory(args.gpu_memory_gb)
    host = None if args.host_memory_gb is None else gpu_memory(args.host_memory_gb, "--host-memory-gb")
    config, overrides = split_file_and_overrides(list(args.args))
    if gpus is not None:
        overrides += ["trainer.nnodes=1", f"trainer.n_gpus_per_node={gpus}"]
    try:
        cfg = load_config(config, overrides)
    except ConfigError as exc:
        raise exc if gpus is None else _with_flag(exc, gpus) from None
    if args.model_shape is not None:
        model_config = shape_config(args.model_shape)
    elif cfg.model.path is not None:
        from hybridflow.models.loader import load_config as load_model_config

        model_config = load_model_config(cfg.model.path, cfg.model.trust_remote_code)
    else:
        raise UserError(
            f"no model to plan for: set model.path=DIR (its config.json is enough) or --model-shape (one of "
            f"{', '.join(MODEL_SHAPES)})"
        )
    cap = cfg.trainer.gpu_memory_gb
    if gpu is None and gpu_memory_bytes() is not None:  # this machine's GPU (capped) and host, unless given
        gpu, host = gpu_memory_bytes(cap), host if host is not None else host_memory_bytes()
    if gpu is None and cap is not None:  # no GPU here: the run's cap stands for its GPU's size
        gpu = int(cap * 1e9)
    if gpu is None:
        raise UserError("no GPU here to read the memory of: pass --gpu-memory-gb, e.g. --gpu-memory-gb 80")
    layout = plan_layout(cfg, model_config, gpu, given=set(given_overrides(overrides)), host_memory=host)
    print(layout.line())
    print(layout.table())
    print("config keys: " + " ".join(f"{k}={str(v).lower()}" for k, v in layout.overrides().items()))
    print("\ncandidates (memory per GPU and step time are estimates; the fastest that fits is chosen):")
    print(candidates_table(layout))
    return 0
