"""One run per run directory: an exclusive ``flock`` on ``{run_dir}/.hybridflow.lock`` for the run's life.

Two runs writing one directory overwrite each other's ``config.yaml``, interleave ``metrics.jsonl`` and
prune each other's checkpoints. The first run to start takes the lock (before it writes anything there) and
writes its pid, host, command line and start time into the file; a second run is refused with one line
naming that process and the fix.

Why ``flock`` and what "stale" means with it: the kernel releases an ``flock`` when the last descriptor of
its open file is closed, which includes the holder's death by any signal (``kill -9``, the OOM killer). So a
lock is never held by a dead run; the *file* of a dead run still holds its details. Taking the lock while
the file names another process is the stale case: the run before ended without releasing (it was killed
or crashed), and its record is replaced, with a warning naming it. The one way a lock outlives its run is a
child process holding a copy of the descriptor: Python's descriptors are not inherited across ``exec``, and
a forked child closes its copy at once (``os.register_at_fork``), so a reward worker or a data loader
started by ``fork`` never keeps the directory locked. The file is never deleted: deleting it would let a
waiting process lock the deleted file while a third one creates and locks a new one.

Under torchrun every rank runs the driver; rank 0 takes the lock for them (the others take none). The
module imports nothing heavy (no torch): it is an OS utility, in ``utils`` beside ``storage``.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import shlex
import socket
import sys
import time
from pathlib import Path
from typing import Any

from hybridflow.utils.errors import UserError
from hybridflow.utils.logging import rank as env_rank

logger = logging.getLogger(__name__)

LOCK_FILE = ".hybridflow.lock"
_HELD: set[int] = set()  # this process's lock descriptors, closed in forked children


class RunDirInUse(UserError):
    """Another live process holds the run directory."""


def _close_in_child() -> None:
    """A forked child drops its copies of the parent's lock descriptors (closing is not unlocking: the
    parent's descriptor keeps the lock; ``LOCK_UN`` here would release it for the parent too)."""
    for fd in list(_HELD):
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


def _command_line() -> str:
    """This process's command line, as the shell would show it."""
    with contextlib.suppress(OSError):
        raw = Path("/proc/self/cmdline").read_bytes()
        if raw:
            return shlex.join(part.decode(errors="replace") for part in raw.rstrip(b"\0").split(b"\0"))
    return shlex.join([sys.executable, *sys.argv])


def _record() -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "command": _command_line()[:4096],  # the record stays far below what ``_read`` reads
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def _read(fd: int) -> dict[str, Any] | None:
    """The holder's record in the lock file; None when empty or unreadable (being written, or released)."""
    try:
        data = os.pread(fd, 1 << 16, 0)
        record = json.loads(data) if data.strip() else None
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _alive(pid: int) -> bool:
    """Whether a process of this pid runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: alive
        return True
    return True


def _holder(record: dict[str, Any] | None) -> str:
    """The other process as one phrase: pid, host, start time and command line (what is known)."""
    if record is None:
        return "another process (it has not written its details yet)"
    command = " ".join(str(record.get("command") or "").split())  # one line, whatever a -c script holds
    command = command if len(command) <= 300 else command[:297] + "..."
    started = f", started {record['started']}" if record.get("started") else ""
    shown = f": {command}" if command else ""
    return f"pid {record.get('pid')} on {record.get('host')}{started}{shown}"


def _refusal(run_dir: Path, lock: Path, record: dict[str, Any] | None, what: str) -> RunDirInUse:
    pid = record.get("pid") if record else None
    same_host = record is not None and record.get("host") == socket.gethostname()
    if pid == os.getpid() and same_host:
        return RunDirInUse(
            f"{what} {run_dir} is in use by another run of this process (pid {pid}); close that one first (its "
            f"close() or the end of its train()), or give this run another {what}"
        )
    if isinstance(pid, int) and same_host and not _alive(pid):
        return RunDirInUse(
            f"{what} {run_dir} is locked by a process started by a run that has ended ({_holder(record)}): a "
            f"process it started still holds {lock}; find it with `fuser -v {lock}` and stop it, or give this "
            f"run another {what}"
        )
    stop = f" (or stop it: kill {pid})" if isinstance(pid, int) and same_host else ""
    return RunDirInUse(
        f"{what} {run_dir} is in use by another run, {_holder(record)}; wait for it to end{stop}, or give this "
        f"run another {what}"
    )


class RunLock:
    """This process's exclusive hold on a run directory; ``release`` ends it (idempotent)."""

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path, self.fd = path, fd

    def release(self) -> None:
        """Clear the record (a clean end leaves no stale one) and unlock; the file stays."""
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        _HELD.discard(fd)
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
        os.close(fd)  # the last descriptor: the kernel drops the lock

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def lock_run_dir(run_dir: str | os.PathLike, what: str = "trainer.default_local_dir") -> RunLock:
    """Take ``run_dir`` for this run; ``RunDirInUse`` naming the live holder and the fix (another ``what``,
    the key that chose the directory) when another has it.

    Rank > 0 of a torchrun launch takes nothing (rank 0 holds it for the run). A filesystem without locks
    is logged and the run goes on unlocked.
    """
    run_dir = Path(run_dir)
    path = run_dir / LOCK_FILE
    if env_rank() != 0:
        return RunLock(path, None)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by exec'd children (PEP 446)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        record = _read(fd)
        os.close(fd)
        raise _refusal(run_dir, path, record, what) from None
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
            raise
        logger.warning(
            "%s cannot be locked (%s): a second run in this directory would not be stopped", path, exc
        )
        return RunLock(path, None)
    _HELD.add(fd)
    stale = _read(fd)
    if stale is not None:
        logger.warning(
            "%s held the record of %s, which ended without releasing it (killed or crashed); this run takes "
            "the directory over",
            path,
            _holder(stale),
        )
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(_record()).encode() + b"\n", 0)
    return RunLock(path, fd)
