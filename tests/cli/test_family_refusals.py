"""Layouts a model family cannot take are refused at start, naming the key, the family and what runs.

GPT-2 has no tensor-parallel shard rules (nor a Llama-style decoder for pipeline stages or Ulysses, nor
experts for expert parallelism), and a mixture of experts' tensor-parallel rollout needs sizes that slice every
expert. Asking for more is a user error (exit 2, one line), never a missing-rule crash on some rank.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support import cli_cases

from hybridflow.cli.main import main
from hybridflow.models import build_tiny_model_and_tokenizer

TWO_RANKS = (
    "trainer.n_gpus_per_node=2",
    "data.train_batch_size=4",
    "rollout.n=2",
    "actor.ppo_mini_batch_size=4",
    "actor.ppo_micro_batch_size_per_gpu=2",
    "rollout.log_prob_micro_batch_size_per_gpu=2",
    "data.max_response_length=6",
    "data.task_train_size=12",
    "data.task_val_size=4",
    "trainer.device=cpu",
)


def model_of(folder: Path, arch: str) -> Path:
    """A tiny model of ``arch`` (two layers) saved under ``folder`` (once per folder); ``arch:N``: with
    intermediate size N."""
    name, _, inter = arch.partition(":")
    out = folder / arch.replace(":", "-")
    if not (out / "config.json").exists():
        sizes = {"intermediate_size": int(inter)} if inter else {}
        build_tiny_model_and_tokenizer(out_dir=out, arch=name, hidden_size=32, num_hidden_layers=2, **sizes)
    return out


def argv(model: Path, run_dir: Path, extra: list[str]) -> list[str]:
    return ["train", f"model.path={model}", f"trainer.default_local_dir={run_dir}", *TWO_RANKS, *extra]


def _swept(env: cli_cases.Env, arch: str, extra: list[str], named: str, says: str) -> tuple[list[str], str]:
    """One case of the test below as the reliability sweep runs it."""
    return argv(model_of(env.tmp, arch), env.tmp / "run", extra), named


@cli_cases.sweep(_swept)
@pytest.mark.parametrize(
    "arch,extra,named,says",
    [
        ("gpt2", ["rollout.tensor_model_parallel_size=2"], "rollout.tensor_model_parallel_size=2", "'gpt2'"),
        (  # experts of 33 rows (moe_intermediate_size): tp = 2 cannot slice them
            "qwen2_moe:66",
            ["rollout.tensor_model_parallel_size=2"],
            "rollout.tensor_model_parallel_size=2",
            "moe_intermediate_size=33",
        ),
        ("gpt2", ["actor.parallel.ep=2"], "actor.parallel.ep=2", "'gpt2' is a dense model"),
        (
            "gpt2",
            ["actor.tensor_parallel_size=2"],
            "actor.tensor_parallel_size=2",
            "has shard rules for llama",
        ),
        ("gpt2", ["actor.pipeline_parallel_size=2"], "actor.pipeline_parallel_size=2", "not 'gpt2'"),
        (
            "gpt2",
            ["actor.ulysses_sequence_parallel_size=2", "model.use_remove_padding=true"],
            "actor.ulysses_sequence_parallel_size=2",
            "not 'gpt2'",
        ),
    ],
)
def test_a_layout_the_family_cannot_take_is_refused_at_start(
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    arch: str,
    extra: list[str],
    named: str,
    says: str,
) -> None:
    models = tmp_path_factory.getbasetemp() / "family_models"
    models.mkdir(exist_ok=True)
    assert main(argv(model_of(models, arch), tmp_path / "run", extra)) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    assert errors[0].startswith(f"error: {named}") and says in errors[0]
    assert f"{named[:-2]}=1" in errors[0]  # the fix
