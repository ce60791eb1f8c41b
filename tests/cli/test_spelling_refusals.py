"""Issue 38 on the command line: verl's and the write-ups' spellings map or are refused naming the key to use,
the settings that used to pass without a word are refused, and ``hybridflow plan`` checks its own numbers and
takes overrides after its options. Every refusal is one ``error:`` line with exit status 2 (bad-input sweep)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from support import cli_cases
from support.spelling_cases import MAPPED, REFUSED, SNIPPETS, Refused, Snippet

from hybridflow.cli.main import main
from hybridflow.config import aliases

SHAPE = ["--model-shape", "qwen2.5-0.5b"]


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch, restore_cli_logging: None) -> None:
    """Fresh once-per-process notices; main()'s stderr handler taken away afterwards (conftest's fixture)."""
    monkeypatch.setattr(aliases, "_noticed", set())


def error_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one ``error:`` line of ``hybridflow ARGV``, which must exit with status 2 and no traceback."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    (line,) = [line for line in captured.err.splitlines() if line.startswith("error: ")]
    return line


@cli_cases.sweep(lambda env, spelling, words, fix: (["config", "show", spelling], spelling.split("=")[0]))
@pytest.mark.parametrize(("spelling", "words", "fix"), REFUSED, ids=[r[0] for r in REFUSED])
def test_a_spelling_we_do_not_take_is_one_line_naming_the_key_to_use(
    spelling: str, words: str, fix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    line = error_line(["config", "show", spelling], capsys)
    key = spelling.split("=")[0]
    assert line.startswith(f"error: {key}: ") and words in line and "; fix: " in line
    assert fix in line.split("; fix: ", 1)[1]


@pytest.mark.parametrize(("spelling", "extra", "ours", "value"), MAPPED[::3], ids=[m[0] for m in MAPPED[::3]])
def test_a_mapped_spelling_shows_as_our_key(
    spelling: str, extra: list[str], ours: str, value: object, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "show", *extra, spelling]) == 0
    captured = capsys.readouterr()
    node = yaml.safe_load(captured.out)
    for part in ours.split("."):
        node = node[part]
    assert node == value
    assert f"'{spelling.split('=')[0]}' -> '{ours}'" in captured.err  # the one notice of the mapping


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.name for s in SNIPPETS])
def test_a_write_ups_snippet_runs_or_is_refused_naming_its_keys(
    snippet: Snippet, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if isinstance(snippet.given, dict):  # a dict as the YAML file it would be
        (tmp_path / "run.yaml").write_text(yaml.safe_dump(snippet.given))
        args = [str(tmp_path / "run.yaml"), *snippet.context]
    else:
        args = [*snippet.context, *snippet.given]
    refused = [key for key, fate in snippet.keys.items() if isinstance(fate, Refused)]
    status = main(["config", "show", *args])
    err = capsys.readouterr().err
    assert "Traceback" not in err and "unknown config key" not in err
    if not refused and not snippet.verdict:
        assert status == 0, err
        return
    assert status == 2
    message = err[err.index("error: ") :]
    assert all(f"{key}: " in message for key in refused)  # refused at the key (the whole file is one run)
    assert all(f"{path} " in message or f"{path}: " in message for path, _ in snippet.verdict)


# settings that ran without a word before issue 38: (config show arguments, the start of the error line)
SILENT = [
    (
        ["rollout.dtype=float16", "actor.fsdp.param_dtype=bfloat16"],
        "error: rollout.dtype: float16 is not the training compute dtype (actor.fsdp.param_dtype=bfloat16",
    ),
    (
        ["data.train_batch_size=1025", "actor.ppo_mini_batch_size=16"],
        "error: data.train_batch_size: 1025 prompts is not a whole number of mini-batches of "
        "actor.ppo_mini_batch_size=16",
    ),
    (
        ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=6"],
        "error: data.train_batch_size: 16 prompts is not a whole number of mini-batches of "
        "critic.ppo_mini_batch_size=6",
    ),
    (["actor.pipeline_parallel_size=2"], "error: actor.pipeline_parallel_size: 2 does not divide the 1 rank"),
    (
        ["critic.pipeline_parallel_size=2"],
        "error: critic.pipeline_parallel_size: 2 does not divide the 1 rank",
    ),
    (["ref.pipeline_parallel_size=2"], "error: ref.pipeline_parallel_size: 2 does not divide the 1 rank"),
]


@cli_cases.sweep(cli_cases.config_show)
@pytest.mark.parametrize(("args", "message"), SILENT)
def test_what_ran_without_a_word_is_refused(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert error_line(["config", "show", *args], capsys).startswith(message)


PLAN = [
    (
        ["--gpu-memory-gb", "0"],
        "error: --gpu-memory-gb: expected the memory of one GPU in GB, a number of at least 1",
    ),
    (["--gpu-memory-gb", "-80"], "error: --gpu-memory-gb: expected the memory of one GPU in GB"),
    (["--gpu-memory-gb", "nan"], "error: --gpu-memory-gb: expected the memory of one GPU in GB"),
    (["--gpu-memory-gb", "inf"], "error: --gpu-memory-gb: expected the memory of one GPU in GB"),
    (["--gpu-memory-gb", "eighty"], "error: --gpu-memory-gb: expected the memory of one GPU in GB"),
    (
        ["--gpu-memory-gb", "80", "--host-memory-gb", "0"],
        "error: --host-memory-gb: expected the memory of one node",
    ),
    (
        ["--gpu-memory-gb", "80", "--host-memory-gb", "lots"],
        "error: --host-memory-gb: expected the memory of one node",
    ),
    (["--gpus", "0", "--gpu-memory-gb", "80"], "error: --gpus: must be at least 1, got 0"),
    (["--gpus", "-8", "--gpu-memory-gb", "80"], "error: --gpus: must be at least 1, got -8"),
    (["--gpus", "two", "--gpu-memory-gb", "80"], "error: --gpus: expected a whole number of GPUs, got 'two'"),
    (
        ["--gpus", "8", "--gpu-memory-gb", "80", "actor.pipeline_parallel_size=3"],
        "error: actor.pipeline_parallel_size: 3 does not divide the 8 ranks",
    ),
]


@cli_cases.sweep(lambda env, args, message: (["plan", *SHAPE, *args], message.removeprefix("error: ")))
@pytest.mark.parametrize(("args", "message"), PLAN)
def test_plan_refuses_a_bad_number_naming_the_option(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert error_line(["plan", *SHAPE, *args], capsys).startswith(message)


def test_plan_names_gpus_in_the_problems_it_causes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *SHAPE, "--gpus", "3", "--gpu-memory-gb", "80"]) == 2
    err = capsys.readouterr().err
    assert "(--gpus 3 sets trainer.nnodes=1, trainer.n_gpus_per_node=3)" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--gpus", "8", "rollout.tp_size=2", "--gpu-memory-gb", "80", *SHAPE],
        ["rollout.tp_size=2", "--gpus", "8", *SHAPE, "--gpu-memory-gb", "80"],
        ["--gpus", "8", "data.train_batch_size=64", "--gpu-memory-gb", "80", "rollout.tp_size=2", *SHAPE],
    ],
)
def test_plan_takes_overrides_before_between_and_after_options(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", *argv]) == 0
    out = capsys.readouterr().out
    assert "on 8 GPU(s) of 80 GB" in out
    assert "kept from the config: rollout.tensor_model_parallel_size=2" in out  # the override after options


def test_an_unknown_option_is_still_argparses_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["plan", *SHAPE, "data.train_batch_size=64", "--memory", "80", "rollout.n=4"])
    assert info.value.code == 2
    assert "unrecognized arguments: --memory 80" in capsys.readouterr().err
