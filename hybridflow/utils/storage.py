"""Durable writes: fsync of files and directories, and outputs written beside their place and renamed in.

A rename within one filesystem is atomic, and once the files and their directory are fsynced it survives a
power loss. ``staged_dir`` and ``write_text_atomically`` use both, so a reader (or a resumed run) sees the old
output or the complete new one, never a half-written one.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

from hybridflow.utils.errors import disk_full_errors

logger = logging.getLogger(__name__)


def fsync_file(path: str | os.PathLike) -> None:
    """Flush one file's data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory's entries (new names, renames) to the disk; a no-op where directories cannot be opened."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # e.g. Windows
        return
    try:
        os.fsync(fd)
    except OSError:
        logger.debug("fsync of directory %s is not supported here", path)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file and directory under ``root`` (the root included), deepest first."""
    for dirpath, _, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fsync_file(os.path.join(dirpath, name))
        fsync_dir(dirpath)


def staging_path(final: str | os.PathLike) -> Path:
    """The hidden sibling ``final`` is written into before it is renamed into place."""
    final = Path(final)
    return final.with_name(f".{final.name}.partial")


def _old_path(final: Path) -> Path:
    """Where the two-rename swap parks the old ``final`` until the new one is in place."""
    return final.with_name(f".{final.name}.old")


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):  # no glibc 2.28+
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EPERM, errno.ENOTSUP):  # this filesystem cannot exchange
        return False
    raise OSError(err, os.strerror(err), str(b))


def replace_dir(staged: Path, final: Path) -> None:
    """Put the complete ``staged`` directory in place of ``final`` (whole: nothing of an old ``final`` stays);
    durable on return.

    A missing or empty ``final`` is replaced by one rename. A non-empty one (``--overwrite``, a resumed run's
    ``final_model``) is swapped with ``staged`` in one atomic exchange where the filesystem has it, else
    renamed aside and ``staged`` renamed in; the old directory is removed only once the new one is in place.
    A stale file of the old output (an adapter beside a merged model) can never mix with the new one.
    """
    fsync_tree(staged)
    try:
        os.replace(staged, final)  # absent or empty: atomic
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        old = _old_path(final)
        if _exchange(staged, final):
            old = staged  # the old output, now at the staging path
        else:
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(staged, final)  # a crash before this: ``staged_dir`` puts the old one back next time
        fsync_dir(final.parent)
        shutil.rmtree(old)
        return
    fsync_dir(final.parent)


@contextlib.contextmanager
def staged_dir(
    final: str | os.PathLike, what: str = "the output", needed: int | None = None
) -> Iterator[Path]:
    """Yield an empty directory beside ``final``; on success it replaces ``final`` whole (``replace_dir``),
    on error it is removed and ``final`` is as it was.

    A full disk, whatever library hit it, is a ``DiskFullError`` naming ``final``, ``what`` is written there
    and the bytes it ``needed`` (when known).
    """
    final = Path(final).absolute()
    if final.is_symlink():  # the link's target is the output: write beside it, on its filesystem
        final = final.resolve()
    old = _old_path(final)
    if old.is_dir() and not final.exists():  # a swap interrupted between its two renames
        logger.warning("%s was moved aside by an interrupted write; putting it back", final)
        os.rename(old, final)
    staged = staging_path(final)
    if staged.exists():
        shutil.rmtree(staged)
    staged.mkdir(parents=True)
    try:
        with disk_full_errors(final, what, needed):
            yield staged
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    with disk_full_errors(final, what, needed):  # fsync can be where a full disk shows
        replace_dir(staged, final)


def write_text_atomically(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to a hidden sibling, fsync it, and rename it over ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


@contextlib.contextmanager
def staged_file(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a hidden sibling of ``path`` to write; on success it is fsynced and renamed over ``path``."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.partial")
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_file(tmp)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def ensure_writable_dir(path: str | os.PathLike, what: str) -> Path:
    """Make ``path`` (a directory) and prove it writable; a ``UserError`` naming ``what`` and the fix otherwise.

    Catches a path that is a file, lies under a file, or is read-only or immutable, before any work starts.
    """
    from hybridflow.utils.errors import UserError, path_error

    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(
            f"{what} {path} is a file, not a directory; choose a directory (or move the file away)"
        )
    for parent in path.absolute().parents:
        if parent.exists() and not parent.is_dir():
            raise UserError(f"{what} {path} lies under {parent}, which is a file; choose another directory")
    probe = path / f".hybridflow_write_test.{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        err = path_error(e, f"{what}, which must be a writable directory")
        raise type(err)(str(err)) from None
    return path


def read_utf8_lines(path: str | os.PathLike) -> list[str]:
    """The lines of a UTF-8 text file; bad UTF-8 is a ``UserError`` naming the file, the line and the byte."""
    from hybridflow.utils.errors import UserError

    data = Path(path).read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise UserError(
            f"{path}: line {line} is not valid UTF-8 (byte 0x{data[e.start]:02x} at column {column}); "
            "re-save the file as UTF-8 (e.g. iconv -f latin1 -t utf-8) or fix that line"
        ) from None
    return text.splitlines()
