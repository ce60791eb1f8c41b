"""``hybridflow train`` with the reward functions users write: by token ids, and one that hangs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.realistic import TOKEN_REWARD_SOURCE, realistic_rows, write_jsonl

from hybridflow.cli.main import main
from hybridflow.models import build_tiny_model_and_tokenizer

REPO = Path(__file__).resolve().parents[2]

HANGS = """
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source == "chat/tie":
        time.sleep(600)
    return 1.0
"""


# Stuck in C code holding the GIL, deaf to signals (SIGALRM blocked, libc's sleep through ctypes.PyDLL).
STUCK_IN_C = """
import ctypes, signal

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source == "chat/tie":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        ctypes.PyDLL(None).sleep(600)
    return 1.0
"""


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("reward_cmd")
    build_tiny_model_and_tokenizer(out_dir=root / "model", hidden_size=32, num_hidden_layers=1)
    (root / "token_reward.py").write_text(TOKEN_REWARD_SOURCE)
    (root / "hangs.py").write_text(HANGS)
    (root / "stuck_in_c.py").write_text(STUCK_IN_C)
    return {"root": root, "train": write_jsonl(realistic_rows(8), root / "train.jsonl")}


def train(files: dict[str, Path], run_dir: Path, reward: str, *extra: str) -> int:
    return main(train_argv(files, run_dir, reward, *extra))


def train_argv(files: dict[str, Path], run_dir: Path, reward: str, *extra: str) -> list[str]:
    return [
        "train",
        f"model.path={files['root'] / 'model'}",
        f"data.train_files=[{files['train']}]",
        "data.max_prompt_length=400",
        "data.max_response_length=6",
        "data.train_batch_size=4",
        "rollout.n=2",
        "actor.ppo_mini_batch_size=4",
        "trainer.total_training_steps=2",
        "trainer.logger=[console]",
        f"reward.custom_function.path={files['root'] / reward}",
        f"trainer.default_local_dir={run_dir}",
        *extra,
    ]


def test_a_token_id_reward_function_trains_on_prompts_of_different_lengths(
    files: dict[str, Path], tmp_path: Path
) -> None:
    assert train(files, tmp_path / "run", "token_reward.py") == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(0.0 <= r["critic/score/mean"] <= 1.0 for r in rows)


def test_a_hung_reward_stops_the_run_naming_the_function_and_the_sample(
    files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    start = time.monotonic()
    assert train(files, tmp_path / "run", "hangs.py", "reward.timeout_s=0.5") == 2  # default num_workers=0
    assert time.monotonic() - start < 60  # not the 600 s the function sleeps
    err = capsys.readouterr().err.strip().splitlines()
    message = next(line for line in err if line.startswith("error:"))
    assert "compute_score" in message and "data_source='chat/tie'" in message and "sample" in message
    assert "timed out after 0.5 s" in message and "reward.timeout_s" in message and "Traceback" not in err


def test_a_reward_stuck_in_c_code_holding_the_gil_stops_the_run_with_one_line(
    files: dict[str, Path], tmp_path: Path
) -> None:
    """No thread of the trainer can run: the watchdog process reports the call and stops the run."""
    argv = train_argv(files, tmp_path / "run", "stuck_in_c.py", "reward.timeout_s=0.5")  # num_workers=0
    group = ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE", "LOCAL_RANK")  # this process's own group
    env = {k: v for k, v in os.environ.items() if k not in group}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "hybridflow.cli.main", "--log-level", "WARNING", *argv]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)  # not the 600 s
    assert done.returncode == -signal.SIGTERM, (done.returncode, done.stderr[-3000:])
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert errors[0].startswith(
        f"error: reward function {files['root'] / 'stuck_in_c.py'}:compute_score has run"
    )
    assert "on sample " in errors[0] and "past reward.timeout_s=0.5" in errors[0]
    assert "fix: set reward.num_workers >= 1" in errors[0]
