"""Router replay (R3) and the MoE update terms in the actor engine, on a tiny Mixtral in one gloo process."""

from __future__ import annotations

import copy

import pytest
import torch
from support.batches import NORMAL, rollout_batch
from support.dist_util import run_world_kept as run_world

from hybridflow.config.schema import ActorConfig
from hybridflow.models import build_tiny_model
from hybridflow.models.moe import NO_EXPERT, install_moe, keep_records, moe_blocks, records
from hybridflow.protocol import Batch

PROMPT_LENGTHS = [6, 3, 5, 2]
RESPONSE_LENGTHS = [5, 2, 4, 1]
R = 5


def _policy(seed: int = 1) -> torch.nn.Module:
    lm = build_tiny_model("mixtral", vocab_size=64, hidden_size=32, num_hidden_layers=2, seed=seed)
    install_moe(lm)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(7)
        for block in moe_blocks(lm):
            block.gate.weight.normal_(0, 0.5)
    return lm


def _rollout_routing(lm: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """What the rollout would record: each real token's experts (B, T, L, k), 255 at padding and at the
    last response token (never fed to the model)."""
    keep_records(lm, True)
    with torch.no_grad():
        lm(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        )
    B, T = batch["input_ids"].shape
    ids = torch.stack([r.ids for r in records(lm)], 1).view(B, T, len(records(lm)), -1).to(torch.uint8)
    keep_records(lm, False)
    mask = batch["attention_mask"].bool().clone()
    last = mask.long().cumsum(1).argmax(1)  # each row's last real column
    mask[torch.arange(B), last] = False
    return torch.where(mask[:, :, None, None], ids, torch.full_like(ids, NO_EXPERT))


def replay(rank: int) -> dict:
    from hybridflow.engine.roles.actor import ActorEngine

    out: dict = {}
    base = _policy()
    batch = rollout_batch(PROMPT_LENGTHS, RESPONSE_LENGTHS, R, 3, advantages=NORMAL)
    routed = _rollout_routing(copy.deepcopy(base), batch)
    perturbed = copy.deepcopy(base)
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(11)
        for block in moe_blocks(perturbed):
            block.gate.weight.add_(torch.randn_like(block.gate.weight))
    cfg = ActorConfig()
    cfg.ppo_mini_batch_size, cfg.ppo_micro_batch_size_per_gpu, cfg.optim.lr = 4, 2, 1e-2
    for packed in (True, False):
        # Packed: no auxiliary loss, so a moving router shows the policy loss's gradient reaches it through
        # the replayed experts' weights; padded: the auxiliary loss on top (its grad norm differs).
        cfg.router_aux_loss_coef = 0.0 if packed else 0.02
        same = ActorEngine(copy.deepcopy(base), cfg, use_remove_padding=packed)
        plain = same.compute_log_prob(batch)["log_probs"]
        with_routing = batch.union(Batch({"routed_experts": routed}))
        out[f"self_replay_{packed}"] = (same.compute_log_prob(with_routing)["log_probs"] - plain).abs().max()
        moved = ActorEngine(copy.deepcopy(perturbed), cfg, use_remove_padding=packed)
        out[f"free_{packed}"] = (moved.compute_log_prob(batch)["log_probs"] - plain).abs().max()
        out[f"replayed_{packed}"] = (moved.compute_log_prob(with_routing)["log_probs"] - plain).abs().max()
        used = torch.stack([r.ids for r in records(moved.engine.module.lm)], 1)  # (N, L, k) of the last pass
        want = routed.flatten(0, 1)
        if packed:
            want = want[batch["attention_mask"].reshape(-1).bool()]
        valid = (want != NO_EXPERT).all(-1).all(-1)
        out[f"used_{packed}"] = bool(torch.equal(used[valid], want[valid].long()))
        router_before = [b.gate.weight.detach().clone() for b in moe_blocks(moved.engine.module.lm)]
        with_routing["old_log_probs"] = moved.compute_log_prob(with_routing)["log_probs"]
        out[f"metrics_{packed}"] = moved.update_policy(with_routing)
        after = [b.gate.weight.detach() for b in moe_blocks(moved.engine.module.lm)]
        out[f"router_moved_{packed}"] = all(not torch.equal(a, b) for a, b in zip(router_before, after))
    return out


def test_router_replay_selects_the_rollout_experts_and_the_router_learns() -> None:
    (out,) = run_world(1, replay)
    for packed in (True, False):
        assert out[f"self_replay_{packed}"] < 1e-6  # replaying a model's own choice changes nothing
        assert out[f"used_{packed}"]  # every routed token ran the rollout's experts
        # A perturbed router picks other experts; replay brings the log-probs back towards the rollout's
        # (not exactly: the weights of the replayed experts come from the perturbed router's own scores).
        assert out[f"replayed_{packed}"] < out[f"free_{packed}"]
        metrics = out[f"metrics_{packed}"]
        assert 0 < metrics["moe/router_agreement"] < 1
        assert metrics["moe/aux_loss"] > 0 and metrics["moe/expert_load_max"] >= 1
        assert out[f"router_moved_{packed}"]  # the router still gets a gradient under replay
    # Same data and weights either way: only the auxiliary loss's gradient tells the two updates apart.
    assert out["metrics_True"]["moe/aux_loss"] == pytest.approx(
        out["metrics_False"]["moe/aux_loss"], rel=1e-6
    )
    assert out["metrics_True"]["actor/grad_norm"] != pytest.approx(
        out["metrics_False"]["actor/grad_norm"], rel=1e-4
    )
