"""The code-interpreter sandbox: limits hold, and every failure comes back as text with a status line."""

from __future__ import annotations

import os
import resource
import time

from hybridflow.tools import SandboxLimits, ToolCall, ToolSet, code_interpreter_tool, run_python

FAST = SandboxLimits(timeout_s=2.0)


def test_normal_code_returns_its_stdout() -> None:
    result = run_python("print(sum(range(10)))\nprint('done')", FAST)
    assert result.status == "ok" and result.exit_code == 0
    assert result.stdout == "45\ndone\n" and result.stderr == ""
    assert result.to_text().splitlines()[1:] == ["45", "done"]


def test_a_hang_is_killed_at_the_timeout() -> None:
    start = time.monotonic()
    result = run_python("import time\nprint('start', flush=True)\nwhile True: time.sleep(0.01)", FAST)
    assert 2.0 <= time.monotonic() - start < 5
    assert result.status == "timeout" and result.stdout == "start\n"
    assert result.to_text().startswith("[timeout: wall-clock limit reached, process killed")


def test_crashes_report_the_exit_status() -> None:
    exited = run_python("raise SystemExit(3)", FAST)
    assert exited.status == "error" and exited.exit_code == 3 and "exit status 3" in exited.to_text()
    raised = run_python("def f():\n    raise KeyError('k')\nf()", FAST)
    assert raised.status == "error" and raised.exit_code == 1
    assert (
        raised.stderr.splitlines()[-1] == "KeyError: 'k'" and 'File "main.py", line 2, in f' in raised.stderr
    )
    assert "<string>" not in raised.stderr  # the preamble's frame is not shown


def test_printing_10mb_is_truncated_and_contained() -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.monotonic()
    result = run_python("import sys\nsys.stdout.write('x' * 10_000_000)", FAST)
    assert time.monotonic() - start < 2
    assert result.status == "truncated" and result.truncated
    assert len(result.stdout) == FAST.max_output_bytes
    assert result.to_text().endswith("[output truncated]")
    # The parent read at most the cap (ru_maxrss is in KiB on Linux): no 10 MB buffer here.
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 8 * 1024


def test_network_is_blocked_and_reported() -> None:
    result = run_python('import socket\nsocket.create_connection(("1.1.1.1", 80), timeout=1)', FAST)
    assert result.status == "network" and "network access is disabled" in result.stderr
    assert result.to_text().startswith("[network: exit status 1")


def test_starting_processes_is_blocked() -> None:
    result = run_python("import os\nos.system('echo hi')", FAST)
    assert result.status == "process" and "hi" not in result.stdout


def test_a_memory_bomb_is_contained() -> None:
    limits = SandboxLimits(timeout_s=5.0, memory_bytes=256 << 20)
    for code in ("x = bytearray(2 << 30)", "x = []\nwhile True: x.append(' ' * 10_000_000)"):
        start = time.monotonic()
        result = run_python(code, limits)
        assert time.monotonic() - start < 5
        assert result.status == "memory" and "MemoryError" in result.stderr, result


def test_the_scratch_dir_is_the_cwd_and_is_removed() -> None:
    code = "import os\nopen('f.txt', 'w').write('x')\nprint(os.getcwd())\nprint(sorted(os.listdir()))"
    result = run_python(code, FAST)
    cwd, listing = result.stdout.splitlines()
    assert "hybridflow-sandbox-" in cwd and listing == "['f.txt', 'main.py']"
    assert not os.path.exists(cwd)


def test_the_environment_is_minimal() -> None:
    os.environ["HYBRIDFLOW_SECRET_FOR_TEST"] = "s3cret"
    try:
        result = run_python("import os\nprint(sorted(os.environ))", FAST)
    finally:
        del os.environ["HYBRIDFLOW_SECRET_FOR_TEST"]
    assert "HYBRIDFLOW_SECRET_FOR_TEST" not in result.stdout and "HOME" in result.stdout


def test_code_interpreter_tool() -> None:
    tools = ToolSet([code_interpreter_tool(FAST)])
    assert tools.schemas()[0]["function"]["parameters"]["required"] == ["code"]
    result = tools.run(ToolCall("code_interpreter", {"code": "print(6*7)"}, ""))
    assert result.ok and result.text.startswith("[ok: exit status 0") and result.text.endswith("\n42")
    failed = tools.run(ToolCall("code_interpreter", {"code": "1/0"}, ""))
    assert failed.ok and "ZeroDivisionError" in failed.text  # the code's failure is text for the model
