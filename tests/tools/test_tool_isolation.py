"""The sandbox's isolation by the operating system, attacked as a policy's code would: the trainer's processes
and files, the network, processes that try to outlive their call; and a host that cannot isolate.

Each payload is one of issue 59's cases (the in-process guard alone let them through)."""

from __future__ import annotations

import logging
import os
import stat
import time
from pathlib import Path

import pytest
from support.sandbox_util import isolated_only, listener, named

from hybridflow.tools import SandboxLimits, code_interpreter_tool, run_python, sandbox
from hybridflow.tools import isolation as iso
from hybridflow.utils.errors import UserError

FAST = SandboxLimits(timeout_s=3.0)
# A process that leaves its session and its parent, named so that it can be found afterwards (ctypes calls
# libc directly: the audit hook never sees it, only the operating system can stop it).
ESCAPE = """
import ctypes, time
libc = ctypes.CDLL(None)
if libc.fork() == 0:
    libc.setsid()
    if libc.fork() == 0:
        libc.prctl(15, b"{marker}")  # PR_SET_NAME
        time.sleep({sleep})
    libc._exit(0)
print("left a child behind", flush=True)
{after}
"""


@isolated_only
def test_the_trainer_cannot_be_seen_or_signalled() -> None:
    me = os.getpid()
    code = (
        "import os, signal\nprint(os.getppid(), sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
        f"for pid, sig in ((os.getppid(), 9), (os.getppid(), signal.SIGSTOP), ({me}, 9), ({me}, signal.SIGSTOP)):\n"
        "    try:\n        os.kill(pid, sig)\n        print('sent', pid)\n"
        "    except OSError as e:\n        print(type(e).__name__)\n"
    )
    result = run_python(code, FAST)
    first, *answers = result.stdout.splitlines()
    parent, pids = first.split(" ", 1)
    assert parent == "1" and len(eval(pids)) <= 3  # its parent is the namespace's init; it sees its own alone
    assert "sent" not in result.stdout and len(answers) == 4, result.stdout
    state = Path(f"/proc/{me}/stat").read_text().rsplit(")", 1)[1].split()[0]
    assert state not in ("T", "t")  # this process is neither killed nor stopped


@isolated_only
def test_files_of_the_host_are_out_of_reach(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "global_step_1").mkdir(parents=True)
    (run / "global_step_1" / "model.pt").write_bytes(b"weights")
    home = os.path.expanduser("~")
    code = f"""
import os, shutil
print(open('/etc/passwd').read().strip())
for path in ({str(run)!r}, '/work', '/var', '/home', os.path.dirname({str(tmp_path)!r}), '/root/.bashrc'):
    print(path, os.path.exists(path))
print(sorted(os.listdir({home!r})) if os.path.isdir({home!r}) else [])
for attempt in (lambda: shutil.rmtree({str(run / "global_step_1")!r}),
                lambda: open({str(tmp_path / "pwned")!r}, 'w'),
                lambda: open('/usr/pwned', 'w'),
                lambda: open('/etc/pwned', 'w')):
    try:
        attempt()
        print('done')
    except OSError as e:
        print(type(e).__name__)
print(os.getuid() != 0)
"""
    result = run_python(code, FAST)
    lines = result.stdout.splitlines()
    assert lines[0].startswith("sandbox:x:") and "root:" not in lines[0], result.stdout
    assert all(line.endswith(" False") for line in lines[1:7]), lines  # none of those paths exist there
    # $HOME holds at most the way to the Python installation (when Python lives there), nothing else of it
    python_dirs = {
        Path(os.path.relpath(r, home)).parts[0] for r in iso.python_roots() if r.startswith(home + "/")
    }
    assert set(eval(lines[7])) <= python_dirs, (lines[7], python_dirs)
    assert "done" not in lines[8:12] and lines[12] == "True", lines
    assert (run / "global_step_1" / "model.pt").read_bytes() == b"weights"
    assert not (tmp_path / "pwned").exists() and not Path("/usr/pwned").exists()


@isolated_only
def test_nothing_reaches_the_network_even_past_the_guard() -> None:
    """With processes allowed and the socket made through libc (no audit event), the host's loopback is still
    out of reach: the run has a network namespace of its own."""
    with listener() as (port, accepted):
        code = f"""
import ctypes, socket, struct
libc = ctypes.CDLL(None)
fd = libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)
addr = struct.pack("<HH4s8x", socket.AF_INET, socket.htons({port}), socket.inet_aton("127.0.0.1"))
print("connect", libc.connect(fd, addr, len(addr)))
import os
os.system("echo shell ran")
"""
        result = run_python(code, SandboxLimits(timeout_s=3.0, allow_processes=True))
        time.sleep(0.2)
    assert "connect -1" in result.stdout and accepted == [], (result, accepted)


@isolated_only
@pytest.mark.parametrize("ending", ["returns", "times out"])
def test_no_process_outlives_its_call(ending: str) -> None:
    marker = f"hfleft{os.getpid() % 10000}{ending[0]}"
    after = "while True: pass" if ending == "times out" else ""
    result = run_python(ESCAPE.format(marker=marker, sleep=60, after=after), FAST)
    assert "left a child behind" in result.stdout
    assert result.status == ("timeout" if ending == "times out" else "ok"), result
    time.sleep(0.3)  # the kernel tears the namespace down as its init exits
    assert named(marker) == []


def test_an_unisolated_run_cannot_promise_that(tmp_path: Path) -> None:
    """The reason the OS layer exists: without it a process outlives its call (cleaned up here)."""
    marker = f"hfweak{os.getpid() % 10000}"
    result = run_python(ESCAPE.format(marker=marker, sleep=20, after=""), FAST, isolated=False)
    assert "left a child behind" in result.stdout
    time.sleep(0.3)
    left = named(marker)
    for proc in left:
        proc.kill()
    assert left, "the in-process guard alone stopped an escape: the docs' threat model is out of date"


@isolated_only
def test_a_fork_bomb_and_a_disk_fill_are_contained() -> None:
    limits = SandboxLimits(timeout_s=5.0, allow_processes=True, scratch_bytes=8 << 20)
    bomb = (
        "import os, time\ntry:\n    while True:\n        if os.fork() == 0:\n            time.sleep(10)\n"
        "            os._exit(0)\nexcept OSError as e:\n    print('refused', e.errno)"
    )
    start = time.monotonic()
    result = run_python(bomb, limits)
    assert time.monotonic() - start < 6 and "refused" in result.stdout, result
    fill = (
        "n = 0\ntry:\n    while True:\n        open(f'f{n}', 'wb').write(b'x' * (1 << 20))\n        n += 1\n"
        "except OSError as e:\n    print(n, e.errno)"
    )
    result = run_python(fill, limits)
    written, errno = map(int, result.stdout.split())
    assert written <= 8 and errno == 28, result  # ENOSPC at the tmpfs's size, not the host disk's


# --- a host that cannot isolate ---------------------------------------------------------------------------


def test_no_bwrap_refuses_with_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no bwrap
    with pytest.raises(UserError) as err:
        code_interpreter_tool(FAST)
    message = str(err.value)
    assert "\n" not in message and "bubblewrap (bwrap) is not installed" in message
    assert "apt-get install bubblewrap" in message and "allow_unisolated=true" in message
    with pytest.raises(UserError, match="bubblewrap"):
        run_python("print(1)", FAST)


def test_a_bwrap_that_cannot_make_namespaces_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to creating new namespace' >&2\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", str(tmp_path))
    found = iso.probe()
    assert not found.available and found.bwrap == str(fake)
    assert "No permissions to creating new namespace" in found.problem and "user namespaces" in found.problem
    with pytest.raises(UserError, match="cannot isolate a process here"):
        code_interpreter_tool(FAST)


def test_the_explicit_weaker_mode_warns_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sandbox, "_warned_unisolated", False)
    with caplog.at_level(logging.WARNING, logger="hybridflow.tools.sandbox"):
        tools = [code_interpreter_tool(FAST, allow_unisolated=True) for _ in range(2)]
    warnings = [r for r in caplog.records if "WITHOUT isolation" in r.getMessage()]
    assert len(warnings) == 1 and "allow_unisolated=true" in warnings[0].getMessage()
    assert tools[0].function(code="print(2 + 3)").endswith("\n5")


def test_a_run_by_root_switches_to_an_unused_uid_and_others_get_a_user_namespace() -> None:
    as_root = iso.wrap("/usr/bin/bwrap", 1 << 20, as_root=True)
    assert iso._UID_RANGE[0] <= as_root.uid < iso._UID_RANGE[1] and "--unshare-user" not in as_root.argv
    assert as_root.argv[as_root.argv.index("--cap-drop") + 1] == "ALL"
    other = iso.wrap("/usr/bin/bwrap", 1 << 20, as_root=False)
    assert other.uid == -1 and "--unshare-user" in other.argv and "--disable-userns" in other.argv
    for wrapped in (as_root, other):
        binds = {wrapped.argv[i + 2] for i, a in enumerate(wrapped.argv) if a in ("--bind", "--ro-bind")}
        assert not binds & {"/", "/root", "/home", "/work", "/var", os.getcwd()}  # an allow-list, read-only
        assert "--bind" not in wrapped.argv and "--unshare-net" in wrapped.argv


@isolated_only
def test_both_ways_of_dropping_privileges_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The user-namespace way (what a non-root user gets) also runs here, whoever runs the tests."""
    real = iso.wrap
    monkeypatch.setattr(sandbox, "wrap", lambda bwrap, size: real(bwrap, size, as_root=False))
    result = run_python("import os\nprint(os.getuid())", FAST)
    assert result.stdout == "65534\n", result
