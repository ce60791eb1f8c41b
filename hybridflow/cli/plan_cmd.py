"""``hybridflow plan [CONFIG] [key=value ...]``: the automatic 3D layout and each phase's memory per GPU.

Nothing is started and no weights are read: the model's shape comes from ``model.path``'s config.json (or
``--model-shape``), the GPUs from ``trainer.n_gpus_per_node`` x ``trainer.nnodes`` (or ``--gpus``) and their
memory from this machine's first GPU (or ``--gpu-memory-gb``). Layout keys set in the config are kept.
"""

from __future__ import annotations

import argparse

NAME = "plan"
HELP = "Print the automatic 3D layout and the memory per GPU of each phase, without starting a run."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``[CONFIG] [key=value ...]``, ``--gpus``, ``--gpu-memory-gb`` and ``--model-shape``."""
    parser.add_argument(
        "args", nargs="*", metavar="[CONFIG] [key=value ...]", help="YAML file, then overrides."
    )
    parser.add_argument(
        "--gpus", type=int, help="GPUs of the run (default: trainer.nnodes x n_gpus_per_node)."
    )
    parser.add_argument(
        "--gpu-memory-gb", type=float, help="Memory of one GPU in GB (default: this machine's)."
    )
    parser.add_argument(
        "--model-shape",
        help="A known model shape instead of model.path (qwen2.5-0.5b, qwen2.5-7b, llama-3-70b, ...).",
    )


def run(args: argparse.Namespace) -> int:
    """Plan and print: the one-line choice, then the phases' memory per GPU."""
    from hybridflow.cli.config_cmd import split_file_and_overrides
    from hybridflow.config import load_config
    from hybridflow.trainer.keywords import given_overrides
    from hybridflow.trainer.layout import MODEL_SHAPES, gpu_memory_bytes, plan_layout, shape_config
    from hybridflow.utils.errors import UserError

    config, overrides = split_file_and_overrides(list(args.args))
    if args.gpus is not None:
        overrides += ["trainer.nnodes=1", f"trainer.n_gpus_per_node={args.gpus}"]
    cfg = load_config(config, overrides)
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
    gpu = int(args.gpu_memory_gb * 1e9) if args.gpu_memory_gb is not None else gpu_memory_bytes()
    if gpu is None:
        raise UserError("no GPU here to read the memory of: pass --gpu-memory-gb, e.g. --gpu-memory-gb 80")
    layout = plan_layout(cfg, model_config, gpu, given=set(given_overrides(overrides)))
    print(layout.line())
    print(layout.table())
    print("config keys: " + " ".join(f"{k}={str(v).lower()}" for k, v in layout.overrides().items()))
    return 0
