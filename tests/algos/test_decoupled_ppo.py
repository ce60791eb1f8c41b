"""AReaL's decoupled PPO as the asynchronous trainer builds it: token-level truncated importance weights
pi_prox / pi_behav (the rollout correction) times the clipped surrogate on pi / pi_prox (the vanilla loss)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from hybridflow.algos import compute_rollout_correction_and_rejection_mask, get_policy_loss_fn

CONFIG = SimpleNamespace(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0)


def case(seed: int) -> dict[str, torch.Tensor]:
    """Log-probs of the behaviour, proximal and current policies, advantages of both signs, a ragged mask."""
    g = torch.Generator().manual_seed(seed)
    prox = -torch.rand(4, 7, generator=g) * 3  # (B, T)
    return {
        "prox": prox,
        "behav": prox + torch.randn(4, 7, generator=g) * 0.5,  # older weights sampled these tokens
        "new": prox + torch.randn(4, 7, generator=g) * 0.3,
        "adv": torch.randn(4, 7, generator=g),
        "mask": (torch.arange(7)[None] < torch.tensor([[7], [3], [5], [1]])).float(),
    }


def decoupled(c: dict[str, torch.Tensor], behav: torch.Tensor) -> torch.Tensor:
    weights, _, _ = compute_rollout_correction_and_rejection_mask(
        c["prox"], behav, c["mask"], rollout_is="token", rollout_is_threshold=2.0
    )
    loss, _ = get_policy_loss_fn("vanilla")(
        c["prox"], c["new"], c["adv"], c["mask"], "token-mean", CONFIG, rollout_is_weights=weights
    )
    return loss


def test_it_is_ppo_when_the_behaviour_policy_is_the_proximal_one() -> None:
    c = case(0)
    ppo, _ = get_policy_loss_fn("vanilla")(c["prox"], c["new"], c["adv"], c["mask"], "token-mean", CONFIG)
    assert torch.equal(decoupled(c, c["prox"].clone()), ppo)


def test_it_weighs_each_token_by_its_truncated_proximal_over_behaviour_ratio() -> None:
    c = case(1)
    ratio = torch.exp(c["new"] - c["prox"])  # (B, T) pi / pi_prox
    surrogate = torch.maximum(-c["adv"] * ratio, -c["adv"] * ratio.clamp(0.8, 1.2))
    surrogate = torch.where(c["adv"] < 0, torch.minimum(surrogate, -c["adv"] * 3.0), surrogate)  # dual clip
    weight = torch.exp(c["prox"] - c["behav"]).clamp(max=2.0)  # pi_prox / pi_behav, truncated at C = 2
    want = (weight * surrogate * c["mask"]).sum() / c["mask"].sum()
    assert torch.allclose(decoupled(c, c["behav"]), want, atol=1e-6)
