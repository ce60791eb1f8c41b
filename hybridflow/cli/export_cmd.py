"""``hybridflow export CKPT_DIR --out HF_DIR``: a checkpoint's actor (or critic) as a Hugging Face model."""

from __future__ import annotations

import argparse
from pathlib import Path

from hybridflow.cli.output import add_overwrite_flag, check_output_dir
from hybridflow.utils.errors import MissingFileError, UserError

NAME = "export"
HELP = "Write a checkpoint's actor or critic as a Hugging Face model directory (the model merger)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The checkpoint (or run directory), the output directory, the role and the dtype."""
    parser.add_argument(
        "checkpoint", help="A global_step_N folder, or a run directory (its latest checkpoint)."
    )
    parser.add_argument("--out", required=True, help="Output directory for the Hugging Face model.")
    parser.add_argument("--role", default="actor", choices=["actor", "critic"], help="Which model to export.")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="Weight dtype of the export (auto: the model config's dtype, else float32).",
    )
    parser.add_argument(
        "--adapter-only",
        action="store_true",
        help="A LoRA checkpoint's adapters in PEFT's format (adapter_config.json + adapter_model.safetensors) "
        "instead of the merged model.",
    )
    add_overwrite_flag(parser, "a non-empty --out directory, whole, once the new model is complete")


def run(args: argparse.Namespace) -> int:
    """Export and print where the model went."""
    from hybridflow.checkpoint import export_hf, find_latest
    from hybridflow.checkpoint.rundir import is_complete

    ckpt = Path(args.checkpoint).expanduser()
    if not ckpt.exists():
        raise MissingFileError(f"checkpoint {ckpt} does not exist")
    if not is_complete(ckpt):
        latest = find_latest(ckpt)
        if latest is None:
            raise UserError(
                f"{ckpt} is neither a complete global_step_N checkpoint nor a run directory holding one"
            )
        ckpt = latest
    out = Path(args.out).expanduser()
    check_output_dir(out, args.overwrite)
    if args.adapter_only:
        from hybridflow.checkpoint.export import export_adapter

        export_adapter(ckpt, out, role=args.role)
        print(f"exported the {args.role} adapters of {ckpt} to {out} (PEFT format)")
        return 0
    export_hf(ckpt, out, role=args.role, dtype=args.dtype)
    print(f"exported the {args.role} of {ckpt} to {out}")
    return 0
