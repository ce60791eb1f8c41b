"""A watchdog process for reward calls made in the trainer's own process (``reward.num_workers=0``).

A call stuck in C code that holds the GIL stops every thread of the process: the timer's signal handler,
any watchdog thread and the waiting thread all need the GIL, so nothing inside the process can report it,
and the run hangs. This watchdog is a small separate process (the standard library only, started once per
trainer process on first use, in about 30 ms) that shares a page of memory with the trainer. Before each
call the trainer writes ``(call index, start time)`` into its slot (a ``struct.pack_into``, well under a
microsecond; no system call); the watchdog polls the slots a few times a second. A call still running
``stuck_after(timeout_s)`` after it started (twice its limit, at least ``STUCK_GRACE_S`` past it) could not
be interrupted: the watchdog prints one ``error:`` line naming the function, the sample and the fix, and
stops the trainer (SIGTERM, then SIGKILL two seconds later if a handler keeps it alive), so the run ends
instead of hanging. The watchdog exits when the trainer does (its pipe closes).
"""

from __future__ import annotations

import atexit
import json
import logging
import mmap
import os
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)

STUCK_GRACE_S = 5.0  # the least time past reward.timeout_s before a call counts as stuck
SLOTS = 16  # calls watched at once (run_here on several threads); more run unwatched
SLOT_BYTES = 1024
_HEAD = struct.Struct("<qdq")  # in use, seconds after its start at which a call is stuck, number of calls
_CLOCK = struct.Struct("<qd")  # index of the call in progress (-1: none), its start (time.monotonic)
_CLOCK_AT = _HEAD.size
_TEXT_AT = _CLOCK_AT + _CLOCK.size

# The watchdog process: argv = trainer pid, shared file's fd, pipe's read end. Kept to the standard library.
_SOURCE = r"""
import json, os, select, signal, struct, sys, time, mmap
signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the trainer's to handle
parent, fd, pipe = (int(a) for a in sys.argv[1:4])
SLOTS, SIZE, HEAD, CLOCK = int(sys.argv[4]), int(sys.argv[5]), struct.Struct("<qdq"), struct.Struct("<qd")
mm = mmap.mmap(fd, SLOTS * SIZE)
seen = [None] * SLOTS


def gone(wait):
    ready, _, _ = select.select([pipe], [], [], wait)
    return (ready and not os.read(pipe, 64)) or os.getppid() != parent


def stuck():
    now = time.monotonic()
    for s in range(SLOTS):
        used, limit, count = HEAD.unpack_from(mm, s * SIZE)
        snap = CLOCK.unpack_from(mm, s * SIZE + HEAD.size) if used else None
        # the same snapshot on two polls: a read torn by a concurrent write never repeats
        if snap is not None and snap[0] >= 0 and now - snap[1] > limit and seen[s] == snap:
            text = json.loads(mm[s * SIZE + HEAD.size + CLOCK.size : (s + 1) * SIZE].rstrip(b"\0"))
            return text, snap[0], count, now - snap[1]
        seen[s] = snap
    return None


while not gone(0.25):
    found = stuck()
    if found is None:
        continue
    text, index, count, ran = found
    on = text["unit"] if text["unit"] else f"sample {index} (of {count} in this call)"
    sys.stderr.write(
        f"error: {text['name']} has run {ran:.1f} s on {on}, past "
        f"reward.timeout_s={text['timeout']}, and cannot be interrupted in the trainer's process (it is "
        f"stuck in C code, or it caught the timeout): the run is stopped; fix: {text['fix']}\n"
    )
    sys.stderr.flush()
    try:
        os.kill(parent, signal.SIGTERM)
        if not gone(2.0):
            os.kill(parent, signal.SIGKILL)
    except ProcessLookupError:
        pass
    break
"""


def stuck_after(timeout_s: float) -> float:
    """Seconds after its start at which a call of limit ``timeout_s`` counts as stuck (and the run stops)."""
    return timeout_s + max(STUCK_GRACE_S, timeout_s)


class Slot:
    """One run_here's place in the shared page: ``arm`` before each call, released when the run ends."""

    def __init__(self, view: mmap.mmap | None, base: int) -> None:
        self.view, self.base = view, base

    def arm(self, index: int, started: float) -> None:
        """Call ``index`` started at ``started`` (``time.monotonic``): the watchdog times it from there."""
        if self.view is not None:
            _CLOCK.pack_into(self.view, self.base + _CLOCK_AT, index, started)

    def disarm(self) -> None:
        """No call in progress (between calls of a thread that was abandoned, at the end)."""
        if self.view is not None:
            _CLOCK.pack_into(self.view, self.base + _CLOCK_AT, -1, 0.0)


class Watchdog:
    """The watchdog process of this trainer process and the page of slots it shares with it."""

    def __init__(self) -> None:
        size = SLOTS * SLOT_BYTES
        self.pid = os.getpid()
        self.pipe = -1
        # memory the two processes share: an anonymous memfd (Linux), else an unlinked temporary file
        if hasattr(os, "memfd_create"):
            self.fd = os.memfd_create("hybridflow-reward-watchdog")
        else:
            self.fd, path = tempfile.mkstemp(prefix="hybridflow-reward-watchdog-")
            os.unlink(path)
        os.ftruncate(self.fd, size)
        self.view = mmap.mmap(self.fd, size)
        read_end, self.pipe = os.pipe()
        try:
            args = [str(self.pid), str(self.fd), str(read_end), str(SLOTS), str(SLOT_BYTES)]
            self.proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _SOURCE, *args],
                pass_fds=(self.fd, read_end),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,  # not in the terminal's process group: a Ctrl-C is not its
            )
        finally:
            os.close(read_end)
        self.free = list(range(SLOTS))
        self.lock = threading.Lock()
        atexit.register(self.close)

    def alive(self) -> bool:
        """Whether the watchdog process still runs, for this process (a fork needs its own)."""
        return self.pid == os.getpid() and self.proc.poll() is None

    @contextmanager
    def slot(self, name: str, fix: str, timeout_s: float, count: int, unit: str = "") -> Iterator[Slot]:
        """A slot for ``count`` calls of ``name`` (``unit`` names what a call scores, default the sample)."""
        with self.lock:
            index = self.free.pop() if self.free else None
        if index is None:  # more run_here calls at once than slots: this one is not watched
            yield Slot(None, 0)
            return
        base = index * SLOT_BYTES
        text = json.dumps({"name": name, "fix": fix, "timeout": timeout_s, "unit": unit}).encode()
        room = SLOT_BYTES - _TEXT_AT
        self.view[base + _TEXT_AT : base + SLOT_BYTES] = text[:room].ljust(room, b"\0")
        slot = Slot(self.view, base)
        slot.disarm()
        _HEAD.pack_into(self.view, base, 1, stuck_after(timeout_s), count)
        try:
            yield slot
        finally:
            _HEAD.pack_into(self.view, base, 0, 0.0, 0)
            slot.disarm()
            with self.lock:
                self.free.append(index)

    def close(self) -> None:
        """Stop the watchdog and reap it (at exit; a forked child may still hold the pipe open)."""
        if self.pid != os.getpid() or self.pipe < 0:
            return
        os.close(self.pipe)
        self.pipe = -1
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


_WATCHDOG: Watchdog | None = None
_FAILED_IN: int | None = None  # the process where the watchdog could not start (not tried again there)
_START_LOCK = threading.Lock()


def watchdog() -> Watchdog | None:
    """This process's watchdog, started on first use (None, with one warning, where it cannot start)."""
    global _WATCHDOG, _FAILED_IN
    with _START_LOCK:
        if _WATCHDOG is not None and _WATCHDOG.alive():
            return _WATCHDOG
        if os.getpid() == _FAILED_IN:
            return None
        if _WATCHDOG is not None and _WATCHDOG.pid == os.getpid():
            logger.warning("the reward watchdog process exited; starting another")
        try:
            _WATCHDOG = Watchdog()
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            logger.warning(
                "cannot start the reward watchdog process (%s): a reward call stuck in C code would hang "
                "the run; reward.num_workers >= 1 scores in worker processes instead",
                exc,
            )
            _WATCHDOG, _FAILED_IN = None, os.getpid()
        return _WATCHDOG


@contextmanager
def watch(name: str, fix: str, timeout_s: float, count: int, unit: str = "") -> Iterator[Slot]:
    """A slot of this process's watchdog for ``count`` calls (an unwatched one where none could start)."""
    dog = watchdog()
    if dog is None:
        yield Slot(None, 0)
        return
    with dog.slot(name, fix, timeout_s, count, unit) as slot:
        yield slot
