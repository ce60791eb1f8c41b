"""The sweep: every bad input of the command line the tests know exits 2 with one line and no traceback.

Each case builds its bad input (a damaged model, checkpoint or data file, an unusable output directory, a
full disk, a bad value) and names the file, field or fix its message must contain. The cases are this
module's own (issue 29's items 5-8) and every case of the tests elsewhere tagged ``@cli_cases.sweep``
(config refusals, value and type checks, generate's bad rows, ...): tag the test of every new user-facing
input, or add a case here.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from reliability_util import copy_of, flip_bytes, metrics_steps, shard_of, train_argv, truncate
from support import cli_cases
from support.cli_cases import Env

from hybridflow.cli.main import main
from hybridflow.models import build_tiny_model_and_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cli_cases.tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def trained(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory holding one checkpoint (global_step_1) of the tiny run, made once for the module."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    assert main(train_argv(model_dir, run_dir, "trainer.total_training_steps=1")) == 0
    return run_dir


def _damaged_model(damage: Callable[[Path], None]) -> Callable[[Env], tuple[list[str], str]]:
    def case(env: Env) -> tuple[list[str], str]:
        model = copy_of(env.model, env.tmp / "model")
        damage(model)
        return env.generate(model), str(model)

    return case


def _bert(model: Path) -> None:
    from transformers import BertConfig, BertForMaskedLM

    (model / "model.safetensors").unlink()
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2)
    BertForMaskedLM(config).save_pretrained(model)


def _model_type(model: Path) -> None:
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "model_type": "frobnicator"}))


def _damaged_checkpoint(command: str, damage: str) -> Callable[[Env], tuple[list[str], str]]:
    def case(env: Env) -> tuple[list[str], str]:
        run_dir = copy_of(env.trained(), env.tmp / "run")
        ckpt = run_dir / "global_step_1"
        shard = shard_of(ckpt)
        if damage == "flip":
            flip_bytes(shard)
        elif damage == "truncate":
            truncate(shard)
        else:
            (shard.parent / ".metadata").unlink()
        named = ".metadata" if damage == "metadata" else shard.name
        if command == "export":
            return ["export", str(ckpt), "--out", str(env.tmp / "hf")], named
        if command == "eval":
            return ["eval", str(ckpt), "--out", str(env.tmp / "e.jsonl")], named
        args = train_argv(env.model, run_dir, "trainer.total_training_steps=2", f"trainer.resume={ckpt}")
        return args, named

    return case


def _every_checkpoint_damaged(env: Env) -> tuple[list[str], str]:
    run_dir = copy_of(env.trained(), env.tmp / "run")
    flip_bytes(shard_of(run_dir / "global_step_1"))
    argv = train_argv(env.model, run_dir, "trainer.total_training_steps=2")  # trainer.resume=auto
    return argv, f"every checkpoint in {run_dir} is damaged"


def _another_model(change: str) -> Callable[[Env], tuple[list[str], str]]:
    """Resume the shared run (trained from env.model) with model.path at a model of the same shape."""

    def case(env: Env) -> tuple[list[str], str]:
        run_dir = copy_of(env.trained(), env.tmp / "run")
        other = env.tmp / "other"
        if change == "seed":
            build_tiny_model_and_tokenizer(out_dir=other, hidden_size=32, num_hidden_layers=1, seed=1)
            named = (
                f"its actor started from {env.model.resolve()}, this run's model.path is {other.resolve()}"
            )
        else:
            config = json.loads((copy_of(env.model, other) / "config.json").read_text())
            config["rope_parameters"]["rope_theta"] = 500000.0
            (other / "config.json").write_text(json.dumps(config))
            named = "config.json differs (rope_parameters: "
        return train_argv(other, run_dir, "trainer.total_training_steps=2"), named

    return case


def _run_dir_file(env: Env) -> tuple[list[str], str]:
    (env.tmp / "runs").write_text("not a directory")
    return train_argv(env.model, env.tmp / "runs"), "is a file, not a directory"


def _run_dir_under_file(env: Env) -> tuple[list[str], str]:
    (env.tmp / "blocker").write_text("a file")
    return train_argv(env.model, env.tmp / "blocker" / "run"), "which is a file"


def _bad_utf8_data(env: Env) -> tuple[list[str], str]:
    data = env.tmp / "train.jsonl"
    good = json.dumps({"prompt": "1+1=", "data_source": "x", "reward_model": {"ground_truth": "2"}})
    data.write_bytes(f"{good}\n{good}\n".encode() + b'{"prompt": "caf\xe9"}\n')
    return train_argv(
        env.model, env.tmp / "r", f"data.train_files=[{data}]"
    ), f"{data}: line 3 is not valid UTF-8"


def _bad_utf8_prompts(env: Env) -> tuple[list[str], str]:
    argv = env.generate(env.model)
    env.prompts(b'{"prompt": "1+1="}\n{"prompt": "\xff"}\n')
    return argv, "p.jsonl: line 2 is not valid UTF-8"


def _negative_steps(env: Env) -> tuple[list[str], str]:
    argv = train_argv(env.model, env.tmp / "r", "trainer.total_training_steps=-3")
    return argv, "set trainer.total_training_steps to a value that is at least 1"


def _response_past_the_position_limit(env: Env) -> tuple[list[str], str]:
    # issue 59: a warning, then an allocation of 160 GB for the rollout's buffers (an internal error)
    argv = train_argv(env.model, env.tmp / "r", "data.max_response_length=100000000")
    return argv, "data.max_response_length=100000000 cannot fit in the model's position limit"


def _prompt_past_the_position_limit(env: Env) -> tuple[list[str], str]:
    prompts = env.prompts(b'{"prompt": "' + b"1+" * 300 + b'"}\n')  # 600 tokens, past the limit of 512
    return env.generate(env.model, prompts), "p.jsonl: prompt 1 has 600 tokens"


def _bad_yaml(env: Env) -> tuple[list[str], str]:
    (env.tmp / "c.yaml").write_text("trainer: [unclosed\n")
    return ["train", str(env.tmp / "c.yaml")], "c.yaml: is not valid YAML"


CASES: dict[str, Callable[[Env], tuple[list[str], str]]] = {
    "model: flipped bytes in model.safetensors": _damaged_model(
        lambda m: flip_bytes(m / "model.safetensors", 64, start=8)  # inside the header
    ),
    "model: truncated model.safetensors": _damaged_model(lambda m: truncate(m / "model.safetensors")),
    "model: no weights file": _damaged_model(lambda m: (m / "model.safetensors").unlink()),
    "model: invalid config.json": _damaged_model(lambda m: (m / "config.json").write_text('{"model_type": ')),
    "model: encoder-only (BERT)": _damaged_model(_bert),
    "model: unknown model_type": _damaged_model(_model_type),
    **{
        f"checkpoint: {damage} in {command}": _damaged_checkpoint(command, damage)
        for command in ("train", "export", "eval")
        for damage in ("flip", "truncate", "metadata")
    },
    "checkpoint: every checkpoint of the run damaged, resume=auto": _every_checkpoint_damaged,
    "checkpoint: resuming another model of the same shape (another seed)": _another_model("seed"),
    "checkpoint: resuming a model of another config (rope_theta)": _another_model("config"),
    "output: run directory is a file": _run_dir_file,
    "output: run directory under a file": _run_dir_under_file,
    "data: bad UTF-8 in a data file": _bad_utf8_data,
    "data: bad UTF-8 in a prompts file": _bad_utf8_prompts,
    "data: a prompt past the model's position limit": _prompt_past_the_position_limit,
    "config: a response length past the model's position limit": _response_past_the_position_limit,
    "config: a negative step count": _negative_steps,
    "config: invalid YAML": _bad_yaml,
}
# The cases of the tests tagged @cli_cases.sweep, each with the marks of its parameter set.
SWEPT = cli_cases.discover()


def _check_user_error(argv: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and "internal error" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors and named in errors[0], err
    return errors[0]


@pytest.mark.parametrize(
    "name", [*CASES, *(pytest.param(key, marks=marks) for key, (_, marks) in SWEPT.items())]
)
def test_a_bad_input_exits_2_with_one_line_naming_it(
    name: str,
    model_dir: Path,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    env = Env(model_dir, lambda: request.getfixturevalue("trained"), tmp_path)
    argv, named = CASES[name](env) if name in CASES else SWEPT[name][0](env)
    _check_user_error(argv, named, capsys)


def test_the_sweep_holds_the_tagged_tests_of_config_refusals_values_and_generate() -> None:
    tagged = {key.split("[")[0] for key in SWEPT}
    assert {
        "test_config_refusals::test_refused_at_start_with_exit_2",
        "test_cli_main::test_user_errors_exit_2_without_traceback",
        "test_config_validate::test_wrong_type",
        "test_config_validate::test_out_of_range",
        "test_config_validate::test_other_enums",
        "test_generate_cmd::test_bad_inputs_exit_2_with_the_row",
    } <= tagged


def test_a_read_only_run_directory_is_refused_before_any_work(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "ro"
    run_dir.mkdir()
    run_dir.chmod(0o555)
    if os.access(run_dir, os.W_OK):  # root writes anyway: make the write fail as a read-only mount does
        real = Path.write_bytes

        def read_only(self: Path, data: bytes) -> int:
            if self.parent == run_dir:
                raise OSError(errno.EROFS, "Read-only file system", str(self))
            return real(self, data)

        monkeypatch.setattr(Path, "write_bytes", read_only)
    line = _check_user_error(train_argv(model_dir, run_dir), "trainer.default_local_dir", capsys)
    assert str(run_dir) in line and ("read-only" in line or "Permission denied" in line)
    run_dir.chmod(0o755)


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(
    model_dir: Path,
    trained: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import torch.distributed.checkpoint.filesystem as dcp_fs

    def no_space(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    run_dir = copy_of(trained, tmp_path / "run")
    monkeypatch.setattr(dcp_fs, "_write_item", no_space)
    line = _check_user_error(
        train_argv(model_dir, run_dir, "trainer.total_training_steps=2"), "disk is full", capsys
    )
    assert str(run_dir) in line and "it needs about" in line
    assert sorted(p.name for p in run_dir.iterdir() if "global_step" in p.name) == ["global_step_1"]
    shutil.rmtree(run_dir)


def _no_space_for_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fills while transformers writes model.safetensors: half a file, then safetensors' own error
    (what a full filesystem gives: a SafetensorError, not an OSError)."""
    import safetensors
    import transformers.modeling_utils as modeling_utils

    def no_space(tensors: object, filename: str, metadata: object = None) -> None:
        Path(filename).write_bytes(b"\0" * 1024)
        raise safetensors.SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    monkeypatch.setattr(modeling_utils, "safe_save_file", no_space)


@pytest.mark.parametrize("save_freq", [0, 1])
def test_a_full_disk_writing_final_model_exits_2_and_keeps_what_was_saved(
    model_dir: Path,
    trained: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    save_freq: int,
) -> None:
    # issue 59: an internal error, and with trainer.save_freq=0 the trained policy was lost without a word
    run_dir = copy_of(trained, tmp_path / "run")  # global_step_1 and the final_model of step 1
    earlier = {p.name: p.read_bytes() for p in (run_dir / "final_model").iterdir()}
    _no_space_for_weights(monkeypatch)
    argv = train_argv(model_dir, run_dir, "trainer.total_training_steps=2", f"trainer.save_freq={save_freq}")
    line = _check_user_error(
        argv, f"the disk is full: writing the trained model to {run_dir / 'final_model'}", capsys
    )
    assert "it needs about" in line
    if save_freq:
        assert (
            f"the checkpoint {run_dir / 'global_step_2'} holds the trained weights: hybridflow export" in line
        )
    else:
        assert line.endswith("no checkpoint holds step 2 (trainer.save_freq=0)")
    assert {p.name: p.read_bytes() for p in (run_dir / "final_model").iterdir()} == earlier
    assert (run_dir / "global_step_1" / "meta.json").is_file()  # nothing already saved is removed
    assert not [p.name for p in run_dir.iterdir() if p.name.startswith(".final_model")]


@pytest.mark.parametrize("where", ["weights", "tokenizer files"])
def test_a_full_disk_during_export_exits_2_and_keeps_the_earlier_export(
    trained: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    where: str,
) -> None:
    out = tmp_path / "exported"
    assert main(["export", str(trained), "--out", str(out)]) == 0
    earlier = {p.name: p.read_bytes() for p in out.iterdir()}
    if where == "weights":
        _no_space_for_weights(monkeypatch)
    else:  # shutil's copy raises ENOSPC without a file name

        def no_space(src: object, dst: object, **kwargs: object) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(shutil, "copy2", no_space)
    argv = ["export", str(trained), "--out", str(out), "--overwrite"]
    line = _check_user_error(argv, f"the disk is full: writing the exported actor to {out} failed", capsys)
    assert "it needs about" in line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == earlier
    assert [p.name for p in tmp_path.iterdir()] == ["exported"]  # the partial export is gone


def test_every_checkpoint_damaged_is_refused_unless_a_fresh_start_is_asked_for(
    model_dir: Path, trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = copy_of(trained, tmp_path / "run")
    shard = shard_of(run_dir / "global_step_1")
    flip_bytes(shard)
    damaged = shard.read_bytes()
    line = _check_user_error(
        train_argv(model_dir, run_dir, "trainer.total_training_steps=1"), "every checkpoint", capsys
    )
    assert f"global_step_1: {shard} does not match the checksum" in line and "trainer.resume=disable" in line
    assert shard.read_bytes() == damaged and metrics_steps(run_dir) == [1]  # nothing overwritten
    # asked for: a fresh start, whose save replaces the damaged checkpoint
    assert (
        main(train_argv(model_dir, run_dir, "trainer.total_training_steps=1", "trainer.resume=disable")) == 0
    )
    assert shard_of(run_dir / "global_step_1").read_bytes() != damaged


def test_the_same_model_elsewhere_resumes_and_a_checkpoint_without_a_record_with_a_notice(
    model_dir: Path, trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The identity is the starting model's content: a copy at another path is the same model."""
    run_dir = copy_of(trained, tmp_path / "run")
    moved = copy_of(model_dir, tmp_path / "moved")
    assert main(train_argv(moved, run_dir, "trainer.total_training_steps=2")) == 0
    assert "resumed from" in capsys.readouterr().err and metrics_steps(run_dir) == [1, 2]
    meta_path = run_dir / "global_step_2" / "meta.json"
    meta = json.loads(meta_path.read_text())
    assert meta["models"]["actor"]["path"] == str(moved.resolve())  # the run's model, recorded again
    del meta["models"]  # as saved before the record existed
    meta_path.write_text(json.dumps(meta))
    assert main(train_argv(model_dir, run_dir, "trainer.total_training_steps=3")) == 0
    err = capsys.readouterr().err
    assert "does not record which model it was trained from" in err and metrics_steps(run_dir) == [1, 2, 3]
