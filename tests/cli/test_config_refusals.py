"""Issue 25 on the command line: settings that used to fail at the first step (or silently did something
else) are refused at start with exit status 2 and one ``error:`` line naming the key and the fix, or take
the behaviour their help documents."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from support import cli_cases

from hybridflow.cli.main import main
from hybridflow.config import aliases
from hybridflow.models import build_tiny_model_and_tokenizer

A = "actor_rollout_ref"


@pytest.fixture(autouse=True)
def _fresh_notices(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test sees the once-per-process verl notices afresh."""
    monkeypatch.setattr(aliases, "_noticed", set())


def refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one error line of ``hybridflow config show ARGS``, which must exit with status 2."""
    assert main(["config", "show", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    (line,) = [line for line in captured.err.splitlines() if line.startswith("error: ")]
    return line


@cli_cases.sweep(cli_cases.config_show)  # the reliability sweep runs these cases too
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (  # item 5: a token budget smaller than one sequence
            ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=100"],
            "error: actor.ppo_max_token_len_per_gpu: 100 tokens cannot hold one sequence of "
            "data.max_prompt_length + data.max_response_length = 192 tokens while "
            "actor.use_dynamic_bsz=true; "
            "fix: set actor.ppo_max_token_len_per_gpu to at least 192 (or actor.use_dynamic_bsz=false)",
        ),
        (
            ["rollout.log_prob_use_dynamic_bsz=true", "rollout.log_prob_max_token_len_per_gpu=64"],
            "error: rollout.log_prob_max_token_len_per_gpu: 64 tokens cannot hold one sequence",
        ),
        (  # item 7: a strategy we do not have, for each role (megatron means the training views)
            [f"{A}.actor.strategy=deepspeed"],
            f"error: {A}.actor.strategy: 'deepspeed' is not supported: hybridflow trains with FSDP2",
        ),
        (["critic.strategy=deepspeed"], "error: critic.strategy: 'deepspeed' is not supported"),
        (["reward_model.strategy=megatron"], "error: reward_model.strategy: 'megatron' is not supported"),
        (
            ["trainer.n_gpus_per_node=4", "rollout.tensor_model_parallel_size=3"],
            "error: rollout.tensor_model_parallel_size: 3 does not divide the 4 ranks",
        ),
        (
            ["trainer.n_gpus_per_node=2", "rollout.tensor_model_parallel_size=2", f"{A}.hybrid_engine=false"],
            f"error: actor.hybrid_engine (given as '{A}.hybrid_engine'): is false with rollout.tensor_model_par",
        ),
        (
            [f"{A}.actor.fsdp_config.grad_offload=true"],
            f"error: {A}.actor.fsdp_config.grad_offload: True is not supported: gradients are not offloaded",
        ),
        (
            ["trainer.default_hdfs_dir=hdfs://ckpt/run"],
            "error: trainer.default_hdfs_dir: 'hdfs://ckpt/run' is not supported: uploading checkpoints "
            "to HDFS",
        ),
        (
            [
                "trainer.n_gpus_per_node=2",
                "actor.use_kl_loss=true",
                f"{A}.ref.ulysses_sequence_parallel_size=2",
            ],
            f"error: ref.ulysses_sequence_parallel_size (given as '{A}.ref.ulysses_sequence_parallel_size'): is 2, "
            "but model.use_remove_padding is false",
        ),
        (  # item 9: empty file lists
            ["data.train_files=[]"],
            "error: data.train_files: is an empty list; fix: list the files, data.train_files=[FILE,...]",
        ),
        (["data.val_files=[]"], "error: data.val_files: is an empty list"),
    ],
)
def test_refused_at_start_with_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert refused(args, capsys).startswith(message)


def test_a_strategy_refusal_names_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    line = refused([f"{A}.actor.strategy=deepspeed"], capsys)
    assert line.endswith(
        f"fix: set {A}.actor.strategy=fsdp2, fsdp or megatron (all three mean this), or remove it"
    )


@pytest.mark.parametrize(
    ("arg", "notice"),
    [
        (f"{A}.actor.strategy=fsdp", "the actor trains with FSDP2"),
        (f"{A}.actor.strategy=megatron", "tensor parallelism inside each layer"),
        (f"{A}.rollout.mode=async", "in place of verl's sync"),
        (f"{A}.rollout.name=vllm", "the built-in rollout engine replaces vLLM here"),
    ],
)
def test_values_we_honour_anyway_run_with_one_notice(
    arg: str, notice: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "show", arg]) == 0
    captured = capsys.readouterr()
    assert [line for line in captured.err.splitlines() if notice in line] != []
    assert len([line for line in captured.err.splitlines() if arg.split("=")[0] in line]) == 1


def test_rollout_rs_without_a_threshold_shows_the_default(capsys: pytest.CaptureFixture[str]) -> None:
    # item 4: null means rollout_is_threshold, as the help says
    assert main(["config", "show", "algorithm.rollout_correction.rollout_rs=token"]) == 0
    rc = yaml.safe_load(capsys.readouterr().out)["algorithm"]["rollout_correction"]
    assert rc["rollout_rs_threshold"] == rc["rollout_is_threshold"] == 2.0


def test_fp16_rollout_under_bf16_training_is_refused_unless_opted_in(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # issue 38: refused, naming both keys and the opt-in; with the opt-in, one warning line
    line = refused(["rollout.dtype=float16", "actor.fsdp.param_dtype=bfloat16"], capsys)
    assert line.startswith("error: rollout.dtype: float16 is not the training compute dtype ")
    assert "actor.fsdp.param_dtype=bfloat16" in line and "rollout.allow_dtype_mismatch=true" in line
    args = ["rollout.dtype=float16", "actor.fsdp.param_dtype=bfloat16", "rollout.allow_dtype_mismatch=true"]
    assert main(["config", "show", *args]) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if "rollout.dtype=float16" in line]
    assert len(lines) == 1 and "WARNING" in lines[0]
    assert "actor.fsdp.param_dtype=bfloat16" in lines[0] and "importance weights" in lines[0]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model")
    build_tiny_model_and_tokenizer(out_dir=path, hidden_size=32, num_hidden_layers=1)
    return path


def test_train_with_rollout_rs_and_no_threshold_runs_a_step(
    tmp_path: Path, tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # item 4: it used to pass validation and raise at the first step (rollout_rs_threshold is None)
    run_dir = tmp_path / "run"
    args = [
        f"model.path={tiny_model}",
        "algorithm.rollout_correction.rollout_rs=token",
        "trainer.total_training_steps=1",
        "trainer.val_before_train=false",
        f"trainer.default_local_dir={run_dir}",
    ]
    assert main(["train", *args]) == 0, capsys.readouterr().err
    (row,) = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert "rollout_corr/rollout_rs_masked_fraction" in row


def test_train_with_an_empty_train_files_list_is_refused(
    tmp_path: Path, tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # item 9: it used to train on the built-in arithmetic task and exit 0
    args = [f"model.path={tiny_model}", "data.train_files=[]", "trainer.total_training_steps=1"]
    assert main(["train", *args, f"trainer.default_local_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "error: data.train_files: is an empty list" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()
