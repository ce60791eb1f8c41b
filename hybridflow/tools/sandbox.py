"""The ``code_interpreter`` tool: Python source run in an isolated, limited process, every outcome returned as text.

The policy writes this code, thousands of times an hour, on the machine that holds the trainer: it is hostile
input. Two layers stand between it and the host:

1. **The operating system** (``tools/isolation.py``): each run is a bubblewrap sandbox with its own PID,
   network, mount, IPC and UTS namespaces, a read-only allow-list of the file system with a size-capped tmpfs
   as its working directory, and an unprivileged uid. It cannot see or signal the trainer, reach the network
   or read the run's files, and every process it starts dies with the run. Without bubblewrap (or without the
   namespaces it needs) the tool is refused at start, unless the user accepts the second layer alone
   (``allow_unisolated``), with one warning per process.
2. **The interpreter's preamble**, set before the code runs: rlimits with the hard limits lowered (address
   space, CPU, processes, file size, open files, no core files) and an audit hook (``sys.addaudithook``; a
   hook cannot be removed) refusing sockets and process starts. The hook's state is bound into it, not kept
   in module globals the code could reach, and the calls that could find it (``gc`` introspection, rewriting
   this hook's defaults or code) are refused. This layer alone is not a security boundary: ``ctypes``
   or ``_posixsubprocess`` get around it (docs/tools.md).

The code itself reaches the child on stdin (no file of the host is shared with it). The limits are set by the
preamble rather than in ``preexec_fn``: ``preexec_fn`` runs Python between fork and exec, which can deadlock in
a multi-threaded parent such as the trainer (the subprocess docs warn of it).
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
import threading
import time
from dataclasses import dataclass

from hybridflow.tools.isolation import WORKDIR, Isolation, probe, with_data_fds, wrap
from hybridflow.tools.registry import Tool
from hybridflow.utils.errors import UserError

logger = logging.getLogger(__name__)

NETWORK_BLOCKED = "network access is disabled in this sandbox"
PROCESS_BLOCKED = "starting processes is disabled in this sandbox"
INTROSPECTION_BLOCKED = "this introspection is disabled in this sandbox"
_READ_CHUNK = 16 * 1024

# Runs in the child before the user's code, whose source comes on stdin.
# argv = [memory bytes, cpu seconds, file bytes, processes, open files, allow processes, uid to switch to].
_PREAMBLE = r"""
import os, resource, sys
_code = sys.stdin.buffer.read()
_null = os.open(os.devnull, os.O_RDONLY)
os.dup2(_null, 0)
os.close(_null)
_memory, _cpu, _fsize, _nproc, _nofile, _allow_proc, _uid = map(int, sys.argv[1:8])
for _which, _value in ((resource.RLIMIT_AS, _memory), (resource.RLIMIT_CPU, _cpu),
                       (resource.RLIMIT_FSIZE, _fsize), (resource.RLIMIT_NPROC, _nproc),
                       (resource.RLIMIT_NOFILE, _nofile), (resource.RLIMIT_CORE, 0)):
    if _value > 0 or _which == resource.RLIMIT_CORE:
        resource.setrlimit(_which, (_value, _value))
if _uid >= 0:
    os.setgroups([])
    os.setresgid(_uid, _uid, _uid)
    os.setresuid(_uid, _uid, _uid)
def _install(net, proc, introspect, allow_proc):
    def hook(event, args, _net=net, _proc=proc, _introspect=introspect, _allow=allow_proc):
        if event in _net:
            raise PermissionError("%s (%s)" % (NETWORK_BLOCKED, event))
        if event in _proc and not _allow:
            raise PermissionError("%s (%s)" % (PROCESS_BLOCKED, event))
        if event in _introspect or (event == "object.__setattr__" and args and args[0] is hook):
            raise PermissionError("%s (%s)" % (INTROSPECTION_BLOCKED, event))
    sys.addaudithook(hook)
_install(
    frozenset({"socket.connect", "socket.bind", "socket.getaddrinfo", "socket.sendto", "socket.sendmsg"}),
    frozenset({"os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
               "subprocess.Popen"}),
    frozenset({"gc.get_objects", "gc.get_referrers", "gc.get_referents"}),
    _allow_proc == 1,
)
for _name in ("_install", "_memory", "_cpu", "_fsize", "_nproc", "_nofile", "_allow_proc", "_uid", "_which",
              "_value", "_null", "resource"):
    del globals()[_name]
sys.argv = ["main.py"]
sys.stdout.reconfigure(errors="backslashreplace")
sys.stderr.reconfigure(errors="backslashreplace")
with open("main.py", "wb") as _f:  # for the traceback's source lines
    _f.write(_code)
del _f
_code = compile(_code, "main.py", "exec")
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

    timeout_s: float = 10.0  # wall clock; the run (its whole PID namespace) is killed at expiry
    memory_bytes: int = 1 << 30  # RLIMIT_AS: address space, so allow for the interpreter's own (~30 MB)
    cpu_s: int = 0  # RLIMIT_CPU; 0: the timeout rounded up, plus two seconds
    file_bytes: int = 64 << 20  # RLIMIT_FSIZE: the largest file the code may write
    processes: int = 32  # RLIMIT_NPROC, threads included (isolated runs: counted for this run alone)
    open_files: int = 256  # RLIMIT_NOFILE
    scratch_bytes: int = 64 << 20  # the isolated run's tmpfs working directory, all files together
    max_output_bytes: int = 64 * 1024  # of stdout and of stderr; past it the run is killed
    allow_processes: bool = False  # the audit hook refuses process starts unless this is set


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


def _command(limits: SandboxLimits, uid: int, isolated: bool) -> list[str]:
    """The interpreter's argv: ``-I`` (no user site, no PYTHON* variables), the preamble and its arguments."""
    cpu = limits.cpu_s or int(limits.timeout_s) + 2
    # RLIMIT_NPROC counts every process of the uid: only an isolated run has a uid (or namespace) of its own.
    nproc = limits.processes if isolated else 0
    args = [limits.memory_bytes, cpu, limits.file_bytes, nproc, limits.open_files]
    args += [int(limits.allow_processes), uid]
    preamble = _PREAMBLE
    for name in ("NETWORK_BLOCKED", "PROCESS_BLOCKED", "INTROSPECTION_BLOCKED"):
        preamble = preamble.replace(name, repr(globals()[name]))
    return [sys.executable, "-I", "-c", preamble, *map(str, args)]


def _environment(home: str) -> dict[str, str]:
    """A minimal environment: no credentials or proxies of the trainer leak into the code's process."""
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": home, "TMPDIR": home}
    env["USER"] = env["LOGNAME"] = "sandbox"
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
    # Both pipes closed: the process has exited, or is about to. An isolated run's other processes die with
    # its PID namespace; an unisolated one's with its process group, unless they left it (docs/tools.md).
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


def _exit_code(returncode: int, isolated: bool) -> int:
    """The code's exit status, a signal as its negative number: bwrap reports a child killed by signal N as
    128 + N."""
    if isolated and returncode > 128 and (returncode - 128) in signal.valid_signals():
        return 128 - returncode
    return returncode


def _feed(stream: object, data: bytes) -> None:
    """Write the source to the child's stdin and close it (a thread: a large source fills the pipe)."""
    with contextlib.suppress(OSError):  # the child died before reading it: its exit status tells why
        stream.write(data)  # type: ignore[attr-defined]
    with contextlib.suppress(OSError):
        stream.close()  # type: ignore[attr-defined]


def _start(code: str, limits: SandboxLimits, isolation: Isolation | None, scratch: str) -> subprocess.Popen:
    """Start the run: inside bubblewrap when ``isolation`` is given, else in ``scratch`` on the host."""
    fds: list[int] = []
    if isolation is not None:
        assert isolation.bwrap is not None
        wrapped = wrap(isolation.bwrap, limits.scratch_bytes)
        outer, fds = with_data_fds(wrapped)
        argv, home = outer + _command(limits, wrapped.uid, True), WORKDIR
    else:
        argv, home = _command(limits, -1, False), scratch
    try:
        proc = subprocess.Popen(
            argv, cwd=scratch, env=_environment(home), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, start_new_session=True, close_fds=True, pass_fds=fds,
        )  # fmt: skip
    finally:
        for fd in fds:
            os.close(fd)
    source = code.encode("utf-8", "surrogatepass")  # a lone surrogate from JSON: the child's SyntaxError
    threading.Thread(target=_feed, args=(proc.stdin, source), daemon=True).start()
    return proc


def run_python(code: str, limits: SandboxLimits | None = None, isolated: bool = True) -> SandboxResult:
    """Run ``code`` in a limited subprocess, isolated by the operating system unless ``isolated=False``, and
    return what happened (never raises for the code's faults; UserError when isolation is asked for and
    this host cannot give it)."""
    limits = limits or SandboxLimits()
    isolation = require_isolation() if isolated else None
    start = time.monotonic()
    scratch = tempfile.mkdtemp(prefix="hybridflow-sandbox-")  # the host side's cwd (and the unisolated run's)
    try:
        proc = _start(code, limits, isolation, scratch)
        try:
            out, err, stopped = _collect(proc, limits)
        finally:
            _kill_group(proc)  # anything left in its group (an isolated run's namespace dies with bwrap)
            proc.wait()
            proc.stdout.close()  # type: ignore[union-attr]
            proc.stderr.close()  # type: ignore[union-attr]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    stdout = out.decode("utf-8", errors="replace")
    stderr = err.decode("utf-8", errors="replace")
    code_ = None if stopped == "timeout" else _exit_code(proc.returncode, isolation is not None)
    status = _status(code_, stderr, stopped)
    seconds = time.monotonic() - start
    logger.debug("sandbox run: %s (exit %s) in %.2f s", status, code_, seconds)
    return SandboxResult(status, code_, stdout, stderr, seconds, truncated=stopped == "truncated")


UNISOLATED_KEY = "rollout.multi_turn.sandbox.allow_unisolated"


def require_isolation() -> Isolation:
    """This host's isolation, or a UserError naming what is missing, how to get it, and the weaker choice."""
    isolation = probe()
    if not isolation.available:
        raise UserError(
            f"code_interpreter runs the policy's code isolated by the operating system, and this host cannot: "
            f"{isolation.problem}. Or set {UNISOLATED_KEY}=true to run it under the in-process guard alone "
            "(rlimits and an audit hook: not a security boundary, docs/tools.md)"
        )
    return isolation


_warned_unisolated = False


def _warn_unisolated(problem: str) -> None:
    """One warning per process that the code runs without isolation."""
    global _warned_unisolated
    if not _warned_unisolated:
        _warned_unisolated = True
        logger.warning(
            "code_interpreter runs the policy's code WITHOUT isolation by the operating system (%s=true; %s): "
            "only rlimits and an audit hook guard the host, and code can get around them (docs/tools.md)",
            UNISOLATED_KEY, problem,
        )  # fmt: skip


def code_interpreter_tool(limits: SandboxLimits | None = None, allow_unisolated: bool = False) -> Tool:
    """The ``code_interpreter`` Tool: runs Python source isolated, returns the status line and its output.

    Checks the host's isolation now (a UserError when it has none, unless ``allow_unisolated``, which then
    warns once and uses the in-process guard alone)."""
    limits = limits or SandboxLimits()
    isolation = probe()
    isolated = isolation.available
    if not isolated:
        if not allow_unisolated:
            require_isolation()
        _warn_unisolated(isolation.problem)

    def code_interpreter(code: str) -> str:
        return run_python(code, limits, isolated=isolated).to_text()

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
        # The sandbox enforces the wall clock itself; the thread waits a little past it for the cleanup.
        timeout_s=limits.timeout_s + 5.0,
    )
