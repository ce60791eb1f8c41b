"""Preference updates on the FSDP2 engine: the loss matches a direct computation, and 2 ranks match 1
(FSDP2 over both, and two pipeline stages)."""

from __future__ import annotations

import os

import pytest
import torch
from support.batches import Draw, rollout_batch
from support.dist_util import run_world_kept as run_world

from hybridflow.algos.preference import dpo_loss, kto_kl_estimate, kto_loss
from hybridflow.config.preference import PreferenceConfig
from hybridflow.config.schema import ActorConfig
from hybridflow.models import build_tiny_model
from hybridflow.protocol import Batch

R, PAIRS = 4, 4  # response length, pairs


def pair_batch() -> Batch:
    """4 pairs as 8 adjacent rows ([c0, r0, c1, r1, ...]), varied lengths, with reference values."""
    batch = rollout_batch(
        [4, 3, 2, 4, 3, 4, 1, 3],  # prompt lengths (left-padded to 4)
        [4, 3, 2, 4, 1, 3, 4, 2],  # response lengths
        R,
        seed=5,
        ref_seq_logps=Draw(-14.0, -10.0, per_row=True),
    )
    batch["labels"] = torch.tensor([True, False, False, False, True, False, False, False])
    return batch


@torch.no_grad()
def direct_sequence_logps(lm: torch.nn.Module, batch: Batch) -> torch.Tensor:
    """Sum of response-token log-probs per row from a plain HF forward, one unpadded row at a time."""
    out = []
    for b in range(len(batch)):
        keep = batch["attention_mask"][b].bool()
        seq = batch["input_ids"][b][keep][None]
        n = int(batch["response_mask"][b].sum())
        logp = torch.log_softmax(lm(seq).logits[0].float(), -1)
        start = seq.shape[1] - n
        out.append(sum(logp[start - 1 + j, seq[0, start + j]] for j in range(n)))
    return torch.stack(out)


def update(rank: int, kind: str, loss_type: str, pp: int = 1) -> dict:
    """One preference step in the view of ``pp`` pipeline stages (1: FSDP2 over every rank)."""
    from hybridflow.engine.parallel.dims import ParallelDims
    from hybridflow.engine.parallel.fsdp import full_state_dict
    from hybridflow.engine.roles.actor import ActorEngine
    from hybridflow.engine.roles.preference import update_preference

    world = int(os.environ["WORLD_SIZE"])
    cfg = ActorConfig()
    cfg.optim.lr = 1e-2
    lm = build_tiny_model("qwen2", vocab_size=64, hidden_size=32, num_hidden_layers=2, seed=3)
    view = ParallelDims(world, 1, pp)
    engine = ActorEngine(lm, cfg, dims=view)
    full = pair_batch()
    dp_rank, dp = view.coords(rank)[2], view.dp  # a replica's ranks (its stages) share its rows
    mine = full[list(range(dp_rank * 2 * PAIRS // dp, (dp_rank + 1) * 2 * PAIRS // dp))]
    p = PreferenceConfig(
        loss_type=loss_type, beta=0.5, label_smoothing=0.1 if loss_type == "sigmoid" else 0.0
    )
    metrics = update_preference(engine, mine, p, kind, micro_pairs=1)
    state = full_state_dict(engine.module, engine.engine.pp_group)  # a collective: every rank calls it
    return {"metrics": metrics, "state": state if rank == 0 else None}


def update_in_both_views(rank: int, kind: str, loss_type: str) -> list[dict]:
    """FSDP2 over both ranks, then two pipeline stages (one layer each), in one pair of processes."""
    return [update(rank, kind, loss_type, pp) for pp in (1, 2)]


@pytest.mark.parametrize("kind,loss_type", [("dpo", "sigmoid"), ("kto", "sigmoid")])
def test_two_ranks_match_one_and_the_loss_is_the_direct_one(kind: str, loss_type: str) -> None:
    one = run_world(1, update, kind, loss_type)[0]
    for two in run_world(2, update_in_both_views, kind, loss_type)[0]:  # fsdp=2, then pp=2
        assert one["metrics"].keys() == two["metrics"].keys()
        for key, value in one["metrics"].items():
            assert two["metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
        assert one["state"].keys() == two["state"].keys()
        for name, tensor in one["state"].items():
            # One AdamW step at lr 1e-2 moves each weight by up to 1e-2; where a gradient is near zero, Adam's
            # normalisation turns the reduction-order noise of 2 ranks into up to ~1e-5 of that step.
            torch.testing.assert_close(two["state"][name], tensor, rtol=1e-4, atol=1e-4, msg=name)

    # The engine's loss (taken before its step) against the algos functions on a direct HF forward.
    lm = build_tiny_model("qwen2", vocab_size=64, hidden_size=32, num_hidden_layers=2, seed=3)
    batch = pair_batch()
    seq, ref = direct_sequence_logps(lm, batch), batch["ref_seq_logps"]
    if kind == "dpo":
        losses, chosen, rejected = dpo_loss(seq[0::2], seq[1::2], ref[0::2], ref[1::2], 0.5, "sigmoid", 0.1)
        assert one["metrics"]["rewards/accuracies"] == pytest.approx(
            float((chosen > rejected).float().mean())
        )
        assert one["metrics"]["logps/chosen"] == pytest.approx(float(seq[0::2].mean()), rel=1e-5)
    else:
        z0 = kto_kl_estimate(seq[1::2], ref[1::2])
        losses, _ = kto_loss(seq[0::2], ref[0::2], batch["labels"][0::2], z0, 0.5)
        assert one["metrics"]["kl"] == pytest.approx(float(z0), rel=1e-5, abs=1e-6)
    assert one["metrics"]["loss"] == pytest.approx(float(losses.mean()), rel=1e-5)
    assert one["metrics"]["actor/grad_norm"] > 0
