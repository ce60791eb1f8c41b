"""Checksums of a checkpoint's files: written into its ``meta.json`` at save, verified before any load.

``meta.json["files"]`` maps every file of the checkpoint (relative path, ``meta.json`` itself excepted) to
its size and SHA-256. A checkpoint whose files are missing, truncated or changed is refused naming the
first damaged file; ``find_latest(..., verify=True)`` then falls back to the newest undamaged one.
Checkpoints written before checksums existed are checked for their required files only.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from hybridflow.checkpoint.sharded import CheckpointError

logger = logging.getLogger(__name__)

FILES_KEY = "files"
_CHUNK = 8 << 20
_THREADS = 4  # hashlib releases the GIL on large buffers: a few threads read and hash in parallel


def file_digest(path: Path) -> str:
    """The SHA-256 of one file, read in chunks."""
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(root: Path, skip: str) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.relative_to(root).as_posix() != skip)


def build_manifest(root: str | os.PathLike, skip: str = "meta.json") -> dict[str, dict[str, Any]]:
    """``{relative path: {"bytes": size, "sha256": digest}}`` of every file under ``root`` but ``skip``."""
    root = Path(root)
    files = _files(root, skip)
    with ThreadPoolExecutor(_THREADS) as pool:
        digests = list(pool.map(file_digest, files))
    return {
        p.relative_to(root).as_posix(): {"bytes": p.stat().st_size, "sha256": d}
        for p, d in zip(files, digests)
    }


def _check_one(root: Path, name: str, want: Mapping[str, Any]) -> str | None:
    """Why ``root/name`` does not match its manifest entry, or None when it does."""
    path = root / name
    if not path.is_file():
        return "is missing"
    size = path.stat().st_size
    if size != want["bytes"]:
        return f"has {size} bytes, {want['bytes']} were saved (truncated or overwritten)"
    if file_digest(path) != want["sha256"]:
        return "does not match the checksum saved with it (its bytes changed after the save)"
    return None


def find_damage(root: str | os.PathLike, meta: Mapping[str, Any], required: list[str]) -> str | None:
    """The first problem with a checkpoint's files ('FILE is missing', ...), or None when all is well.

    Without a manifest (an older checkpoint) only the ``required`` files are checked for presence.
    """
    root = Path(root)
    manifest = meta.get(FILES_KEY)
    if manifest is None:
        missing = [name for name in required if not (root / name).is_file()]
        return f"{root / missing[0]} is missing" if missing else None
    names = sorted(manifest)
    with ThreadPoolExecutor(_THREADS) as pool:
        problems = list(pool.map(lambda n: _check_one(root, n, manifest[n]), names))
    for name, problem in zip(names, problems):
        if problem is not None:
            return f"{root / name} {problem}"
    return None


def verify(root: str | os.PathLike, meta: Mapping[str, Any], required: list[str]) -> None:
    """Raise ``CheckpointError`` naming the damaged file when the checkpoint's files do not match."""
    problem = find_damage(root, meta, required)
    if problem is not None:
        error = CheckpointError(
            f"checkpoint {root} is damaged: {problem}. Resume from (or export) an earlier checkpoint, e.g. "
            "trainer.resume=auto picks the newest undamaged one, or restore the file from a backup"
        )
        error.damage = problem  # the first bad file and what is wrong with it, for a list of checkpoints
        raise error
    if meta.get(FILES_KEY) is None:
        logger.info("checkpoint %s has no checksums (saved by an older version): not verified", root)
