"""The planner knows LoRA: the base in bf16 without optimizer state, the adapters' float32 state, no
reference copy, and the rollout's merge buffers (or none, merged in place)."""

from __future__ import annotations

import pytest

from hybridflow.cli.main import main
from hybridflow.config import load_config
from hybridflow.plan.search import plan_layout
from hybridflow.plan.shapes import shape_config

GB = 10**9
WORK = [
    "data.train_batch_size=8",
    "rollout.n=8",
    "data.max_prompt_length=256",
    "data.max_response_length=512",
    "actor.ppo_mini_batch_size=8",
    "actor.use_kl_loss=true",
    "trainer.n_gpus_per_node=1",
]
LEVERS = [  # one layout: the planner's levers given
    "model.enable_gradient_checkpointing=true",
    "actor.ppo_micro_batch_size_per_gpu=1",
    "actor.fsdp.optimizer_offload=false",
    "actor.fsdp.param_offload=false",
    "actor.fsdp.optimizer_step_on_cpu=false",
]
FIXED = {lever.split("=")[0] for lever in LEVERS}


def plan(*extra: str):
    cfg = load_config(None, [*WORK, *LEVERS, *extra])
    return plan_layout(cfg, shape_config("qwen2.5-7b"), 24 * GB, given=FIXED)


def test_lora_charges_the_adapters_state_and_no_reference_copy() -> None:
    full, lora = plan(), plan("model.lora_rank=64")
    params = 7.62e9
    adapters = lora.state[2]  # rank 64 on every linear of the 28 layers: about 161M elements
    assert 150e6 < adapters < 170e6
    assert lora.state[0] == adapters * 16  # fp32 master, gradient and two moments, nothing for the base
    # The full run holds fp32 masters + moments + a bf16 reference copy; LoRA the bf16 base and the adapters.
    assert full.phases["update_actor"] - lora.phases["update_actor"] > params * (4 + 4 + 8) * 0.9
    assert "LoRA r=64" in lora.table() and "base 15.23 GB bf16" in lora.table()


def test_in_place_merging_saves_the_merge_buffers() -> None:
    buffer, in_place = plan("model.lora_rank=64"), plan("model.lora_rank=64", "rollout.lora_merge=in_place")
    saved = buffer.phases["generate"] - in_place.phases["generate"]
    assert saved == pytest.approx(6.5e9 * 2, rel=0.05)  # the adapted projections in bf16
    assert in_place.host - buffer.host == saved  # the base's host copy
    assert in_place.phases["update_actor"] == buffer.phases["update_actor"]


def test_hybridflow_plan_prints_lora(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--gpus", "1", "--gpu-memory-gb", "24", "--model-shape", "qwen2.5-7b", *WORK, *LEVERS]
    assert main([*args, "model.lora_rank=64", "rollout.lora_merge=in_place"]) == 0
    out = capsys.readouterr().out
    assert (
        "training state 2.58 GB (LoRA r=64: fp32 adapters, grads, AdamW moments; base 15.23 GB bf16)" in out
    )
    assert "tensor_parallel_size=1" in out  # LoRA runs on FSDP2 views: no split is proposed
