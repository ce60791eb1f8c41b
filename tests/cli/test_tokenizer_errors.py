"""`hybridflow train` and `hybridflow generate` on a model directory without tokenizer files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow.cli.main import main
from hybridflow.models import build_tiny_model_and_tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a model directory stripped of its tokenizer files, a directory holding that tokenizer)."""
    full = tmp_path_factory.mktemp("full")
    build_tiny_model_and_tokenizer(out_dir=full, hidden_size=32, num_hidden_layers=1)
    bare = tmp_path_factory.mktemp("bare")
    for f in full.iterdir():
        if f.name not in TOKENIZER_FILES:
            (bare / f.name).write_bytes(f.read_bytes())
    return bare, full


def assert_names_the_missing_files(err: str, model_dir: Path, fix: str) -> None:
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and err.splitlines()[-1] == errors[0] and "Traceback" not in err  # after the log
    assert "prompt 0 is empty" not in err
    for part in (str(model_dir), "tokenizer.json", "tokenizer_config.json", fix):
        assert part in err


def test_generate_without_tokenizer_files_names_them(
    dirs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bare, full = dirs
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "12+7="}) + "\n")
    argv = ["generate", "--model", str(bare), "--prompts", str(prompts), "--max-new-tokens", "3"]
    assert main([*argv, "--out", str(tmp_path / "a.jsonl")]) == 2
    assert_names_the_missing_files(capsys.readouterr().err, bare, "--tokenizer")
    # The fix the message gives works.
    assert main([*argv, "--out", str(tmp_path / "b.jsonl"), "--tokenizer", str(full)]) == 0
    assert len((tmp_path / "b.jsonl").read_text().splitlines()) == 1


def test_train_without_tokenizer_files_names_them(
    dirs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bare, _ = dirs
    args = [f"model.path={bare}", "trainer.total_training_steps=1", f"trainer.default_local_dir={tmp_path}"]
    assert main(["train", *args]) == 2
    assert_names_the_missing_files(capsys.readouterr().err, bare, "model.tokenizer_path=DIR")
