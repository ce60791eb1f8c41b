"""Expert parallelism across rollout groups on four gloo ranks (``rollout.expert_parallel_size`` > tp): the
training view is ep=2 x dp=2 (FSDP2 over the rest), the generation view tp=1, ep=4 (every rank its own replica
of attention and the dense layers, a quarter of the experts: Mixtral) or tp=2, ep=4 (two groups of two, each
rank a quarter: Qwen3-MoE; the trainer's test runs the other pairing). Each rollout group generates its own
prompts (different lengths, different counts, so the groups finish at different steps and the early ones
settle), and every group's greedy tokens, log-probs and routing records equal one process's on the whole
model; the reshard moved whole experts, each from one holder, and every rank ends with exactly its experts.
The kept processes that ran it then train an expert-parallel step (the exchange's extra process groups leave
nothing behind that a later call's meshes trip over)."""

from __future__ import annotations

import pytest
import torch
from support.batches import NORMAL, rollout_batch
from support.dist_util import run_world_kept

# per rollout group: its prompts (at most 4 rollout groups); group 1 has fewer and longer ones
GROUP_PROMPTS = [
    [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11]],
    [[20, 21, 22, 23, 24, 25, 26, 27, 28]],
    [[30], [31, 32, 33, 34], [35, 36]],
    [[40, 41, 42], [43, 44, 45, 46, 47, 48]],
]
NEW = [10, 3, 7, 12]  # per rollout group: new tokens, so that the groups finish apart


def lively(arch: str) -> torch.nn.Module:
    """A tiny MoE (2 layers, 4 experts, 2 per token) with large weights and drawn routers: outputs vary."""
    from hybridflow.models import build_tiny_model

    model = build_tiny_model(arch, vocab_size=64, hidden_size=32, num_hidden_layers=2, seed=1)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight") or p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model.eval()


def params(group: int):
    from hybridflow.engine.rollout.sampling import SamplingParams

    return SamplingParams(n=2, max_new_tokens=NEW[group], temperature=0.0, do_sample=False, eos_token_ids=[])


def generate_on_ranks(rank: int, world: int, views: list[tuple[str, int, int]]) -> list[dict]:
    """Per (arch, tp, ep): this rank's rollout group's outputs, one process's on the same prompts, the plan's
    expert transfers and this rank's expert buffers against the full tensors."""
    import copy

    import torch.distributed as dist

    from hybridflow.config.schema import ActorConfig
    from hybridflow.engine.hybrid.switch import RolloutShard
    from hybridflow.engine.parallel.dims import ParallelDims
    from hybridflow.engine.parallel.ep import is_expert
    from hybridflow.engine.parallel.rollout_group import RolloutGroup
    from hybridflow.engine.parallel.view import GenerateView
    from hybridflow.engine.roles.actor import ActorEngine
    from hybridflow.engine.rollout.engine import PagedEngine
    from hybridflow.engine.rollout.expert_exchange import ExpertExchange
    from hybridflow.engine.rollout.tp import RolloutTP

    out = []
    for arch, tp, ep in views:
        full = lively(arch)
        dims = ParallelDims(world, ep=2)  # training: ep=2 x dp_rep=2, FSDP2 over the rest
        lm = ActorEngine(copy.deepcopy(full), ActorConfig(), dims=dims, trainable=False).module.lm
        view = GenerateView(world, tp, ep)
        group = RolloutGroup(view, rank)
        shard = RolloutShard(lm, view, rank, torch.float32, torch.device("cpu"), 1 << 12, str(dims))
        received = shard.sync(lm)
        g = view.dp_rank(rank)
        exchange = ExpertExchange(group.exchange_group, 4, group.ep_rank)
        comm = RolloutTP(group.group, 64) if tp > 1 else None
        kwargs = {"block_size": 4, "dtype": torch.float32, "max_model_len": 32, "record_routing": True}
        engine = PagedEngine(shard.module, tp=comm, ep=exchange, **kwargs)
        got = engine.generate(GROUP_PROMPTS[g], params(g))
        group.check_agreement(got)
        alone = PagedEngine(full, **kwargs).generate(GROUP_PROMPTS[g], params(g))
        experts = [i for i, p in enumerate(shard.plan.params) if is_expert(p.name)]
        whole = dict(full.named_parameters())
        exact = all(
            torch.equal(
                shard.module.get_parameter(shard.plan.params[i].name),
                whole[shard.plan.params[i].name][slice(*shard.plan.needed(i, rank)[0])],
            )
            for i in experts
        )
        out.append(
            {
                "tokens": [[s.token_ids for s in x] for x in got],
                "alone": [[s.token_ids for s in x] for x in alone],
                "gap": max(
                    abs(u - v)
                    for x, y in zip(got, alone)
                    for a, b in zip(x, y)
                    for u, v in zip(a.logprobs, b.logprobs)
                ),
                "routing": all(
                    torch.equal(a.routed_experts, b.routed_experts)
                    for x, y in zip(got, alone)
                    for a, b in zip(x, y)
                ),
                "transfers": [
                    (t.param, t.src, t.dst, t.box) for t in shard.plan.transfers if t.param in experts
                ],
                "experts": experts,
                "exact": exact,
                "rows": [shard.module.get_parameter(shard.plan.params[i].name).shape[0] for i in experts],
                "received": received == shard.plan.bytes_received(rank),
                "exchanges": exchange.exchanges,
                "plan": str(shard.plan),
            }
        )
        dist.barrier()
    return out


VIEWS = [("mixtral", 1, 4), ("qwen3_moe", 2, 4)]  # (family, tp, ep): one family per view, the code is shared


def generate_then_train(rank: int, world: int) -> tuple[list[dict], float]:
    """``generate_on_ranks`` for every view, then a training step (``train_step``), as the hybrid engine does."""
    return generate_on_ranks(rank, world, VIEWS), train_step(rank, world, "qwen3_moe")


@pytest.fixture(scope="module")
def ran() -> list[tuple[list[dict], float]]:
    return run_world_kept(4, generate_then_train, 4, timeout=600)


@pytest.fixture(scope="module")
def results(ran: list[tuple[list[dict], float]]) -> list[list[dict]]:
    return [views for views, _ in ran]


@pytest.mark.parametrize("which", range(len(VIEWS)))
def test_each_rollout_group_generates_what_one_process_does(results: list[list[dict]], which: int) -> None:
    arch, tp, _ep = VIEWS[which]
    for rank, r in enumerate(results):
        r = r[which]
        assert r["tokens"] == r["alone"], (arch, tp, rank)  # greedy tokens of one process
        assert r["gap"] < 1e-5, (arch, tp, rank)
        assert r["routing"], (arch, tp, rank)  # router replay's records equal
        assert r["exchanges"] > 0
    assert len({str(results[k][which]["tokens"]) for k in range(4)}) == 4 // tp  # groups had their own work


@pytest.mark.parametrize("which", range(len(VIEWS)))
def test_the_reshard_moves_each_expert_once_into_exactly_its_holder(
    results: list[list[dict]], which: int
) -> None:
    from hybridflow.engine.parallel.view import GenerateView

    arch, tp, ep = VIEWS[which]
    view, first = GenerateView(4, tp, ep), results[0][which]
    for rank, r in enumerate(results):
        assert r[which]["exact"] and r[which]["received"], (arch, rank)  # its experts, bit for bit
        assert r[which]["rows"] == [4 // ep] * len(
            first["experts"]
        )  # E / ep experts held: none it does not serve
    for i in first["experts"]:
        for dst in range(4):
            moved = [box for p, _, d, box in first["transfers"] if p == i and d == dst]
            lo = view.ep_rank(dst) * 4 // ep
            # whole experts (every other dim whole), each from one holder, together exactly the rank's
            assert sorted(b[0] for b in moved) == [(e, e + 1) for e in range(lo, lo + 4 // ep)], (arch, dst)
            assert all(b[1:] == moved[0][1:] and all(a == 0 for a, _ in b[1:]) for b in moved)
    assert f"generate_view=(tp={tp}, ep={ep}, dp={4 // tp})" in first["plan"]
    assert "train_view=(fsdp=4, ep=2)" in first["plan"]


def train_step(rank: int, world: int, arch: str) -> float:
    """One expert-parallel update (ep=2 x dp=2, gradients clipped by their global norm): this rank's norm."""
    from hybridflow.config.schema import ActorConfig
    from hybridflow.engine.parallel.dims import ParallelDims
    from hybridflow.engine.roles.actor import ActorEngine
    from hybridflow.models.moe import install_moe

    cfg = ActorConfig()
    cfg.ppo_mini_batch_size, cfg.ppo_micro_batch_size_per_gpu, cfg.grad_clip = 8, 1, 0.5  # 2 rows a rank
    model = lively(arch).train()
    install_moe(model)  # the shared MoE blocks a loaded model trains with (their experts DTensors over ep)
    engine = ActorEngine(model, cfg, dims=ParallelDims(world, ep=2))
    batch = rollout_batch([5, 2], [4, 1], 4, rank, advantages=NORMAL)  # each rank its own rows
    batch["old_log_probs"] = engine.compute_log_prob(batch, micro_batch_size=2)["log_probs"] - 0.05
    return engine.update_policy(batch)["actor/grad_norm"]


def test_the_same_processes_train_the_same_step_again(ran: list[tuple[list[dict], float]]) -> None:
    # The kept processes that generated and trained above train the same step in a new call: its process
    # groups get the names the first call's had, in another order (the exchange's and generation views' came
    # before its mesh there); no DTensor spec torch cached then may still name them (it did: "Could not
    # resolve the process group registered under the name 14" from the grad-norm's mesh lookup).
    before = [norm for _, norm in ran]
    norms = run_world_kept(4, train_step, 4, "qwen3_moe")
    assert before[0] > 0 and all(n == pytest.approx(before[0], rel=1e-6) for n in before), before
    assert norms == pytest.approx(before, rel=1e-6)  # the same numbers: no collective over another group
