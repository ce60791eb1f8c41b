"""The tensor-parallel generation view on CPU (gloo): resharded from FSDP2 shards, it generates what one
process generates on the same weights (tiny Qwen2 and Qwen3 with tied embeddings, Llama untied, all GQA; at
tp = 2 on two ranks also Seed-OSS, the family added by its entry in models/family.py alone: q/k/v biases)."""

from __future__ import annotations

import copy

import pytest
from support.dist_util import run_world

pytestmark = pytest.mark.slow

ARCHS = ("qwen2", "qwen3", "llama")
NEW_FAMILY = "seed_oss"  # its shard rules come from its FamilySpec only
PROMPTS = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15], [20]]


def minimum_bytes(full, tp: int, world: int, rank: int, elem: int) -> int:
    """What a rank must receive, from the shapes alone: its generation box less what FSDP2 gave it."""
    from hybridflow.engine.parallel.layout import kind_of

    t = rank // (world // tp)
    head = (
        getattr(full.config, "head_dim", None) or full.config.hidden_size // full.config.num_attention_heads
    )
    total = 0
    for name, p in full.named_parameters():
        kind, shape = kind_of(name), list(p.shape)
        gen_dim = 1 if kind == "row" else 0
        need = [[0, n] for n in shape]
        rows = shape[gen_dim]
        if tp > 1 and kind == "first" and t > 0:
            continue  # rank 0 holds the bias; the others' buffers are zeros
        if tp > 1 and kind == "kv" and rows // head < tp:
            lo = (t * (rows // head) // tp) * head
            need[gen_dim] = [lo, lo + head]
        elif tp > 1 and kind in ("column", "kv", "row", "vocab"):
            part = -(-rows // tp) if kind == "vocab" else rows // tp
            need[gen_dim] = [t * part, min((t + 1) * part, rows)]
        fsdp_dim = 1 if kind == "row" and tp > 1 and shape[1] % world == 0 else 0
        size = -(-shape[fsdp_dim] // world)
        own = [[0, n] for n in shape]
        own[fsdp_dim] = [min(rank * size, shape[fsdp_dim]), min((rank + 1) * size, shape[fsdp_dim])]
        volume = overlap = 1
        for (a0, a1), (b0, b1) in zip(need, own):
            volume *= a1 - a0
            overlap *= max(0, min(a1, b1) - max(a0, b0))
        total += volume - overlap
    return total * elem


def generate_on_ranks(rank: int, world: int, tp: int, archs: tuple[str, ...] = ARCHS) -> dict[str, dict]:
    import torch
    import torch.distributed as dist

    from hybridflow.engine.hybrid.switch import RolloutShard
    from hybridflow.engine.parallel.fsdp import shard_model
    from hybridflow.engine.parallel.layout import follow_rollout_shards, layouts
    from hybridflow.engine.parallel.rollout_group import RolloutGroup
    from hybridflow.engine.parallel.view import GenerateView
    from hybridflow.engine.rollout.engine import PagedEngine
    from hybridflow.engine.rollout.sampling import SamplingParams
    from hybridflow.engine.rollout.tp import RolloutTP
    from hybridflow.models import build_tiny_model

    dist.init_process_group("gloo")
    view, out = GenerateView(world, tp), {}
    group = RolloutGroup(view, rank)
    for arch in archs:
        lm = build_tiny_model(
            arch, vocab_size=70, hidden_size=32, num_attention_heads=4, num_key_value_heads=2
        )
        full = copy.deepcopy(lm)
        follow_rollout_shards(lm, world, tp)
        shard_model(lm, list(lm.model.layers), torch.device("cpu"))
        shard = RolloutShard(lm, view, rank, torch.float32, torch.device("cpu"), bucket_bytes=4096)
        received = shard.sync(lm)
        lay, fp = layouts(full, tp), dict(full.named_parameters())
        wrong = []
        for name, p in shard.module.named_parameters():
            box = lay[name].box(view.tp_rank(rank))
            if box is None:
                ok = bool((p == 0).all())
            else:
                want = fp[name][tuple(slice(a, b) for a, b in box)]
                ok = torch.equal(p[tuple(slice(0, b - a) for a, b in box)], want)
            wrong += [] if ok else [name]
        comm = RolloutTP(group.group, 70) if tp > 1 else None
        engine = PagedEngine(shard.module, block_size=4, dtype=torch.float32, tp=comm, max_model_len=32)
        alone = PagedEngine(full, block_size=4, dtype=torch.float32, max_model_len=32)
        greedy = SamplingParams(n=2, max_new_tokens=10, temperature=0.0, do_sample=False, eos_token_ids=[])
        a, b = engine.generate(PROMPTS, greedy), alone.generate(PROMPTS, greedy)
        sampled = SamplingParams(n=2, max_new_tokens=10, do_sample=True, eos_token_ids=[], seed=group.seed(5))
        drawn = engine.generate(PROMPTS, sampled)
        group.check_agreement(drawn)  # raises if the ranks of a group drew different tokens
        # a training step, a release and a sync: the runner's bindings still hold the new weights
        with torch.no_grad():
            for p in lm.parameters():
                p.to_local().mul_(-0.5)
        freed = shard.release()
        emptied = all(p.untyped_storage().nbytes() == 0 for p in shard.module.parameters())
        shard.sync(lm)
        rebound = engine.runner.refresh()
        after = engine.generate(PROMPTS, greedy)
        with torch.no_grad():
            for p in full.parameters():
                p.mul_(-0.5)
        after_alone = alone.generate(PROMPTS, greedy)
        out[arch] = {
            "wrong": wrong,
            "received": received,
            "minimum": minimum_bytes(full, tp, world, rank, 4),
            "plan": shard.plan.bytes_received(rank),
            "greedy": [[s.token_ids for s in g] for g in a] == [[s.token_ids for s in g] for g in b],
            "logprob_gap": max(
                abs(u - v) for g, h in zip(a, b) for x, y in zip(g, h) for u, v in zip(x.logprobs, y.logprobs)
            ),
            "drawn": [s.token_ids for g in drawn for s in g],
            "held": sum(p.numel() * 4 for p in shard.module.parameters())
            + sum(b.numel() * b.element_size() for b in shard.module.buffers()),
            "whole": sum(p.numel() * 4 for p in full.parameters())
            + sum(b.numel() * b.element_size() for b in full.buffers()),
            "freed": freed > 0 and emptied,
            "rebound": rebound,
            "after": [[s.token_ids for s in g] for g in after]
            == [[s.token_ids for s in g] for g in after_alone],
        }
    return out


@pytest.mark.parametrize(("world", "tp"), [(2, 2), (4, 2), (4, 4)])  # tp = 1: tests/engine/test_reshard.py
def test_the_generation_view_generates_what_one_process_does(world: int, tp: int) -> None:
    archs = (*ARCHS, NEW_FAMILY) if world == tp == 2 else ARCHS
    results = run_world(world, generate_on_ranks, world, tp, archs, timeout=600)
    assert all(r.keys() == set(archs) for r in results)
    for rank, by_arch in enumerate(results):
        for arch, r in by_arch.items():
            where = (world, tp, rank, arch)
            assert r["wrong"] == [], where  # every buffer holds its box of the full weights
            assert r["received"] == r["plan"] == r["minimum"], where  # exactly the bytes it lacked
            assert r["greedy"] and r["logprob_gap"] < 1e-5, where  # what one process generates
            assert r["freed"] and r["rebound"] is False and r["after"], where  # released, synced in place
            if tp == 2:  # about half a copy: replicated norms and shared KV heads aside
                assert 0.5 * r["whole"] < r["held"] < 0.56 * r["whole"], where
    view_groups = world // tp
    for arch in results[0]:
        drawn = [results[r][arch]["drawn"] for r in range(world)]
        for r in range(world):
            assert drawn[r] == drawn[r % view_groups], arch  # one stream per rollout group
        if view_groups > 1:
            assert drawn[0] != drawn[1], arch  # distinct across groups


def test_the_agreement_check_hashes_tensors_by_content() -> None:
    # Equal router-replay records pickled apart on two ranks: a tensor's pickle is not byte-stable (a view
    # carries its whole storage), its dtype, shape and contents are.
    import dataclasses

    import torch

    from hybridflow.engine.parallel.rollout_group import canonical

    @dataclasses.dataclass
    class Out:
        ids: list[int]
        routed: torch.Tensor

    records = torch.arange(12, dtype=torch.uint8).view(4, 3)
    view = torch.cat([records, torch.full((2, 3), 7, dtype=torch.uint8)])[:4]  # a bigger storage
    assert canonical([Out([1, 2], records)]) == canonical([Out([1, 2], view)])
    assert canonical(Out([1], records)) != canonical(Out([1], records.flip(0)))
    assert canonical(records) != canonical(records.view(3, 4))  # the shape counts too


def gather_on_ranks(rank: int, world: int) -> dict:
    import warnings

    import torch
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from hybridflow.engine.rollout.tp import RolloutTP

    dist.init_process_group("gloo")
    comm = RolloutTP(dist.group.WORLD, vocab_size=7)  # slices of 4: the last rank's holds 3 and a pad column
    full = torch.arange(3 * 8, dtype=torch.float32).view(3, 8) / 7  # 3 rows over the padded vocabulary
    local = full[:, rank * comm.vocab_part : (rank + 1) * comm.vocab_part]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gathered = comm.gather_logits(local)
    with warnings.catch_warnings():  # the deprecated call the rollout made before, for the same result
        warnings.simplefilter("ignore")
        parts = funcol.all_gather_tensor(local.contiguous(), 0, dist.group.WORLD)
    before = parts.view(world, 3, comm.vocab_part).permute(1, 0, 2).reshape(3, -1)[:, :7]
    return {
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught],
        "exact": torch.equal(gathered, full[:, :7]),
        "same_as_before": torch.equal(gathered, before),
    }


def test_gathering_the_logits_warns_nothing_and_gives_what_it_gave() -> None:
    for result in run_world(2, gather_on_ranks, 2):
        assert result["warnings"] == []  # all_gather_tensor's FutureWarning came once per rank per step
        assert result["exact"] and result["same_as_before"]
