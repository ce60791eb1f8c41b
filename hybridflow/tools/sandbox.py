"""The ``code_interpreter`` tool: Python source run in a limited subprocess, every outcome returned as text.

Each run gets a fresh interpreter (``sys.executable -I``: no user site, no PYTHON* variables), a new
session (its process group is killed on timeout or when its output passes the cap), a fresh scratch
directory as its working directory (deleted afterwards), a minimal environment, and, set by its preamble
before the user's code runs: RLIMIT_AS (memory), RLIMIT_CPU, RLIMIT_FSIZE and no core files, with the hard
limits lowered so the code cannot raise them again, and an audit hook (``sys.addaudithook``; a hook cannot
be removed) that refuses sockets' connect/bind/getaddrinfo/sendto and starting processes.

The limits are set by the child's preamble rather than in ``preexec_fn``: ``preexec_fn`` runs Python between
fork and exec, which can deadlock in a multi-threaded parent such as the trainer (the subprocess docs warn
of it); limits set first thing in the child bind the user's code just the same.

This is a guard against accidents and a model's clumsy code, not a security boundary: there is no seccomp
filter and no namespace, so ``ctypes`` calling libc directly, or a bug in CPython, gets around the hook
(docs/tools.md). Run untrusted code from people in a container or a VM.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from hybridflow.tools.registry import Tool

logger = logging.getLogger(__name__)

NETWORK_BLOCKED = "network access is disabled in this sandbox"
PROCESS_BLOCKED = "starting processes is disabled in this sandbox"
_READ_CHUNK = 16 * 1024

# Runs in the child before the user's code: argv = [memory bytes, cpu seconds, file bytes, allow processes].
_PREAMBLE = r"""
import resource, sys
def _limit(which, value):
    if value > 0:
        resource.setrlimit(which, (value, value))
_limit(resource.RLIMIT_AS, int(sys.argv[1]))
_limit(resource.RLIMIT_CPU, int(sys.argv[2]))
_limit(resource.RLIMIT_FSIZE, int(sys.argv[3]))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
_NET = {"socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto", "socket.sendmsg"}
_PROC = {"os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "subprocess.Popen"}
_allow_proc = sys.argv[4] == "1"
def _hook(event, args):
    if event in _NET:
        raise PermissionError("%s (%s)" % (NETWORK_BLOCKED, event))
    if event in _PROC and not _allow_proc:
        raise PermissionError("%s (%s)" % (PROCESS_BLOCKED, event))
sys.addaudithook(_hook)
del _limit, _hook, resource
sys.argv = ["main.py"]
sys.stdout.reconfigure(errors="backslashreplace")
sys.stderr.reconfigure(errors="backslashreplace")
with open("main.py", encoding="utf-8") as _f:
    _code = compile(_f.read(), "main.py", "exec")
del _f
import traceback as _tb
try:
    exec(_code, {"__name__": "__main__", "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException as _e:
    # Skip this preamble's frame: the model should see its own code's traceback only.
    _tb.print_exception(type(_e), _e, _e.__traceback__.tb_next)
    sys.exit(1)
"""


@dataclass(frozen=True)
class SandboxLimits:
    """Limits of one run; 0 turns a limit off."""

    timeout_s: float = 10.0  # wall clock; the process group is killed at expiry
    memory_bytes: int = 1 << 30  # RLIMIT_AS: address space, so allow for the interpreter's own (~30 MB)
    cpu_s: int = 0  # RLIMIT_CPU; 0: the timeout rounded up, plus one second
    file_bytes: int = 64 << 20  # RLIMIT_FSIZE: the largest file the code may write
    max_output_bytes: int = 64 * 1024  # of stdout and of stderr; past it the run is killed
    allow_processes: bool = False  # subprocesses would escape the audit hook (and so the network ban)


@dataclass(frozen=True)
class SandboxResult:
    """The outcome of a run: status, exit code, output (capped), seconds and whether output was cut."""

    status: str  # ok | error | timeout | memory | cpu | network | process | killed | truncated
    exit_code: int | None
    stdout: str
    stderr: str
    seconds: float
    truncated: bool = False

    def to_text(self) -> str:
        """The result as the model sees it: a short status line, then stdout, then stderr."""
        parts = [f"[{self.status}: {self._detail()}, {self.seconds:.2f} s]"]
        if self.stdout:
            parts.append(self.stdout.rstrip("\n"))
        if self.stderr:
            parts.append("[stderr]\n" + self.stderr.rstrip("\n"))
        if self.truncated:
            parts.append("[output truncated]")
        return "\n".join(parts)

    def _detail(self) -> str:
        code = self.exit_code
        if self.status == "timeout":
            return "wall-clock limit reached, process killed"
        if self.status == "truncated":
            return "output limit reached, process killed"
        if code is not None and code < 0:
            return (
                f"killed by signal {signal.Signals(-code).name if -code in signal.valid_signals() else -code}"
            )
        return f"exit status {code}"


def _command(limits: SandboxLimits) -> list[str]:
    cpu = limits.cpu_s or int(limits.timeout_s) + 2
    args = [limits.memory_bytes, cpu, limits.file_bytes, int(limits.allow_processes)]
    preamble = _PREAMBLE.replace("NETWORK_BLOCKED", repr(NETWORK_BLOCKED))
    preamble = preamble.replace("PROCESS_BLOCKED", repr(PROCESS_BLOCKED))
    return [sys.executable, "-I", "-c", preamble, *map(str, args)]


def _environment(scratch: str) -> dict[str, str]:
    """A minimal environment: no credentials or proxies of the trainer leak into the code's process."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": scratch, "TMPDIR": scratch}
    # One thread per math library: RLIMIT_AS counts every thread's stack.
    env |= {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(proc.pid, signal.SIGKILL)


def _collect(proc: subprocess.Popen, limits: SandboxLimits) -> tuple[bytes, bytes, str | None]:
    """Read stdout and stderr up to the cap until exit; kill on timeout or overflow (the reason, or None)."""
    deadline = time.monotonic() + limits.timeout_s
    buffers = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    with selectors.DefaultSelector() as sel:
        for stream in buffers:
            sel.register(stream, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                _kill_group(proc)
                return bytes(buffers[proc.stdout]), bytes(buffers[proc.stderr]), "timeout"
            for key, _ in sel.select(timeout=min(left, 0.5)):
                chunk = os.read(key.fd, _READ_CHUNK)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                buf = buffers[key.fileobj]
                buf += chunk
                if len(buf) > limits.max_output_bytes:
                    del buf[limits.max_output_bytes :]
                    _kill_group(proc)
                    return bytes(buffers[proc.stdout]), bytes(buffers[proc.stderr]), "truncated"
    # Both pipes closed: the process has exited, or is about to; a grandchild holding them is not possible
    # when processes are refused, and is killed with the group otherwise.
    try:
        proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return bytes(buffers[proc.stdout]), bytes(buffers[proc.stderr]), "timeout"
    return bytes(buffers[proc.stdout]), bytes(buffers[proc.stderr]), None


def _status(code: int | None, stderr: str, stopped: str | None) -> str:
    """The run's status from how it stopped, its exit code and its stderr."""
    if stopped:
        return stopped
    if code == 0:
        return "ok"
    if code == -signal.SIGXCPU or code == -signal.SIGKILL:
        return "cpu" if code == -signal.SIGXCPU else "killed"
    if NETWORK_BLOCKED in stderr:
        return "network"
    if PROCESS_BLOCKED in stderr:
        return "process"
    if "MemoryError" in stderr or code == -signal.SIGSEGV:
        return "memory"  # a segfault under RLIMIT_AS is almost always a failed allocation in C
    return "error"


def run_python(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run ``code`` in a limited subprocess and return what happened (never raises for the code's faults)."""
    limits = limits or SandboxLimits()
    start = time.monotonic()
    scratch = tempfile.mkdtemp(prefix="hybridflow-sandbox-")
    try:
        with open(os.path.join(scratch, "main.py"), "w", encoding="utf-8") as f:
            f.write(code)
        proc = subprocess.Popen(
            _command(limits), cwd=scratch, env=_environment(scratch), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, close_fds=True,
        )  # fmt: skip
        try:
            out, err, stopped = _collect(proc, limits)
        finally:
            _kill_group(proc)  # anything the code left behind in its group
            proc.wait()
            proc.stdout.close()  # type: ignore[union-attr]
            proc.stderr.close()  # type: ignore[union-attr]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    stdout = out.decode("utf-8", errors="replace")
    stderr = err.decode("utf-8", errors="replace")
    code_ = None if stopped == "timeout" else proc.returncode
    status = _status(code_, stderr, stopped)
    seconds = time.monotonic() - start
    logger.debug("sandbox run: %s (exit %s) in %.2f s", status, code_, seconds)
    return SandboxResult(status, code_, stdout, stderr, seconds, truncated=stopped == "truncated")


def code_interpreter_tool(limits: SandboxLimits | None = None) -> Tool:
    """The ``code_interpreter`` Tool: runs Python source, returns the status line and its output."""
    limits = limits or SandboxLimits()

    def code_interpreter(code: str) -> str:
        return run_python(code, limits).to_text()

    return Tool(
        name="code_interpreter",
        description="Run Python code and return what it prints (stdout and stderr). No network access.",
        parameters={
            "type": "object",
            "properties": {"code": {"type": "string", "description": "Python source to run"}},
            "required": ["code"],
            "additionalProperties": False,
        },
        function=code_interpreter,
        # The sandbox enforces its own wall clock; the thread waits a little past it for the cleanup.
        timeout_s=limits.timeout_s + 5.0,
    )
