"""On the GPU: a resumed run continues the uninterrupted one, with the fused AdamW, offloaded or not.

On CUDA the engines take torch's fused AdamW, whose step counters live on the GPU, and offloading moves
parameters and moments between phases; the CPU suite covers neither (nothing moves on CPU, and the CPU
optimizer is the foreach one). Run on the GPU machine with ``pytest -m gpu tests/trainer``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_checkpointing import argv, metrics

from hybridflow.cli.main import main
from hybridflow.models import build_tiny_model_and_tokenizer

pytestmark = pytest.mark.gpu

# Eager layers: compiling would only cost time here.
EAGER = ["actor.use_torch_compile=false", "critic.use_torch_compile=false"]
OFFLOAD = {
    "none": [],
    "optimizer": ["actor.fsdp.optimizer_offload=true", "critic.fsdp.optimizer_offload=true"],
    "params": ["actor.fsdp.param_offload=true", "critic.fsdp.param_offload=true"],
    "params_and_optimizer": [
        f"{role}.fsdp.{what}_offload=true" for role in ("actor", "critic") for what in ("param", "optimizer")
    ],
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("model")
    build_tiny_model_and_tokenizer(out_dir=out, hidden_size=32, num_hidden_layers=2)
    return out


@pytest.mark.parametrize("offload", sorted(OFFLOAD))
def test_a_resumed_run_continues_the_uninterrupted_one(
    tmp_path: Path, tiny_model: Path, offload: str
) -> None:
    extra = [*EAGER, *OFFLOAD[offload], "trainer.total_training_steps=4", "trainer.save_freq=2"]
    straight = tmp_path / "straight" / "run"
    straight.parent.mkdir()
    assert main(argv(tiny_model, straight, *extra)) == 0

    resumed = tmp_path / "resumed" / "run"
    resumed.parent.mkdir()
    assert main(argv(tiny_model, resumed, *extra, f"trainer.resume={straight / 'global_step_2'}")) == 0

    want, got = metrics(straight), metrics(resumed)
    assert sorted(got) == [3, 4]
    # Step 4 scores the weights step 3's update made from the restored moments and step counters.
    for step in (3, 4):
        assert got[step].keys() == want[step].keys()
        for key, value in want[step].items():
            if key.startswith("memory/"):
                continue  # the allocator's peaks differ between processes
            assert got[step][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (step, key)
    assert any(want[s]["actor/pg_loss"] != 0 for s in (3, 4))
