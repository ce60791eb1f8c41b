"""The user-error type every layer raises where it checks input, and the translation of OS errors of a path.

A ``UserError`` is something the user can fix (a bad file, field, row or directory); the command line prints
its one-line message and exits 2. Anything else that escapes a command is a bug in hybridflow and prints as
an internal error with its traceback. Known library failures (safetensors, torch.distributed.checkpoint,
an ``OSError`` of a path, a full disk) are translated into ``UserError`` at the boundary where they happen.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


class UserError(ValueError):
    """Input the user can fix; the message names the file, field or row and the fix.

    It derives from ``ValueError`` so that code written against the earlier errors keeps catching it.
    """


class DiskFullError(UserError):
    """A write ran out of space (ENOSPC); the message names the path and the bytes needed."""


_DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_FIXES = {
    errno.ENOENT: "check the path",
    errno.EACCES: "fix its permissions or choose another location",
    errno.EPERM: "it may be read-only or immutable (chattr +i); fix that or choose another location",
    errno.EROFS: "the filesystem is mounted read-only; choose another location",
    errno.ENOTDIR: "a part of the path is a file, not a directory; choose another location",
    errno.EEXIST: "something is already there; move it away or choose another location",
    errno.EISDIR: "it is a directory; give a file name",
}


def find_os_error(exc: BaseException | None) -> OSError | None:
    """The first ``OSError`` in ``exc``'s chain (its causes and contexts), or None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def is_disk_full(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an error in its chain) is ENOSPC / EDQUOT."""
    found = find_os_error(exc)
    return found is not None and found.errno in _DISK_FULL


def looks_like_full_disk(exc: BaseException) -> bool:
    """Whether ``exc`` is a full disk: ENOSPC / EDQUOT in its chain or in torch.distributed.checkpoint's
    per-rank failures, or the message a library gives it without an ``OSError`` (safetensors' "No space left
    on device (os error 28)", torch.save's "unexpected pos" when its writer comes up short)."""
    failures = getattr(exc, "failures", None) or {}  # DCP's CheckpointException: {rank: (exception, trace)}
    wrapped = [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    text = str(exc)
    return (
        is_disk_full(exc)
        or any(is_disk_full(f) for f in wrapped if isinstance(f, BaseException))
        or "No space left on device" in text
        or "unexpected pos" in text
    )


@contextlib.contextmanager
def disk_full_errors(path: str | os.PathLike, what: str, needed: int | None = None) -> Iterator[None]:
    """A full disk inside the block becomes ``DiskFullError`` (one line: ``path``, ``what``, bytes needed and
    free), whatever the library that hit it raised; any other error passes as it is."""
    try:
        yield
    except DiskFullError:
        raise
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # torch.distributed.checkpoint raises a BaseException of its own
        if not looks_like_full_disk(exc):
            raise
        raise disk_full_error(path, needed, what) from exc


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes on the filesystem of ``path`` (or of its nearest existing parent); None if unknown."""
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def disk_full_error(path: str | os.PathLike, needed: int | None, what: str) -> DiskFullError:
    """The message for a full disk while writing ``what`` under ``path``: the path, bytes needed and free."""
    free = free_bytes(path)
    need = f"; it needs about {format_bytes(needed)}" if needed else ""
    have = f", {format_bytes(free)} free" if free is not None else ""
    return DiskFullError(
        f"the disk is full: writing {what} to {path} failed (No space left on device{have}){need}. Free some "
        "space or point the output to a larger disk"
    )


def path_error(exc: OSError, what: str = "") -> UserError:
    """An ``OSError`` of a path as a one-line user error naming the path and the fix."""
    path = exc.filename or "the path"
    if exc.errno in _DISK_FULL:
        return disk_full_error(path, None, what or "a file")
    reason = exc.strerror or type(exc).__name__
    fix = _FIXES.get(exc.errno or 0, "check the path and its permissions")
    doing = f" ({what})" if what else ""
    return UserError(f"cannot use {path}{doing}: {reason}; {fix}")


def format_bytes(n: int | float | None) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    if n is None:
        return "?"
    value = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} bytes" if unit == "bytes" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


class MissingFileError(UserError, FileNotFoundError):
    """A file or folder the user named does not exist (also a ``FileNotFoundError``, as before)."""
