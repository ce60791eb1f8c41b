"""Helpers of the sandbox tests: the isolated-only mark, a loopback listener, and the processes left behind."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator

import psutil
import pytest

from hybridflow.tools.isolation import probe

# CI installs bubblewrap and sets this: there a host that cannot isolate fails these tests instead of
# skipping them.
REQUIRED = os.environ.get("HYBRIDFLOW_REQUIRE_SANDBOX") == "1"
_ISOLATION = probe()
isolated_only = pytest.mark.skipif(
    not _ISOLATION.available and not REQUIRED, reason=f"no isolation on this host: {_ISOLATION.problem}"
)


@contextlib.contextmanager
def listener() -> Iterator[tuple[int, list[str]]]:
    """A TCP server on the host's 127.0.0.1 recording every connection it accepts (port, accepted peers)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.settimeout(0.05)
    accepted: list[str] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, peer = server.accept()
            except (TimeoutError, OSError):
                continue
            accepted.append(f"{peer[0]}:{peer[1]}")
            conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()[1], accepted
    finally:
        stop.set()
        thread.join()
        server.close()


def named(marker: str) -> list[psutil.Process]:
    """Live processes whose name or command line holds ``marker`` (what a payload left running)."""
    found = []
    for proc in psutil.process_iter(["name", "cmdline", "status"]):
        with contextlib.suppress(psutil.Error):
            text = " ".join([proc.info["name"] or "", *(proc.info["cmdline"] or [])])
            if marker in text and proc.info["status"] != psutil.STATUS_ZOMBIE and proc.pid != os.getpid():
                found.append(proc)
    return found
