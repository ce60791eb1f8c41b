"""GRPO with FP8 rollout weights (``rollout.quantization=fp8``) through ``hybridflow train`` on CPU.

The rollout samples from FP8 projections (rowwise scales, quantised at every switch), the trainer
recomputes in float32: the mismatch metrics show the gap, token-level truncated importance weights are on by
default and weigh the update (they vary), and every family runs or is refused at start in one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.realistic import realistic_rows, write_jsonl

from hybridflow.cli.main import main
from hybridflow.models import build_tiny_model_and_tokenizer

REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(map(ord, solution_str)) % 11 / 10
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8")
    (root / "reward.py").write_text(REWARD)
    return {"root": root, "train": write_jsonl(realistic_rows(8, seed=3), root / "train.jsonl")}


def run(data: dict[str, Path], arch: str, run_dir: Path, *extra: str) -> int:
    model = data["root"] / arch
    if not model.exists():
        build_tiny_model_and_tokenizer(out_dir=model, arch=arch, hidden_size=32, num_hidden_layers=2)
    return main(
        [
            "train",
            f"model.path={model}",
            f"data.train_files=[{data['train']}]",
            f"reward.custom_function.path={data['root'] / 'reward.py'}",
            f"trainer.default_local_dir={run_dir}",
            "algorithm.adv_estimator=grpo",
            "data.max_prompt_length=400",
            "data.max_response_length=12",
            "data.train_batch_size=4",
            "rollout.n=2",
            "actor.ppo_mini_batch_size=4",
            "actor.ppo_micro_batch_size_per_gpu=8",
            "trainer.total_training_steps=2",
            "trainer.test_freq=0",
            "trainer.val_before_train=false",
            "trainer.device=cpu",
            "trainer.logger=[console]",
            "trainer.save_freq=0",
            "rollout.quantization=fp8",
            *extra,
        ]
    )


def metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows}


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama", "mixtral"])
def test_grpo_with_fp8_rollout_logs_the_mismatch_and_weighs_the_tokens(
    data: dict[str, Path], tmp_path: Path, arch: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO")
    assert run(data, arch, tmp_path / "run") == 0
    for step, m in metrics(tmp_path / "run").items():
        assert m["rollout_corr/log_prob_abs_diff_max"] > 1e-4, step  # the FP8 policy samples, not float32's
        assert m["rollout_corr/log_prob_abs_diff_mean"] < 0.1, step  # ... close to it
        assert m["rollout_corr/rollout_is_std"] > 0, step  # token-level weights, on by default, not all 1
        assert "rollout_corr/kl" in m and "actor/pg_loss" in m
    text = caplog.text
    assert "projections in FP8" in text and "rollout_is=token" in text


def test_a_family_the_engine_does_not_run_is_refused_with_fp8(
    data: dict[str, Path], tmp_path: Path, capsys
) -> None:
    assert run(data, "gpt2", tmp_path / "run") == 2
    err = capsys.readouterr().err
    assert "rollout.quantization=fp8" in err and "set rollout.quantization=null" in err


def test_grpo_with_the_weight_only_fp8_kernel(data: dict[str, Path], tmp_path: Path, caplog) -> None:
    from hybridflow.engine.ops.fp8 import current_kernel, use_kernel

    caplog.set_level("INFO")
    before = current_kernel()
    try:
        assert run(data, "qwen2", tmp_path / "run", "rollout.quantization_kernel=w8a16") == 0
        assert current_kernel() == "w8a16"
    finally:
        use_kernel(before)
    for step, m in metrics(tmp_path / "run").items():
        # FP8 weights, activations not quantised: a gap from float32 still, smaller than W8A8's bound above.
        assert (
            m["rollout_corr/log_prob_abs_diff_max"] > 1e-5 and m["rollout_corr/log_prob_abs_diff_mean"] < 0.1
        ), step


@pytest.mark.parametrize(
    ("arch", "kernel"),
    [
        ("qwen2", "scaled_mm_static"),
        ("llama", "scaled_mm_static"),
        ("qwen3", "triton_w8a8"),  # the Triton kernel in the CPU interpreter (tests/conftest.py)
        ("mixtral", "triton_w8a8"),  # MoE: attention in FP8, experts and router in the rollout dtype
    ],
)
def test_grpo_with_static_activation_scales(
    data: dict[str, Path], tmp_path: Path, arch: str, kernel: str, caplog: pytest.LogCaptureFixture
) -> None:
    from hybridflow.engine.ops.fp8 import current_kernel, use_kernel

    caplog.set_level("DEBUG", logger="hybridflow.engine.rollout.forward")
    before = current_kernel()
    try:
        args = (f"rollout.quantization_kernel={kernel}", "rollout.quantization_force=true")
        assert run(data, arch, tmp_path / "run", *args) == 0
        assert current_kernel() == kernel
    finally:
        use_kernel(before)
    for step, m in metrics(tmp_path / "run").items():
        # W8A8 with the scales calibrated on each step's first prefill: the gap W8A8's is, TIS weighing it
        assert 1e-4 < m["rollout_corr/log_prob_abs_diff_mean"] < 0.1, step
        assert m["rollout_corr/rollout_is_std"] > 0, step
    # once per step: the first prefill after each switch (the weights changed) sets the scales again
    assert caplog.text.count("FP8 static activation scales calibrated") == len(metrics(tmp_path / "run"))


def test_an_unknown_fp8_kernel_is_refused_at_start(data: dict[str, Path], tmp_path: Path, capsys) -> None:
    assert run(data, "qwen2", tmp_path / "run", "rollout.quantization_kernel=cutlass") == 2
    err = capsys.readouterr().err
    assert "rollout.quantization_kernel" in err and "auto, w8a16, scaled_mm" in err


def test_grpo_with_fp8_weights_and_an_fp8_kv_cache(
    data: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO")
    assert run(data, "qwen2", tmp_path / "run", "rollout.kv_cache_dtype=fp8") == 0
    for step, m in metrics(tmp_path / "run").items():
        assert 1e-4 < m["rollout_corr/log_prob_abs_diff_mean"] < 0.1, step
    assert "the KV cache is FP8" in caplog.text  # rank 0's line, with the pool's blocks


def test_a_family_the_engine_does_not_run_is_refused_with_an_fp8_kv_cache(
    data: dict[str, Path], tmp_path: Path, capsys
) -> None:
    assert run(data, "gpt2", tmp_path / "run", "rollout.quantization=null", "rollout.kv_cache_dtype=fp8") == 2
    err = capsys.readouterr().err
    assert "rollout.kv_cache_dtype=fp8" in err and "set rollout.kv_cache_dtype=auto" in err
