"""The code-interpreter sandbox: limits hold, and every failure comes back as text with a status line.

Each behaviour runs isolated (bubblewrap, the default) and, where it is the in-process guard's to keep, also
unisolated (``isolated=False``, what ``allow_unisolated`` falls back to). The attacks on the isolation itself
are in test_tool_isolation.py.
"""

from __future__ import annotations

import os
import resource
import socket
import time

import pytest
from support.sandbox_util import isolated_only, listener

from hybridflow.tools import SandboxLimits, ToolCall, ToolSet, code_interpreter_tool, run_python

FAST = SandboxLimits(timeout_s=2.0)
MODES = [pytest.param(True, id="isolated", marks=isolated_only), pytest.param(False, id="unisolated")]


@pytest.mark.parametrize("isolated", MODES)
def test_normal_code_returns_its_stdout(isolated: bool) -> None:
    result = run_python("print(sum(range(10)))\nprint('done')", FAST, isolated=isolated)
    assert result.status == "ok" and result.exit_code == 0
    assert result.stdout == "45\ndone\n" and result.stderr == ""
    assert result.to_text().splitlines()[1:] == ["45", "done"]


@pytest.mark.parametrize("isolated", MODES)
def test_a_hang_is_killed_at_the_timeout(isolated: bool) -> None:
    start = time.monotonic()
    code = "import time\nprint('start', flush=True)\nwhile True: time.sleep(0.01)"
    result = run_python(code, FAST, isolated=isolated)
    assert 2.0 <= time.monotonic() - start < 5
    assert result.status == "timeout" and result.stdout == "start\n"
    assert result.to_text().startswith("[timeout: wall-clock limit reached, process killed")


@pytest.mark.parametrize("isolated", MODES)
def test_crashes_report_the_exit_status(isolated: bool) -> None:
    exited = run_python("raise SystemExit(3)", FAST, isolated=isolated)
    assert exited.status == "error" and exited.exit_code == 3 and "exit status 3" in exited.to_text()
    raised = run_python("def f():\n    raise KeyError('k')\nf()", FAST, isolated=isolated)
    assert raised.status == "error" and raised.exit_code == 1
    assert (
        raised.stderr.splitlines()[-1] == "KeyError: 'k'" and 'File "main.py", line 2, in f' in raised.stderr
    )
    assert "<string>" not in raised.stderr  # the preamble's frame is not shown
    killed = run_python("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", FAST, isolated=isolated)
    assert (
        killed.status == "killed"
        and killed.exit_code == -9
        and "killed by signal SIGKILL" in killed.to_text()
    )


@pytest.mark.parametrize("isolated", MODES)
def test_printing_10mb_is_truncated_and_contained(isolated: bool) -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    result = run_python("import sys\nsys.stdout.write('x' * 10_000_000)", FAST, isolated=isolated)
    assert time.monotonic() - start < 2
    assert result.status == "truncated" and result.truncated
    assert len(result.stdout) == FAST.max_output_bytes
    assert result.to_text().endswith("[output truncated]")
    # The parent read at most the cap (ru_maxrss is in KiB on Linux): no 10 MB buffer here.
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 8 * 1024


@pytest.mark.parametrize("isolated", MODES)
def test_network_is_blocked_and_reported(isolated: bool) -> None:
    with listener() as (port, accepted):
        code = f'import socket\nsocket.create_connection(("127.0.0.1", {port}), timeout=1)'
        result = run_python(code, FAST, isolated=isolated)
    assert result.status == "network" and "network access is disabled" in result.stderr
    assert result.to_text().startswith("[network: exit status 1") and accepted == []


@pytest.mark.parametrize("isolated", MODES)
def test_starting_processes_is_blocked(isolated: bool) -> None:
    result = run_python("import os\nos.system('echo hi')", FAST, isolated=isolated)
    assert result.status == "process" and "hi" not in result.stdout


@pytest.mark.parametrize("isolated", MODES)
def test_the_guard_cannot_be_switched_off_from_python(isolated: bool) -> None:
    """The audit hook's state lives in the hook (defaults), not in globals the code reaches through
    ``__main__``; the hook cannot be found through ``gc`` or have its defaults rewritten."""
    with listener() as (port, accepted):
        code = (
            "import __main__, os, socket\n__main__._PROC = set(); __main__._NET = set()\n"
            f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "except PermissionError as e:\n    print('net', e)\nos.system('echo escaped')"
        )
        result = run_python(code, FAST, isolated=isolated)
    assert result.status == "process" and "escaped" not in result.stdout and accepted == []
    assert result.stdout.startswith("net network access is disabled")
    found = run_python("import gc\nprint(len(gc.get_objects()))", FAST, isolated=isolated)
    assert found.status == "error" and "introspection is disabled" in found.stderr


@pytest.mark.parametrize("isolated", MODES)
def test_a_memory_bomb_is_contained(isolated: bool) -> None:
    limits = SandboxLimits(timeout_s=5.0, memory_bytes=256 << 20)
    for code in ("x = bytearray(2 << 30)", "x = []\nwhile True: x.append(' ' * 10_000_000)"):
        start = time.monotonic()
        result = run_python(code, limits, isolated=isolated)
        assert time.monotonic() - start < 5
        assert result.status == "memory" and "MemoryError" in result.stderr, result


@isolated_only
def test_the_scratch_dir_is_a_fresh_tmpfs_each_run() -> None:
    code = "import os\nopen('f.txt', 'w').write('x')\nprint(os.getcwd())\nprint(sorted(os.listdir()))"
    result = run_python(code, FAST)
    assert result.stdout.splitlines() == ["/tmp", "['f.txt', 'main.py']"]
    again = run_python("import os\nprint(sorted(os.listdir()))", FAST)
    assert again.stdout == "['main.py']\n"  # nothing of the last run is left


def test_the_unisolated_scratch_dir_is_the_cwd_and_is_removed() -> None:
    code = "import os\nopen('f.txt', 'w').write('x')\nprint(os.getcwd())\nprint(sorted(os.listdir()))"
    result = run_python(code, FAST, isolated=False)
    cwd, listing = result.stdout.splitlines()
    assert "hybridflow-sandbox-" in cwd and listing == "['f.txt', 'main.py']"
    assert not os.path.exists(cwd)


@pytest.mark.parametrize("isolated", MODES)
def test_the_environment_is_minimal(isolated: bool) -> None:
    os.environ["HYBRIDFLOW_SECRET_FOR_TEST"] = "s3cret"
    try:
        result = run_python("import os\nprint(sorted(os.environ))", FAST, isolated=isolated)
    finally:
        del os.environ["HYBRIDFLOW_SECRET_FOR_TEST"]
    assert "HYBRIDFLOW_SECRET_FOR_TEST" not in result.stdout and "HOME" in result.stdout


@pytest.mark.parametrize("isolated", MODES)
def test_sources_that_are_not_utf8_or_huge_are_answered(isolated: bool) -> None:
    lone = run_python("print('\ud800')", FAST, isolated=isolated)  # a lone surrogate, as JSON can carry
    assert lone.status == "error" and "SyntaxError" in lone.stderr
    big = run_python("x = 1\n" * 200_000 + "print(x)", FAST, isolated=isolated)  # 1.2 MB: more than a pipe
    assert big.status == "ok" and big.stdout == "1\n"


@isolated_only
def test_code_interpreter_tool() -> None:
    tools = ToolSet([code_interpreter_tool(FAST)])
    assert tools.schemas()[0]["function"]["parameters"]["required"] == ["code"]
    result = tools.run(ToolCall("code_interpreter", {"code": "print(6*7)"}, ""))
    assert result.ok and result.text.startswith("[ok: exit status 0") and result.text.endswith("\n42")
    failed = tools.run(ToolCall("code_interpreter", {"code": "1/0"}, ""))
    assert failed.ok and "ZeroDivisionError" in failed.text  # the code's failure is text for the model


def test_listener_sees_a_connection() -> None:
    """The listener used above does see a connection from this process: its silence there means something."""
    with listener() as (port, accepted):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        deadline = time.monotonic() + 2
        while not accepted and time.monotonic() < deadline:
            time.sleep(0.01)
    assert len(accepted) == 1
