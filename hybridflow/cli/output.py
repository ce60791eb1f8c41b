"""The commands' outputs: a file or directory the user already has is replaced only when asked (--overwrite)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hybridflow.utils.errors import UserError


def add_overwrite_flag(parser: argparse.ArgumentParser, what: str) -> None:
    """``--overwrite``: allow replacing ``what`` (e.g. 'a non-empty --out directory')."""
    parser.add_argument("--overwrite", action="store_true", help=f"Replace {what}.")


def check_output_dir(out: Path, overwrite: bool) -> None:
    """Refuse a non-empty directory (or a file) at ``out`` unless ``overwrite``; checked before any work."""
    if out.is_file():
        raise UserError(f"--out {out} is a file; give a directory for the model")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise UserError(f"--out {out} is not empty; choose a new directory or pass --overwrite")


def check_output_file(out: Path, overwrite: bool) -> None:
    """Refuse an existing non-empty file (or a directory) at ``out`` unless ``overwrite``; checked first."""
    if out.is_dir():
        raise UserError(f"--out {out} is a directory; give a file name such as {out / 'out.jsonl'}")
    if out.is_file() and out.stat().st_size > 0 and not overwrite:
        raise UserError(f"--out {out} exists; choose another file or pass --overwrite to replace it")
