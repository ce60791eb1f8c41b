"""`hybridflow sft` trains on prompt/response rows and writes a loadable Hugging Face directory."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoModelForCausalLM

from hybridflow.cli.main import main
from hybridflow.models import build_tiny_model_and_tokenizer


def test_sft_writes_a_model_directory(tmp_path: Path, capsys) -> None:
    build_tiny_model_and_tokenizer(out_dir=tmp_path / "base", hidden_size=32, num_hidden_layers=1)
    rows = [
        {"prompt": [{"role": "user", "content": f"{i}+1="}], "response": f"#### {i + 1}"} for i in range(8)
    ]
    data = tmp_path / "sft.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "cfg.yaml").write_text("actor:\n  optim:\n    lr: 0.001\n")
    out = tmp_path / "sft_model"
    code = main(
        [
            "sft",
            str(tmp_path / "cfg.yaml"),
            f"model.path={tmp_path / 'base'}",
            f"data.train_files=[{data}]",
            "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=4",
            "trainer.total_training_steps=3",
            f"trainer.default_local_dir={tmp_path / 'run'}",
            "--out",
            str(out),
        ]
    )
    assert code == 0, capsys.readouterr().err
    assert "model saved to" in capsys.readouterr().out
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    tuned = AutoModelForCausalLM.from_pretrained(out)
    changed = [n for n, p in tuned.named_parameters() if not p.equal(dict(base.named_parameters())[n])]
    assert changed  # the weights moved
    assert (out / "metrics.jsonl").read_text().count("\n") == 3
    # the stop tokens stay the base's (a chat model's end of turn beside the eos): without it, a model sampled
    # from the saved directory never stops at the end of its turn
    assert len(base.generation_config.eos_token_id) == 2
    assert tuned.generation_config.eos_token_id == base.generation_config.eos_token_id


def test_sft_rows_without_a_response_are_refused(tmp_path: Path, capsys) -> None:
    build_tiny_model_and_tokenizer(out_dir=tmp_path / "base", hidden_size=32, num_hidden_layers=1)
    data = tmp_path / "sft.jsonl"
    data.write_text(json.dumps({"prompt": "1+1="}) + "\n")
    code = main(
        [
            "sft",
            f"model.path={tmp_path / 'base'}",
            f"data.train_files=[{data}]",
            "data.train_batch_size=1",
            "actor.ppo_mini_batch_size=1",
            "trainer.total_training_steps=1",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert code == 2
    assert "SFT row 0 needs" in capsys.readouterr().err
