"""Where router replay cannot run it is refused at start, naming the key and the fix."""

from __future__ import annotations

import pytest

from hybridflow.config import load_config
from hybridflow.models.families import check_router_replay
from hybridflow.models.tiny import build_tiny_model
from hybridflow.utils.errors import UserError

SIZES = {"tp": 1, "pp": 1, "sp": 1, "ep": 1}


def test_refusals_name_the_key_and_the_fix() -> None:
    moe = build_tiny_model("qwen3_moe", num_hidden_layers=1).config
    dense = build_tiny_model("qwen2", num_hidden_layers=1).config
    check_router_replay(dense, "off", "hf", SIZES)
    check_router_replay(moe, "r3", "native", SIZES)
    check_router_replay(moe, "r2", "hf", SIZES)
    with pytest.raises(UserError, match=r"not a mixture of experts.*router_replay=off"):
        check_router_replay(dense, "r3", "native", SIZES)
    many = build_tiny_model("qwen3_moe", num_hidden_layers=1).config
    many.num_experts = 256
    with pytest.raises(UserError, match="256 routed experts"):
        check_router_replay(many, "r2", "native", SIZES)
    with pytest.raises(UserError, match=r"rollout\.engine=native"):
        check_router_replay(moe, "r3", "hf", SIZES)
    with pytest.raises(UserError, match=r"actor\.pipeline_parallel_size=2 is not implemented"):
        check_router_replay(moe, "r3", "native", {**SIZES, "pp": 2})


def test_verl_spelling_and_a_bare_off() -> None:
    assert load_config(None, ["actor.router_replay=off"]).actor.router_replay == "off"  # YAML's false
    assert load_config(None, ["actor_rollout_ref.actor.router_replay.mode=R3"]).actor.router_replay == "r3"
    assert (
        load_config(None, ["actor_rollout_ref.actor.router_replay.mode=disabled"]).actor.router_replay
        == "off"
    )
