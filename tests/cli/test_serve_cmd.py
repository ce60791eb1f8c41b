"""``hybridflow serve``: the endpoint alone, answering the real openai client with the run's token; bad
options stop at start with one error line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import openai

from hybridflow.cli.main import main
from hybridflow.models.tiny import build_tiny_model_and_tokenizer


def test_serve_answers_the_openai_client(tmp_path: Path) -> None:
    build_tiny_model_and_tokenizer(tmp_path / "model", hidden_size=32, num_hidden_layers=1)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), HYBRIDFLOW_API_KEY="s3cret")
    cmd = [
        sys.executable,
        "-m",
        "hybridflow.cli.main",
        "serve",
        "--model",
        str(tmp_path / "model"),
        "--port",
        "0",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("serving model at http://127.0.0.1:"), line
        client = openai.OpenAI(base_url=line.split(" at ")[1].strip(), api_key="s3cret", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["model"]
        reply = client.chat.completions.create(
            model="model", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.choices[0].finish_reason in ("stop", "length")
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0


def test_serve_refuses_a_bad_port(tmp_path: Path, capsys) -> None:
    assert main(["serve", "--model", str(tmp_path), "--port", "70000"]) == 2
    err = capsys.readouterr().err
    assert "--port 70000" in err and "Traceback" not in err
