"""The micro-batch runners: the sequential one against a direct HF forward and one whole-batch backward, and
the pipelined one (two stages on two gloo processes) against the sequential one on the same batch."""

from __future__ import annotations

import pytest
import torch
from support.dist_util import run_world_kept as run_world
from test_actor import B, R, actor_config, make_batch, reference_log_probs

from hybridflow.models import build_tiny_model

# Uneven micro-batches, out of row order (as a token-budget split makes them).
PARTS = [[0, 3, 5], [1, 2], [4, 6, 7]]
TEMPERATURE = 0.7


def tiny_lm() -> torch.nn.Module:
    """Two decoder layers (one per pipeline stage), tied head, GQA."""
    return build_tiny_model("qwen2", vocab_size=64, hidden_size=32, num_hidden_layers=2, seed=4)


def rows_batch():
    batch = make_batch()
    batch["row"] = torch.arange(B)  # which rows each loss call saw
    return batch


def grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """This rank's parameter gradients, unsharded (FSDP2's DTensors gathered), by name."""
    out = {}
    for name, param in module.named_parameters():
        if param.grad is not None:
            grad = param.grad
            out[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
    return out


def run_passes(rank: int, world: int, parts: list[list[int]]) -> dict:
    """A forward pass, then one backward over ``parts`` of a loss using both outputs, with the engine's
    runner (world 2: two pipeline stages); what each returned, the loss calls' rows and the gradients."""
    from hybridflow.engine.parallel.dims import ParallelDims
    from hybridflow.engine.roles.actor import ActorEngine
    from hybridflow.engine.roles.runner import LogProbs

    dims = ParallelDims(world, 1, world)  # world 1: one stage; world 2: pp = 2
    engine = ActorEngine(tiny_lm(), actor_config(), use_remove_padding=True, dims=dims)
    runner, batch = engine.runner, rows_batch()
    with torch.no_grad():
        forward = runner.forward(batch, parts, LogProbs(TEMPERATURE, with_entropy=True))
    tokens = float(batch["response_mask"].sum())
    seen: list[list[int]] = []

    def loss(mb, outs):  # outs: log-probs, entropy (b, R)
        seen.append(mb["row"].tolist())
        mask = mb["response_mask"].to(outs[0].device)
        nll = -(outs[0] * mask).sum() / tokens
        value = nll - 0.01 * (outs[1] * mask).sum() / tokens
        return value, {"nll": nll.detach(), "rows": torch.tensor(float(len(mb)))}

    outputs = LogProbs(TEMPERATURE, with_entropy=True, entropy_grad=True)
    collected = runner.backward(batch, parts, outputs, loss, keep=True)
    return {
        "forward": [t.cpu() for t in forward],
        "kept": collected.kept,
        "sums": {k: v.cpu() for k, v in collected.sums.items()},
        "reduced": runner.reduce_sums(collected.sums, keys=("absent",)),
        "seen": seen,
        "grads": grads(engine.module),
    }


def split_and_whole(rank: int) -> list[dict]:
    """One process: the micro-batches of PARTS, then the batch as one micro-batch."""
    return [run_passes(rank, 1, parts) for parts in (PARTS, [list(range(B))])]


@pytest.fixture(scope="module")
def sequential() -> list[dict]:
    """The sequential runner's results (``split_and_whole``)."""
    return run_world(1, split_and_whole)[0]


def test_sequential_runner_scores_in_batch_order_and_accumulates_one_step(sequential: list[dict]) -> None:
    split, whole = sequential
    want = reference_log_probs(tiny_lm(), make_batch(), TEMPERATURE)  # HF, one unpadded row at a time
    logp, ent = split["forward"]
    assert logp.shape == ent.shape == (B, R)
    torch.testing.assert_close(logp, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent, whole["forward"][1], rtol=0, atol=1e-6)
    mask = make_batch()["response_mask"]
    assert (ent[mask == 0] == 0).all() and (ent[mask > 0] > 0).all()
    # The loss saw each micro-batch once, in order; the kept log-probs are the forward's, in batch order.
    assert split["seen"] == PARTS
    torch.testing.assert_close(split["kept"], logp, rtol=0, atol=1e-6)
    # Metric sums over the micro-batches equal the whole batch's; a named key absent everywhere is 0.
    assert float(split["sums"]["rows"]) == B and split["sums"]["nll"].dtype == torch.float64
    assert split["sums"]["nll"].item() == pytest.approx(whole["sums"]["nll"].item(), rel=1e-6)
    assert split["reduced"] == pytest.approx({"nll": split["sums"]["nll"].item(), "rows": B, "absent": 0.0})
    # Three micro-batches accumulate the gradient of one backward of the whole batch.
    assert split["grads"].keys() == whole["grads"].keys() and len(split["grads"]) > 10
    for name, grad in whole["grads"].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(split["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_pipelined_runner_on_two_stages_equals_the_sequential_one(sequential: list[dict]) -> None:
    want = sequential[0]
    stages = run_world(2, run_passes, 2, PARTS)
    for got in stages:  # every stage has the last one's results
        for g, w in zip(got["forward"], want["forward"]):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
        torch.testing.assert_close(got["kept"], want["kept"], rtol=0, atol=1e-5)
        assert got["reduced"] == pytest.approx(want["reduced"], rel=1e-5)
    first, last = stages
    assert first["seen"] == [] and last["seen"] == PARTS  # the losses run on the last stage only
    assert first["sums"] == {} and last["sums"].keys() == want["sums"].keys()
    # Each stage holds its own layers' gradients; the tied embedding's two copies add up to the whole one.
    assert first["grads"].keys() | last["grads"].keys() == want["grads"].keys()
    for name, grad in want["grads"].items():
        got = sum(stage["grads"][name] for stage in stages if name in stage["grads"])
        torch.testing.assert_close(got, grad, rtol=1e-4, atol=1e-6, msg=name)
