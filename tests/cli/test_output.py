"""Outputs the user already has are replaced only with --overwrite, and a refusal comes before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_generate_cmd import generate_argv

from hybridflow.cli.main import main
from hybridflow.cli.output import check_output_dir, check_output_file
from hybridflow.models import build_tiny_model_and_tokenizer


def test_existing_outputs_need_overwrite(tmp_path: Path) -> None:
    check_output_dir(tmp_path / "new", overwrite=False)  # absent: fine
    check_output_file(tmp_path / "new.jsonl", overwrite=False)
    (tmp_path / "empty").mkdir()
    check_output_dir(tmp_path / "empty", overwrite=False)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "model.safetensors").write_text("weights")
    with pytest.raises(ValueError, match="is not empty; choose a new directory or pass --overwrite"):
        check_output_dir(tmp_path / "full", overwrite=False)
    check_output_dir(tmp_path / "full", overwrite=True)
    (tmp_path / "a.jsonl").write_text("{}\n")
    with pytest.raises(ValueError, match="exists; choose another file or pass --overwrite"):
        check_output_file(tmp_path / "a.jsonl", overwrite=False)
    with pytest.raises(ValueError, match="is a directory"):
        check_output_file(tmp_path / "full", overwrite=True)
    with pytest.raises(ValueError, match="is a file"):
        check_output_dir(tmp_path / "a.jsonl", overwrite=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model")
    build_tiny_model_and_tokenizer(out_dir=out, hidden_size=32, num_hidden_layers=1)
    return out


def test_sft_into_a_model_directory_is_refused_before_training(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    weights = (model_dir / "model.safetensors").read_bytes()
    code = main(
        [
            "sft",
            f"model.path={model_dir}",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "--out",
            str(model_dir),
        ]
    )
    assert code == 2 and "is not empty" in capsys.readouterr().err
    assert (model_dir / "model.safetensors").read_bytes() == weights  # the base model is untouched
    assert not (tmp_path / "run").exists()  # refused before any training


def test_generate_keeps_an_existing_file_unless_told(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "1+1="}) + "\n")
    out = tmp_path / "notes.jsonl"
    out.write_text("mine\n")
    cmd = generate_argv(model_dir, prompts, out, "--max-new-tokens", "2")
    assert main(cmd) == 2 and "--overwrite" in capsys.readouterr().err
    assert out.read_text() == "mine\n"
    assert main([*cmd, "--overwrite"]) == 0
    assert json.loads(out.read_text().splitlines()[0])["prompt_index"] == 0
