"""The FSDP2 critic engine: values against a direct forward, and rank-count-independent updates."""

from __future__ import annotations

import pytest
import torch
from support.batches import NORMAL, draw_fields
from support.dist_util import run_world_kept as run_world
from test_actor import B, R, make_batch

from hybridflow.config.schema import CriticConfig
from hybridflow.models import build_tiny_model, build_value_model


def critic_model() -> torch.nn.Module:
    return build_value_model(build_tiny_model("qwen2", vocab_size=64, hidden_size=32, seed=3), head_seed=1)


def critic_config() -> CriticConfig:
    cfg = CriticConfig()
    cfg.ppo_micro_batch_size_per_gpu = 3
    cfg.ppo_epochs = 2
    cfg.optim.lr = 1e-2
    return cfg


def with_targets(batch):
    return draw_fields(batch, 5, values=NORMAL, returns=NORMAL)


def train(rank: int, world: int, remove_padding: bool) -> dict:
    from hybridflow.engine.parallel.fsdp import full_state_dict
    from hybridflow.engine.roles.critic import CriticEngine

    engine = CriticEngine(
        critic_model(), critic_config(), ppo_mini_batch_size=4, use_remove_padding=remove_padding
    )
    rows = [i for m in range(0, B, 4) for i in range(m + rank * 4 // world, m + (rank + 1) * 4 // world)]
    batch = with_targets(make_batch())[rows]
    values = engine.compute_values(batch)
    metrics = engine.update_critic(batch)
    state = full_state_dict(engine.module)  # a collective: every rank takes part
    return {
        "values": values,
        "metrics": metrics,
        "state": state if rank == 0 else None,
    }


@torch.no_grad()
def direct_values() -> torch.Tensor:
    model = critic_model()
    batch = make_batch()
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
    ).logits[..., 0]  # (B, T)
    return out[:, -R - 1 : -1] * batch["response_mask"]


def test_critic_values_and_updates_match_across_layouts() -> None:
    one = run_world(1, train, 1, False)[0]
    torch.testing.assert_close(one["values"], direct_values(), rtol=1e-4, atol=1e-5)
    two = run_world(2, train, 2, False)
    torch.testing.assert_close(
        torch.cat([two[0]["values"][:2], two[1]["values"][:2], two[0]["values"][2:], two[1]["values"][2:]]),
        one["values"],
        rtol=1e-4,
        atol=1e-5,
    )
    packed = run_world(1, train, 1, True)[0]
    for other, atol in ((two[0], 1e-5), (packed, 1e-4)):
        for key, value in one["metrics"].items():
            assert value == pytest.approx(other["metrics"][key], rel=1e-4, abs=1e-6), key
        for name, tensor in one["state"].items():
            torch.testing.assert_close(tensor, other["state"][name], rtol=1e-4, atol=atol, msg=name)
    assert set(one["metrics"]) == {
        "critic/vf_loss",
        "critic/vf_clipfrac",
        "critic/vpred_mean",
        "critic/grad_norm",
        "critic/lr",
        "critic/skipped_steps",
    }
    assert one["metrics"]["critic/vf_loss"] > 0
