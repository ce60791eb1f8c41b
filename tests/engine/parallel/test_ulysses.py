"""Ulysses sequence parallelism on CPU (gloo): sp=2 (and sp=4 on 4 ranks) gives the log-probs, entropy, loss,
grad norm and updated weights of sp=1 on the same packed batch (tiny Qwen2 with tied embeddings and Llama
untied, both GQA with 2 KV heads, so sp=4 replicates them); micro-batches whose packed lengths do not divide
sp; with dynamic batch size and gradient checkpointing; the critic's values and update too. Each world size
is one spawn that runs every view in turn."""

from __future__ import annotations

import pytest
import torch
from support.batches import NORMAL, rollout_batch
from support.dist_util import run_world

from hybridflow.config.schema import ActorConfig, CriticConfig
from hybridflow.models import build_tiny_model
from hybridflow.protocol import Batch

R, B = 6, 8  # response width, samples
PROMPT_LENGTHS = [7, 4, 6, 2, 7, 5, 1, 6]  # left-padded to 7
RESPONSE_LENGTHS = [6, 2, 0, 4, 6, 1, 3, 5]


def fixed_batch(seed: int = 0) -> Batch:
    """Left-padded prompts and right-padded responses of different lengths, one response fully masked."""
    fields = {"advantages": NORMAL, "values": NORMAL, "returns": NORMAL}
    return rollout_batch(PROMPT_LENGTHS, RESPONSE_LENGTHS, R, seed, **fields)


def actor_config(dynamic: bool) -> ActorConfig:
    cfg = ActorConfig()
    cfg.ppo_mini_batch_size = B  # one mini-batch: one optimizer step
    cfg.ppo_micro_batch_size_per_gpu = 3  # uneven micro-batches: packed lengths that sp does not divide
    cfg.use_dynamic_bsz = dynamic
    cfg.ppo_max_token_len_per_gpu = 24  # a few micro-batches of a few sequences each
    cfg.entropy_coeff = 0.01  # the entropy's gradient flows through the gather too
    cfg.grad_clip = 0.5
    cfg.optim.lr = 1e-2
    cfg.optim.eps = 1e-3  # see test_train_views: keeps the step linear in near-zero gradients
    return cfg


def critic_config() -> CriticConfig:
    cfg = CriticConfig()
    cfg.ppo_micro_batch_size_per_gpu = 3
    cfg.optim.lr = 1e-2
    cfg.optim.eps = 1e-3
    return cfg


def run_views(rank: int, world: int, views: list[tuple[str, int, bool]]) -> list[dict]:
    """Per (arch, sp, dynamic + checkpointing): the actor's and the critic's outputs on this group's rows."""
    from hybridflow.engine.hybrid.switch import held_box
    from hybridflow.engine.parallel.dims import ParallelDims, train_box
    from hybridflow.engine.parallel.fsdp import full_state_dict
    from hybridflow.engine.parallel.layout import kind_of
    from hybridflow.engine.roles.actor import ActorEngine
    from hybridflow.engine.roles.critic import CriticEngine
    from hybridflow.models import build_value_model

    out = []
    for arch, sp, dynamic in views:
        view = ParallelDims(world, sp=sp)
        dp_rank, dp = view.coords(rank)[2], view.dp
        rows = list(
            range(dp_rank * B // dp, (dp_rank + 1) * B // dp)
        )  # the group's rows (the driver's share)
        batch = fixed_batch()[rows]
        lm = build_tiny_model(arch, vocab_size=64, hidden_size=32, num_hidden_layers=2, seed=1)
        critic_lm = build_value_model(lm) if not dynamic else None
        cfg = actor_config(dynamic)
        actor = ActorEngine(lm, cfg, use_remove_padding=True, gradient_checkpointing=dynamic, dims=view)
        scored = actor.compute_log_prob(batch, 1.0, 3, dynamic, 24 * sp, with_entropy=True)
        batch["old_log_probs"] = scored["log_probs"] - 0.05
        result = {"rows": rows, **scored, "metrics": actor.update_policy(batch)}
        state = full_state_dict(actor.module)  # collective
        result["state"] = state if rank == 0 else None
        for name, param in actor.module.named_parameters():  # FSDP2 over every rank, whatever sp
            assert held_box(param) == train_box(kind_of(name), tuple(param.shape), view, rank), name
        if critic_lm is not None:
            critic = CriticEngine(
                critic_lm, critic_config(), ppo_mini_batch_size=B, use_remove_padding=True, dims=view
            )
            result["values"] = critic.compute_values(batch)
            result["critic"] = critic.update_critic(batch)
        out.append(result)
    return out


def assert_same(got: dict, want: dict) -> None:
    """``got`` (some sp, its group's rows) equals ``want`` (sp=1 on the whole batch)."""
    rows = got["rows"]
    for key in ("log_probs", "entropys", "values"):
        if key in want:
            torch.testing.assert_close(got[key], want[key][rows], rtol=0, atol=1e-5, msg=key)
    for section in ("metrics", "critic"):
        for key, value in want.get(section, {}).items():
            assert got[section][key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    if want["state"] is not None:
        for name, tensor in want["state"].items():
            torch.testing.assert_close(got["state"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)


def whole(results: list[list[dict]], i: int) -> dict:
    """View ``i`` of every rank, its per-row outputs put together into the whole batch (ranks' row order)."""
    first = results[0][i]
    joined = dict(first)
    for key in ("log_probs", "entropys", "values"):
        if key in first:
            parts = {tuple(r[i]["rows"]): r[i][key] for r in results}
            joined[key] = torch.cat([parts[k] for k in sorted(parts)])
    joined["rows"] = list(range(B))
    return joined


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_sequence_parallel_equals_sp_1(world: int) -> None:
    sps = [2] if world == 2 else [2, 4]
    archs = [("qwen2", False), ("llama", True)] if world == 2 else [("llama", False)]
    views = [(arch, sp, dyn) for arch, dyn in archs for sp in (1, *sps)]
    results = run_world(world, run_views, world, views, timeout=600)
    for i, (arch, sp, _) in enumerate(views):
        if sp == 1:
            want = whole(results, i)
            continue
        for rank in range(world):
            got = results[rank][i]
            if rank:
                got = {**got, "state": None}  # rank 0 holds the full weights
            assert_same(got, want if rank == 0 else {**want, "state": None})
        assert arch and results[0][i]["metrics"]["actor/grad_norm"] > 0


def test_the_view_groups_consecutive_ranks_and_prints_sp() -> None:
    from hybridflow.engine.parallel.dims import ParallelDims as TrainView
    from hybridflow.utils.errors import UserError

    view = TrainView(4, sp=2)
    assert str(view) == "(fsdp=4, sp=2)" and str(TrainView(4)) == "(fsdp=4)"
    assert view.dp == 2 and view.fsdp_only
    assert [view.coords(r)[2] for r in range(4)] == [0, 0, 1, 1]
    assert [view.replica_ranks(d) for d in range(2)] == [[0, 1], [2, 3]]
    for bad in (dict(sp=3), dict(tp=2, sp=2), dict(pp=2, sp=2)):
        with pytest.raises(UserError, match="ulysses_sequence_parallel_size"):
            TrainView(4, **bad)


def test_each_rank_holds_its_slice_of_the_packed_row() -> None:
    """sp=3 over packed lengths that 3 does not divide: the slices tile the padded row, the pad tokens are a
    sequence of their own, and each rank's scored rows are its own tokens' (uneven counts, some rank none)."""
    from hybridflow.engine.ops.packing import build_scoring_inputs
    from hybridflow.engine.parallel.ulysses import shard_inputs

    b = fixed_batch()
    inputs = build_scoring_inputs(b["input_ids"], b["attention_mask"], b["position_ids"], R, True)
    S, sp = inputs.input_ids.shape[1], 3
    assert S % sp
    shards = [shard_inputs(inputs, sp, rank) for rank in range(sp)]
    width = -(-S // sp)
    ids = torch.cat([local.input_ids for local, _ in shards], dim=1)  # (1, S_pad)
    assert ids.shape[1] == width * sp and torch.equal(ids[:, :S], inputs.input_ids)
    counts = shards[0][1].counts
    assert sum(counts) == inputs.labels.numel() and all(s.counts == counts for _, s in shards)
    for rank, (local, shard) in enumerate(shards):
        assert local.seq_bounds == [*inputs.seq_bounds, width * sp]
        assert local.cu_seqlens.tolist() == local.seq_bounds
        mine = slice(shard.start, shard.start + counts[rank])
        assert torch.equal(local.gather_index + rank * width, inputs.gather_index[mine])
        assert torch.equal(local.labels, inputs.labels[mine])
        assert ((local.gather_index >= 0) & (local.gather_index < width)).all()


def test_heads_that_sp_does_not_split_are_refused() -> None:
    from types import SimpleNamespace

    from hybridflow.engine.parallel.dims import group_budgets
    from hybridflow.engine.parallel.ulysses import check_ulysses
    from hybridflow.utils.errors import UserError

    check_ulysses(
        SimpleNamespace(model_type="qwen2", num_attention_heads=8, num_key_value_heads=2), 4
    )  # KV heads replicated
    with pytest.raises(UserError, match=r"critic\.ulysses_sequence_parallel_size=8 .* num_attention_heads=4"):
        check_ulysses(
            SimpleNamespace(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2), 8, "critic"
        )
    with pytest.raises(UserError, match="num_key_value_heads=3"):
        check_ulysses(SimpleNamespace(model_type="qwen2", num_attention_heads=6, num_key_value_heads=3), 2)
    assert group_budgets(actor_config(True), 4).ppo_max_token_len_per_gpu == 96
