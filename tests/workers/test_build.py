"""Building a rank's roles: which engines give up their moments for a rollout short of room."""

from __future__ import annotations

import pytest
from support.dist_util import run_world_kept as run_world


def donors(rank: int, actor: str, critic: str) -> list[str]:
    """The roles whose engines the actor may take moments from, for these ``optimizer_offload`` settings."""
    from hybridflow.config import load_config
    from hybridflow.models import build_tiny_model
    from hybridflow.workers.build import build_roles

    overrides = [f"actor.fsdp.optimizer_offload={actor}", f"critic.fsdp.optimizer_offload={critic}"]
    cfg = load_config(None, [*overrides, "algorithm.adv_estimator=gae", "actor.use_torch_compile=false"])
    model = build_tiny_model("qwen2", vocab_size=64, hidden_size=32, num_hidden_layers=2, seed=1)
    roles = build_roles(cfg, model, total_steps=1, pad_id=0)
    engines = {name: role.engine.engine for name, role in roles.items() if name in ("actor", "critic")}
    return [name for d in roles["actor"].room_donors for name, e in engines.items() if e is d]


@pytest.mark.parametrize(
    ("actor", "critic", "want"),
    [("auto", "auto", ["actor", "critic"]), ("false", "auto", ["critic"]), ("auto", "true", ["actor"])],
)
def test_the_rollout_takes_room_from_the_auto_roles_actor_first(actor: str, critic: str, want: list) -> None:
    (got,) = run_world(1, donors, actor, critic)
    assert got == want
