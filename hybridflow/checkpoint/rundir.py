"""The run directory's checkpoints: ``global_step_{N}/`` folders, the ``latest`` marker, atomic commits.

A checkpoint is written into a hidden temporary folder next to its final place and renamed into place only
after every file, ``meta.json`` last, is on disk and fsynced. A rename within one filesystem is atomic, so a
crash (or a power loss: the directory is fsynced after the rename) at any moment leaves either the complete
checkpoint or none under its final name. The marker file (verl's name, ``latest_checkpointed_iteration.txt``)
is itself replaced atomically after the rename. ``find_latest(..., verify=...)`` skips damaged checkpoints.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from hybridflow.checkpoint.sharded import CheckpointError
from hybridflow.utils.storage import fsync_dir, write_text_atomically

logger = logging.getLogger(__name__)

STEP_PREFIX = "global_step_"
LATEST_FILE = "latest_checkpointed_iteration.txt"
META_FILE = "meta.json"
_STEP_DIR = re.compile(rf"^{STEP_PREFIX}(\d+)$")
_TMP_DIR = re.compile(rf"^\.{STEP_PREFIX}(\d+)\.tmp$")


def step_dir(run_dir: str | os.PathLike, step: int) -> Path:
    """Where the checkpoint of ``step`` lives: ``{run_dir}/global_step_{step}``."""
    return Path(run_dir) / f"{STEP_PREFIX}{step}"


def temp_dir(run_dir: str | os.PathLike, step: int) -> Path:
    """The hidden folder a checkpoint of ``step`` is written into before it is renamed into place."""
    return Path(run_dir) / f".{STEP_PREFIX}{step}.tmp"


def is_complete(path: str | os.PathLike) -> bool:
    """A checkpoint folder is complete when its ``meta.json`` (written last) exists."""
    return (Path(path) / META_FILE).is_file()


def complete_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """The complete checkpoints of a run directory as ``(step, path)``, oldest first."""
    root = Path(run_dir)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir() and is_complete(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def incomplete_saves(run_dir: str | os.PathLike) -> list[Path]:
    """Folders left by interrupted saves: temporary folders and step folders without ``meta.json``."""
    root = Path(run_dir)
    if not root.is_dir():
        return []
    out = []
    for child in sorted(root.iterdir()):
        if _TMP_DIR.match(child.name) or (_STEP_DIR.match(child.name) and not is_complete(child)):
            out.append(child)
    return out


def read_latest_marker(run_dir: str | os.PathLike) -> int | None:
    """The step the marker names, or None when there is no (readable) marker."""
    path = Path(run_dir) / LATEST_FILE
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _pick(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints in the order to try: the one the marker names first, then newest to oldest."""
    complete = complete_checkpoints(run_dir)
    if not complete:
        return []
    marked = read_latest_marker(run_dir)
    by_step = dict(complete)
    newest_step, newest = complete[-1]
    order = list(reversed(complete))
    if marked is not None and marked in by_step:
        order.remove((marked, by_step[marked]))
        order.insert(0, (marked, by_step[marked]))
    elif marked is not None:
        logger.warning(
            "the latest marker names step %d, which has no complete checkpoint; using %s (step %d)",
            marked,
            newest,
            newest_step,
        )
    return order


def find_latest(run_dir: str | os.PathLike, verify: Callable[[Path], object] | None = None) -> Path | None:
    """The checkpoint to resume from: the one the marker names, else the newest complete one.

    Interrupted saves are skipped and reported: a resume never picks up a checkpoint that is not complete.
    ``verify(path)`` raising ``ValueError`` (a damaged checkpoint) skips that one too, saying why, and falls
    back to the next newest. When every complete checkpoint is damaged, ``CheckpointError`` names each and
    its damage: a fresh start would save over them, so it is never chosen silently.
    """
    chosen = None
    skipped: list[tuple[str, ValueError]] = []
    for _, path in _pick(run_dir):
        try:
            if verify is not None:
                verify(path)
        except ValueError as e:
            skipped.append((path.name, e))
            continue
        chosen = path
        break
    if chosen is None and skipped:
        raise all_damaged(run_dir, skipped)
    using = chosen.name if chosen is not None else "no checkpoint (a fresh start)"
    for path in incomplete_saves(run_dir):
        logger.warning(
            "ignoring %s: an interrupted save left it incomplete; using %s instead", path.name, using
        )
    for name, e in skipped:
        logger.warning("skipping the damaged checkpoint %s (%s); using %s instead", name, e, using)
    return chosen


def all_damaged(run_dir: str | os.PathLike, damaged: list[tuple[str, ValueError]]) -> CheckpointError:
    """The refusal of a resume whose every checkpoint is damaged: each one and its first bad file."""
    what = "; ".join(f"{name}: {getattr(e, 'damage', None) or e}" for name, e in damaged[:3])
    if len(damaged) > 3:
        what += f"; and {len(damaged) - 3} older ones"
    return CheckpointError(
        f"every checkpoint in {run_dir} is damaged, so there is none to resume from ({what}). Nothing was "
        "loaded or overwritten: restore the damaged files (from a backup or a copy), or resume from a "
        "checkpoint elsewhere (trainer.resume=PATH), or start over on purpose with trainer.resume=disable "
        "(its saves then replace these checkpoints) or in a new trainer.default_local_dir"
    )


def commit(tmp: Path, final: Path) -> None:
    """Move a fully written checkpoint into place and point the marker at it.

    An older folder under the same name (from an earlier run in this directory) is moved aside first and
    deleted only after the new one is in place, so some complete checkpoint exists at every moment.
    """
    assert is_complete(tmp), f"commit of {tmp} before its {META_FILE} was written"
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old")
        if old.exists():
            shutil.rmtree(old)
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    step = int(_STEP_DIR.match(final.name).group(1))
    write_text_atomically(final.parent / LATEST_FILE, f"{step}\n")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def prune(run_dir: str | os.PathLike, keep: int | None) -> list[Path]:
    """Delete the oldest complete checkpoints beyond the newest ``keep``; returns what was deleted."""
    if keep is None or keep <= 0:
        return []
    complete = complete_checkpoints(run_dir)
    doomed = [path for _, path in complete[:-keep]]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
        logger.info("removed old checkpoint %s (trainer.max_ckpt_to_keep=%d)", path, keep)
    return doomed


def remove_stale_temp(run_dir: str | os.PathLike) -> None:
    """Delete temporary folders left by interrupted saves (never a complete checkpoint)."""
    root = Path(run_dir)
    if not root.is_dir():
        return
    for child in root.iterdir():
        if _TMP_DIR.match(child.name) or child.name.endswith(".old"):
            shutil.rmtree(child, ignore_errors=True)
