"""One run per run directory: a second run is refused naming the first; a dead run's lock is taken over.

Issue 59: two runs in one trainer.default_local_dir both started; the second overwrote config.yaml, failed
with a misleading error, and the first's metrics.jsonl lost lines.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hybridflow.models import build_tiny_model_and_tokenizer
from hybridflow.utils.dirlock import LOCK_FILE, RunDirInUse, lock_run_dir

REPO = Path(__file__).resolve().parents[2]
HOLD = textwrap.dedent(
    """
    import os, sys, time
    from hybridflow.utils.dirlock import lock_run_dir
    lock = lock_run_dir(sys.argv[1])
    if sys.argv[2] == "fork":  # a child started by fork (a reward worker, a data loader) outlives the run
        if os.fork() == 0:  # the child runs once its at-fork hooks have run
            print(os.getpid(), flush=True)
            time.sleep(120)
            os._exit(0)
        os._exit(0)  # the run dies without releasing
    print("locked", flush=True)
    sys.stdin.read()  # held until the test closes stdin (or kills this process)
    """
)


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _holder(run_dir: Path, mode: str = "hold") -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(run_dir), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    return proc


def _wait_for_record(run_dir: Path, pid: int) -> dict:
    for _ in range(600):
        text = (run_dir / LOCK_FILE).read_text() if (run_dir / LOCK_FILE).exists() else ""
        if text.strip() and json.loads(text)["pid"] == pid:
            return json.loads(text)
        time.sleep(0.05)
    raise AssertionError(f"pid {pid} never wrote its lock record")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny"
    build_tiny_model_and_tokenizer(out_dir=path, hidden_size=32, num_hidden_layers=1)
    return path


def test_a_second_run_in_a_locked_directory_exits_2_naming_the_first(model_dir: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("the first run's config\n")
    (run_dir / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    first = _holder(run_dir)  # a live process holding the directory, as a running run does
    try:
        assert first.stdout.readline().strip() == "locked"
        record = _wait_for_record(run_dir, first.pid)
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "hybridflow.cli.main",
                "train",
                f"model.path={model_dir}",
                f"trainer.default_local_dir={run_dir}",
                "trainer.total_training_steps=1",
            ],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=300,
        )
    finally:
        first.stdin.close()
        first.wait(timeout=60)
    assert second.returncode == 2, second.stderr
    errors = [line for line in second.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in second.stderr, second.stderr
    line = errors[0]
    assert f"trainer.default_local_dir {run_dir} is in use by another run, pid {first.pid} on " in line
    shown = " ".join(record["command"].split())  # its command line, on the one line
    assert "hybridflow.utils.dirlock" in shown and shown[:200] in line
    assert f"wait for it to end (or stop it: kill {first.pid}), or give this run another" in line
    # the refused run wrote nothing: the first run's files are as it left them
    assert (run_dir / "config.yaml").read_text() == "the first run's config\n"
    assert (run_dir / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'


def test_the_lock_of_a_killed_run_is_taken_over_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = _holder(tmp_path)
    assert first.stdout.readline().strip() == "locked"
    with pytest.raises(RunDirInUse, match=f"pid {first.pid}"):
        lock_run_dir(tmp_path)
    first.send_signal(signal.SIGKILL)  # no release: the kernel drops the flock, the record stays
    first.wait(timeout=60)
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == first.pid
    with caplog.at_level("WARNING", logger="hybridflow.utils.dirlock"), lock_run_dir(tmp_path) as lock:
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
        with pytest.raises(RunDirInUse, match=rf"another run of this process \(pid {os.getpid()}\)"):
            lock_run_dir(tmp_path)
    assert f"the record of pid {first.pid} on " in caplog.text and "ended without releasing it" in caplog.text
    assert (tmp_path / LOCK_FILE).read_text() == ""  # a clean release leaves no record to take over
    lock_run_dir(tmp_path).release()  # free again


def test_a_forked_child_of_a_dead_run_does_not_keep_the_directory(tmp_path: Path) -> None:
    run = _holder(tmp_path, "fork")
    child = int(run.stdout.readline())
    run.wait(timeout=60)
    try:
        os.kill(child, 0)  # the child lives on
        with lock_run_dir(tmp_path) as lock:  # but closed its copy of the descriptor at fork
            assert lock.fd is not None
    finally:
        os.kill(child, signal.SIGKILL)


def test_ranks_above_0_take_no_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with lock_run_dir(tmp_path):
        monkeypatch.setenv("RANK", "1")  # under torchrun rank 0 holds the directory for the run
        assert lock_run_dir(tmp_path).fd is None
