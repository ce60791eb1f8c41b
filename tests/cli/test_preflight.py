"""Issue 60: the commands judge their config, files and directories before torch or a model is loaded, so a
mistake is one ``error:`` line within seconds (it took 29-47 s on a busy machine), and nothing is created."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import cli_cases

from hybridflow.cli.main import main

REPO = Path(__file__).resolve().parents[2]


def model_dir(root: Path) -> Path:
    """A directory that looks like a saved model to the cheap checks (config.json; nothing is loaded)."""
    model = root / "my-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 512}))
    return model


def rows_file(root: Path) -> Path:
    rows = root / "train.jsonl"
    lines = [
        {"prompt": [{"role": "user", "content": f"{a}+{a}="}], "ground_truth": str(2 * a)} for a in (3, 17)
    ]
    rows.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return rows


def timed_cli(args: list[str], cwd: Path) -> tuple[float, subprocess.CompletedProcess[str]]:
    """``hybridflow ARGS`` in a fresh interpreter under ``-X importtime`` (every import on stderr); its seconds."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "hybridflow.cli.main", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )
    return time.perf_counter() - start, done


def test_three_bad_inputs_are_refused_within_seconds_without_importing_torch(tmp_path: Path) -> None:
    model, rows = model_dir(tmp_path), rows_file(tmp_path)
    cases = [
        (
            ["train", f"model.path={model}", f"data.train_files=[{tmp_path / 'missing.parquet'}]"],
            f"error: data.train_files: {tmp_path / 'missing.parquet'}: no such file; check the path",
        ),
        (
            ["train", f"model.path={model}", f"data.train_files=[{rows}]", "learning_rat=1e-6"],
            "error: learning_rat: unknown config key; fix: did you mean 'actor.optim.lr' (the notebook API's "
            "learning_rate=)?",
        ),
        (
            [
                "generate",
                "--model",
                "/nonexistent",
                "--prompts",
                str(rows),
                "--out",
                str(tmp_path / "o.jsonl"),
            ],
            "error: --model '/nonexistent': no such directory; pass the local directory of the model",
        ),
    ]
    for args, error in cases:
        seconds, done = timed_cli(args, tmp_path)
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert done.returncode == 2 and len(errors) == 1 and errors[0].startswith(error), done.stderr[-2000:]
        imported = {
            line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if "import time:" in line
        }
        assert "torch" not in imported and "transformers" not in imported, args  # refused before them
        assert seconds < 15, (args, seconds)  # about a second on an idle machine; CI is slow and shared
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my-model", "train.jsonl"]  # nothing created


@pytest.fixture
def env(tmp_path: Path, restore_cli_logging: None) -> dict[str, Path]:
    model, rows = model_dir(tmp_path), rows_file(tmp_path)
    return {"model": model, "rows": rows, "tmp": tmp_path}


def error_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.out == ""
    (line,) = [line for line in captured.err.splitlines() if line.startswith("error: ")]
    return line


CASES = {
    "model without config.json": (
        lambda e: ["train", f"model.path={e['tmp']}", f"data.train_files=[{e['rows']}]"],
        "error: model.path '{tmp}' has no config.json; pass the directory that a Hugging Face `save_pretrained`",
    ),
    "model as a hub name": (
        lambda e: ["kto", "model.path=Qwen/Qwen2.5-0.5B"],
        "error: model.path 'Qwen/Qwen2.5-0.5B': no such directory; pass the local directory of the model (the "
        "one holding config.json); hybridflow loads models from local directories only: download it first",
    ),
    "data file of another type": (
        lambda e: ["train", f"model.path={e['model']}", f"data.train_files=[{e['model'] / 'config.json'}]"],
        "error: data.train_files: {model}/config.json: unsupported file type '.json'; use .parquet or .jsonl",
    ),
    "validation file missing": (
        lambda e: ["dpo", f"model.path={e['model']}", f"data.val_files=[{e['tmp'] / 'val.jsonl'}]"],
        "error: data.val_files: {tmp}/val.jsonl: no such file",
    ),
    "reward file missing": (
        lambda e: ["train", f"model.path={e['model']}", f"reward.custom_function.path={e['tmp'] / 'r.py'}"],
        "error: reward.custom_function.path: {tmp}/r.py: no such file",
    ),
    "run directory is a file": (
        lambda e: ["train", f"model.path={e['model']}", f"trainer.default_local_dir={e['rows']}"],
        "error: the run directory (trainer.default_local_dir) {tmp}/train.jsonl is a file, not a directory",
    ),
    "critic model missing": (
        lambda e: [
            "train",
            f"model.path={e['model']}",
            "algorithm.adv_estimator=gae",
            f"critic.model.path={e['tmp'] / 'critic'}",
        ],
        "error: critic.model.path '{tmp}/critic': no such directory",
    ),
    "demo with a bad value": (
        lambda e: ["dpo", "preference.beta=high"],
        "error: preference.beta: expected a number",
    ),
    "sft into a non-empty directory": (
        lambda e: [
            "sft",
            f"model.path={e['model']}",
            f"data.train_files=[{e['rows']}]",
            "--out",
            str(e["model"]),
        ],
        "error: --out {model} is not empty; choose a new directory or pass --overwrite",
    ),
    "generate with a missing tokenizer": (
        lambda e: [
            "generate",
            *("--model", str(e["model"]), "--tokenizer", str(e["tmp"] / "tok")),
            *("--prompts", str(e["rows"]), "--out", str(e["tmp"] / "o.jsonl")),
        ],
        "error: --tokenizer '{tmp}/tok': no such directory",
    ),
    "generate from a directory of prompts": (
        lambda e: ["generate", "--model", str(e["model"]), "--prompts", str(e["tmp"]), "--out", "o.jsonl"],
        "error: --prompts: {tmp} is a directory; give a file",
    ),
    "eval of a config whose model is missing": (
        lambda e: ["eval", str(e["tmp"] / "eval.yaml"), f"model.path={e['tmp'] / 'gone'}"],
        "error: model.path '{tmp}/gone': no such directory",
    ),
    "eval into an existing file": (
        lambda e: ["eval", str(e["tmp"] / "eval.yaml"), "--out", str(e["rows"])],
        "error: --out {tmp}/train.jsonl exists; choose another file or pass --overwrite",
    ),
    "export of a missing checkpoint": (
        lambda e: ["export", str(e["tmp"] / "run" / "global_step_3"), "--out", str(e["tmp"] / "hf")],
        "error: checkpoint {tmp}/run/global_step_3 does not exist",
    ),
}


def swept(env: cli_cases.Env, case: str) -> tuple[list[str], str]:
    """A case in the bad-input sweep (tests/reliability): on the sweep's tiny model and folder."""
    paths = {"model": env.model, "rows": rows_file(env.tmp), "tmp": env.tmp}
    (env.tmp / "eval.yaml").write_text(f"model:\n  path: {env.model}\n")
    build, expected = CASES[case]
    return build(paths), expected.format(tmp=env.tmp, model=env.model).removeprefix("error: ")


@cli_cases.sweep(swept)
@pytest.mark.parametrize("case", list(CASES))
def test_each_command_refuses_a_bad_path_before_loading_anything(
    case: str, env: dict[str, Path], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import hybridflow.trainer.jobs as jobs

    for name in ("rl_job", "sft_job", "eval_job", "preference_job"):  # reaching a job is the failure
        monkeypatch.setattr(jobs, name, lambda *a, **k: pytest.fail("the job started"))
    (env["tmp"] / "eval.yaml").write_text(f"model:\n  path: {env['model']}\n")
    build, expected = CASES[case]
    before = sorted(p.name for p in env["tmp"].iterdir())
    line = error_of(build(env), capsys)
    assert line.startswith(expected.format(tmp=env["tmp"], model=env["model"])), line
    assert sorted(p.name for p in env["tmp"].iterdir()) == before  # no run directory, no output
