"""``rollout.dtype=auto`` means the training compute dtype on every device, as its help says (issue 25); an explicit
rollout dtype off it runs with ``rollout.allow_dtype_mismatch=true`` (issue 38)."""

from __future__ import annotations

import os

import pytest
from support.dist_util import run_world_kept as run_world


def rollout_dtypes(rank: int, overrides: list[str]) -> dict[str, str]:
    """The rollout's dtype and the actor's compute dtype of a tiny CPU actor built with ``overrides``."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU even on a GPU host (this process has not touched CUDA)
    from hybridflow.config import load_config
    from hybridflow.models import build_tiny_model
    from hybridflow.workers.actor import ActorWorker

    cfg = load_config(None, ["data.max_response_length=8", *overrides])
    model = build_tiny_model("qwen2", vocab_size=64, hidden_size=64, num_hidden_layers=1, seed=5)
    worker = ActorWorker(model, cfg, total_steps=1, pad_token_id=0)
    rollout = (
        worker.hybrid.weights.module if worker.hybrid.weights is not None else worker.hybrid.rollout.runner
    )
    dtype = rollout.dtype if hasattr(rollout, "dtype") else next(rollout.parameters()).dtype
    return {"rollout": str(dtype), "compute": str(worker.engine.engine.compute_dtype)}


@pytest.mark.parametrize("engine", ["native", "hf"])
@pytest.mark.parametrize("param_dtype", ["bfloat16", "float32"])
def test_auto_rollout_dtype_is_the_training_compute_dtype_on_cpu(engine: str, param_dtype: str) -> None:
    overrides = [f"rollout.engine={engine}", f"actor.fsdp.param_dtype={param_dtype}", "rollout.dtype=auto"]
    (got,) = run_world(1, rollout_dtypes, overrides)
    assert got == {"rollout": f"torch.{param_dtype}", "compute": f"torch.{param_dtype}"}


def test_an_explicit_rollout_dtype_is_kept_on_cpu() -> None:
    # off the training compute dtype: refused at start (tests/config/test_config_startup_checks.py) unless
    # the user opts in, as here
    overrides = [
        "actor.fsdp.param_dtype=float32",
        "rollout.dtype=bfloat16",
        "rollout.allow_dtype_mismatch=true",
    ]
    (got,) = run_world(1, rollout_dtypes, overrides)
    assert got == {"rollout": "torch.bfloat16", "compute": "torch.float32"}
