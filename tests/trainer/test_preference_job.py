"""DPO and KTO end to end through the command line on a tiny model: metrics, checkpoints, bad rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridflow.cli.main import main
from hybridflow.models import build_tiny_model_and_tokenizer

COMMON = [
    "data.train_batch_size=4",
    "data.max_prompt_length=24",
    "data.max_response_length=12",
    "actor.ppo_mini_batch_size=4",
    "actor.ppo_micro_batch_size_per_gpu=4",
    "actor.optim.lr=1e-3",
    "trainer.total_training_steps=2",
    "trainer.logger=[console]",
]


def pairs(n: int) -> list[dict]:
    return [
        {"prompt": [{"role": "user", "content": f"{i}+1="}], "chosen": f"{i + 1}", "rejected": f"{i + 2}"}
        for i in range(n)
    ]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model")
    build_tiny_model_and_tokenizer(out_dir=out, hidden_size=32, num_hidden_layers=2)
    return out


def run(cmd: str, tmp_path: Path, model_dir: Path, data: Path, *extra: str) -> int:
    config = write_jsonl(tmp_path / "empty.yaml", [])
    args = [cmd, str(config), f"model.path={model_dir}", f"data.train_files=[{data}]"]
    return main([*args, f"trainer.default_local_dir={tmp_path / 'run'}", *COMMON, *extra])


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("precompute", [False, True])
def test_dpo_trains_saves_and_reports_trl_metrics(tmp_path: Path, model_dir: Path, precompute: bool) -> None:
    data = write_jsonl(tmp_path / "pairs.jsonl", pairs(8))
    assert run("dpo", tmp_path, model_dir, data, f"ref.precompute={str(precompute).lower()}") == 0
    metrics = rows_of(tmp_path / "run")
    assert [m["step"] for m in metrics] == [1, 2]
    for key in (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracies",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
        "loss",
        "actor/grad_norm",
        "timing_s/ref",
        "timing_s/update_actor",
    ):
        assert key in metrics[-1], key
    assert metrics[0]["rewards/margins"] == pytest.approx(0.0, abs=1e-6)  # the policy starts as the reference
    assert metrics[0]["loss"] == pytest.approx(0.6931472, abs=1e-5)  # -log sigmoid(0)
    assert metrics[1]["rewards/margins"] != 0.0
    assert (tmp_path / "run" / "global_step_2" / "meta.json").is_file()
    assert (tmp_path / "run" / "final_model" / "config.json").is_file()
    if precompute:  # the cached reference gives the same numbers as computing it per batch
        fresh = tmp_path / "fresh"
        fresh.mkdir()
        assert run("dpo", fresh, model_dir, data) == 0
        for key, value in rows_of(fresh / "run")[-1].items():
            if not key.startswith(("timing_s/", "perf/")):
                assert metrics[-1][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_kto_trains_with_the_kl_reference_point(tmp_path: Path, model_dir: Path) -> None:
    rows = [{"prompt": f"{i}+1=", "completion": f"{i + 1 + (i % 2)}", "label": i % 2 == 0} for i in range(8)]
    data = write_jsonl(tmp_path / "kto.jsonl", rows)
    assert run("kto", tmp_path, model_dir, data) == 0
    metrics = rows_of(tmp_path / "run")
    assert {"kl", "rewards/chosen", "rewards/rejected", "rewards/margins", "loss"} <= metrics[-1].keys()
    assert metrics[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference at the first step


def test_bad_preference_rows_are_named(tmp_path: Path, model_dir: Path, capsys, caplog) -> None:
    rows = pairs(8)
    del rows[3]["rejected"]
    data = write_jsonl(tmp_path / "bad.jsonl", rows)
    assert run("dpo", tmp_path, model_dir, data) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl" in err and "rejected" in err and "Traceback" not in err
    assert "line 4" in err or "row 3" in err

    rows = pairs(9)
    rows[5]["rejected"] = rows[5]["chosen"]  # teaches nothing: dropped and counted, with a warning
    data = write_jsonl(tmp_path / "same.jsonl", rows)
    with caplog.at_level("WARNING"):
        assert run("dpo", tmp_path, model_dir, data) == 0
    assert "same.jsonl" in caplog.text and "dropped 1 of 9 rows whose chosen equals rejected" in caplog.text
