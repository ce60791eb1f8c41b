"""Checks of the paths a user names, from the file system alone (no torch, nothing loaded or created).

A model directory, a file to read, a directory or file to write: each check raises a ``UserError`` naming the
setting, the path and the fix, so the commands can run them before anything heavy is imported.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from hybridflow.utils.errors import MissingFileError, UserError

MODEL_FILES = ("config.json",)
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "config.json")


def _looks_like_a_hub_name(text: str) -> bool:
    """'Qwen/Qwen2.5-0.5B': a relative path of two parts, as a model hub names a model."""
    parts = text.split("/")
    return len(parts) == 2 and all(parts) and not text.startswith((".", "~"))


def check_local_dir(
    path: str | os.PathLike, need: Sequence[str] = MODEL_FILES, what: str = "model path"
) -> Path:
    """``path`` as a directory holding one of the files in ``need``; a ``UserError`` naming ``what`` otherwise.

    ``what`` is the setting that names the path (``model.path``, ``--model``, ...).
    """
    resolved = Path(path).expanduser()
    if not resolved.exists():
        hint = ""
        if _looks_like_a_hub_name(str(path)):
            hint = (
                f"; hybridflow loads models from local directories only: download it first (e.g. "
                f"`huggingface-cli download {path} --local-dir DIR`) and pass DIR"
            )
        raise MissingFileError(
            f"{what} '{path}': no such directory; pass the local directory of the model (the one holding "
            f"{need[0]}){hint}"
        )
    if not resolved.is_dir():
        raise UserError(f"{what} '{path}' is a file, not a directory; pass the directory that holds it")
    if not any((resolved / name).is_file() for name in need):
        names = " or ".join(need)
        raise UserError(
            f"{what} '{path}' has no {names}; pass the directory that a Hugging Face `save_pretrained` wrote "
            "(the one holding config.json and the weights)"
        )
    return resolved


def check_readable_file(path: str | os.PathLike, what: str, suffixes: Sequence[str] = ()) -> Path:
    """``path`` as an existing, readable file (with one of ``suffixes``, when given)."""
    resolved = Path(path).expanduser()
    if not resolved.exists():
        raise MissingFileError(f"{what}: {path}: no such file; check the path")
    if resolved.is_dir():
        raise UserError(f"{what}: {path} is a directory; give a file")
    if not os.access(resolved, os.R_OK):
        raise UserError(f"{what}: {path} is not readable; fix its permissions")
    if suffixes and resolved.suffix not in suffixes:
        raise UserError(
            f"{what}: {path}: unsupported file type {resolved.suffix or '(none)'!r}; use {' or '.join(suffixes)}"
        )
    return resolved


def check_writable_dir(path: str | os.PathLike, what: str) -> Path:
    """Whether a directory can be written (or made) at ``path``, without making it: nothing is created here."""
    resolved = Path(path).expanduser()
    if resolved.exists() and not resolved.is_dir():
        raise UserError(
            f"{what} {path} is a file, not a directory; choose a directory (or move the file away)"
        )
    probe = resolved.absolute()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise UserError(f"{what} {path} lies under {probe}, which is a file; choose another directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UserError(
            f"{what} {path}: {probe} is not writable; fix its permissions or choose another directory"
        )
    return resolved
