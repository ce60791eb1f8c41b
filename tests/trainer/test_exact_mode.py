"""``rollout.exact=true`` end to end: a GRPO run on the CPU whose rollout log-probs equal the trainer's at every
step (``rollout_corr/log_prob_abs_diff_max`` is exactly 0, and so is the first mini-batch's PPO KL), against a
run without it; and the settings exact mode refuses, each named with its fix, before anything loads.

The runs are child processes: exact mode switches torch's kernels for the whole process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_checkpointing import argv, start_cli

from hybridflow.config import load_config
from hybridflow.config.errors import ConfigError
from hybridflow.models import build_tiny_model_and_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model")
    build_tiny_model_and_tokenizer(out_dir=out, hidden_size=32, num_hidden_layers=2)
    return out


def run(model_dir: Path, tmp_path: Path, name: str, *extra: str) -> list[dict]:
    run_dir, log = tmp_path / name, tmp_path / f"{name}.log"
    args = argv(model_dir, run_dir, "trainer.total_training_steps=2", "trainer.save_freq=0", *extra)
    proc = start_cli([*args, "algorithm.adv_estimator=grpo", "data.max_response_length=16"], log)
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_an_exact_run_logs_no_mismatch_and_a_default_run_does(model_dir: Path, tmp_path: Path) -> None:
    exact = run(model_dir, tmp_path, "exact", "rollout.exact=true")
    default = run(model_dir, tmp_path, "default")
    assert all(r["rollout_corr/log_prob_abs_diff_max"] == 0.0 for r in exact)
    assert all(r["rollout_corr/kl"] == 0.0 for r in exact)
    assert any(r["rollout_corr/log_prob_abs_diff_max"] > 0.0 for r in default)
    assert any(r["actor/grad_norm"] > 0 for r in exact)  # it trained (pg_loss is 0: the ratio is exactly 1)


@pytest.mark.parametrize(
    "setting, named",
    [
        ("rollout.engine=hf", "rollout.engine"),
        ("rollout.quantization=fp8", "rollout.quantization"),
        ("rollout.kv_cache_dtype=fp8", "rollout.kv_cache_dtype"),
        ("rollout.compile_decode=true", "rollout.compile_decode"),
        ("actor.use_torch_compile=true", "actor.use_torch_compile"),
        ("actor.ulysses_sequence_parallel_size=2", "actor.parallel.sp"),
        ("model.lora_rank=8", "model.lora_rank"),
    ],
)
def test_what_exact_mode_refuses_is_named_with_its_fix(setting: str, named: str) -> None:
    overrides = ["rollout.exact=true", setting, "trainer.n_gpus_per_node=2"]
    with pytest.raises(ConfigError) as caught:
        load_config(None, overrides)
    text = str(caught.value)
    assert named in text and "rollout.exact=false" in text, text


def test_exact_mode_packs_sequences_and_leaves_the_actor_uncompiled() -> None:
    cfg = load_config(None, ["rollout.exact=true"])
    assert cfg.model.use_remove_padding and cfg.actor.use_torch_compile is False
    assert load_config(None, []).actor.use_torch_compile is None  # untouched without it
