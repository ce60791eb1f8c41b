"""The other ranks of a torchrun-style run: who they are, and the report when one of them fails.

When a rank dies (killed, out of memory, its own error), every other rank finds out inside a collective,
which raises an error of the communication library (gloo's "Connection closed by peer", NCCL's aborted
communicator, a timeout). That is not a bug of the surviving rank: ``peer_failure`` turns it into one line
naming the rank that died when it can tell (ranks on this host whose process is gone, from the table
``record_peers`` keeps at start), the collective that broke and the code that called it, and where to look.
A rank that stops with a user error it alone hit (out of device memory in a phase) leaves its message in
the group's store first (``post_user_error``): the others then raise that message (``posted_user_error``).
"""

from __future__ import annotations

import logging
import os
import re
import socket
import traceback
from pathlib import Path

import torch.distributed as dist

logger = logging.getLogger(__name__)

# (host, pid) of every rank of the default group, by rank; gathered once when the group starts.
_PEERS: list[tuple[str, int]] = []
# What gloo and NCCL say when the other side of a collective went away or stopped answering.
_BROKEN = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "connection refused",
    "remote process exited",
    "communicator was aborted",
    "nccl error",
    "ncclremoteerror",
)
_TIMED_OUT = ("timed out waiting", "collective operation timeout", "before timing out")
_COLLECTIVES = {
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
}


def record_peers() -> None:
    """Every rank of the default group: remember each rank's host and process id (one small collective)."""
    global _PEERS
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    table: list[tuple[str, int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(table, (socket.gethostname(), os.getpid()))
    _PEERS = [entry for entry in table if entry is not None]


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (a zombie, dead but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc (macOS): it answered the signal


def dead_peers() -> list[tuple[int, int]]:
    """``(rank, pid)`` of the ranks on this host whose process is gone."""
    host, me = socket.gethostname(), os.getpid()
    return [(r, pid) for r, (h, pid) in enumerate(_PEERS) if h == host and pid != me and not _alive(pid)]


def _chain(exc: BaseException) -> list[BaseException]:
    seen, out = set(), []
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def _broken(exc: BaseException) -> tuple[BaseException, bool] | None:
    """The error of a broken collective in ``exc``'s chain and whether it is a timeout, or None."""
    dist_error = getattr(dist, "DistError", ())
    for err in _chain(exc):
        text = str(err).lower()
        if any(s in text for s in _BROKEN):
            return err, False
        if any(s in text for s in _TIMED_OUT) or isinstance(err, dist_error):
            return err, any(s in text for s in _TIMED_OUT)
    return None


def _where(exc: BaseException) -> str:
    """'the collective all_to_all_single, called from hybridflow/engine/...py:86 (_bucket)'."""
    for err in _chain(exc):
        frames = traceback.extract_tb(err.__traceback__)
        for i, frame in enumerate(frames):
            if (
                "torch/distributed" not in frame.filename.replace(os.sep, "/")
                or frame.name not in _COLLECTIVES
            ):
                continue
            ours = [f for f in frames[:i] if "/hybridflow/" in f.filename.replace(os.sep, "/")]
            if not ours:
                return f"the collective {frame.name}"
            path = ours[-1].filename.replace(os.sep, "/")
            path = path[path.rindex("/hybridflow/") + 1 :]
            return f"the collective {frame.name}, called from {path}:{ours[-1].lineno} ({ours[-1].name}),"
    return "a collective"


def peer_failure(exc: BaseException) -> str | None:
    """One line saying a peer rank failed, when ``exc`` is a collective broken by it; None otherwise."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    found = _broken(exc)
    if found is None:
        return None
    err, timed_out = found
    me = f"rank {dist.get_rank()} of {dist.get_world_size()}"
    detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    detail = re.sub(r"^\[[^\]]*:\d+\] ", "", detail).split(". ")[0][:300]  # without gloo's source line
    where = _where(exc)
    dead = dead_peers()
    if dead:
        who = " and ".join(f"rank {r} (pid {pid})" for r, pid in dead)
        what = f"{who} has exited or was killed: {where} broke ({detail})"
    elif timed_out:
        what = f"a peer rank stopped answering: {where} timed out after trainer.nccl_timeout ({detail})"
    else:
        what = f"a peer rank failed or died: {where} broke ({detail})"
    return (
        f"{me} stops because {what}. Look at the other ranks' output for the first error (a rank that "
        "printed none was killed from outside, e.g. out of memory: see dmesg or the launcher's log)"
    )


# Where a rank that stops with a user error leaves its message for the others (the default group's store).
_POSTED = "hybridflow/user_error"


def _store() -> dist.Store | None:
    """The default group's key-value store (the rendezvous's), or None outside a multi-rank world."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def post_user_error(message: str) -> None:
    """Leave this rank's user error for the other ranks: they are, or soon will be, waiting for this rank in
    a collective that breaks when it exits, and then raise the same message (``posted_user_error``).

    The message lives in the default group's store: torchrun's agent holds it, so it outlives any rank.
    Started without torchrun (``MASTER_ADDR``/``MASTER_PORT`` by hand) rank 0 holds the store, and when rank
    0 is the one that stops, the others find the store gone and report the broken collective instead.
    """
    store = _store()
    if store is None:
        return
    try:
        store.set(_POSTED, message)
    except RuntimeError:  # the store is gone (its host rank died): the others report the broken collective
        logger.debug("could not leave the error for the other ranks", exc_info=True)


def posted_user_error(exc: BaseException) -> str | None:
    """The user error another rank left (``post_user_error``) when ``exc`` is the collective its stop broke;
    None otherwise."""
    store = _store()
    if store is None or _broken(exc) is None:
        return None
    try:
        if not store.check([_POSTED]):
            return None
        message = store.get(_POSTED).decode()
    except RuntimeError:  # the store went with the rank that hosted it
        return None
    return message
