"""Expert parallelism on CPU (gloo): a MoE model's experts split over ep ranks (FSDP2 over the rest) give the
log-probs, the loss, the grad norm and the updated weights of one rank on the same fixed batch (ep=2 on 2
ranks, ep=2 x dp_rep=2 and ep=4 on 4; tiny Qwen3-MoE, Mixtral and Qwen2-MoE with its shared expert, routers
re-initialised so routing varies); each rank holds E / ep experts; and the hybrid engine's switch rebuilds
the whole model on every generation rank from the expert shards."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support.batches import NORMAL, rollout_batch
from support.dist_util import run_world_kept

from hybridflow.config.schema import ActorConfig
from hybridflow.models import build_tiny_model
from hybridflow.models.moe import install_moe
from hybridflow.protocol import Batch

pytestmark = pytest.mark.slow

R, B = 5, 8  # response width, samples
PROMPT_LENGTHS = [6, 4, 6, 2, 5, 3, 1, 6]  # left-padded to 6
RESPONSE_LENGTHS = [5, 2, 0, 4, 5, 1, 3, 5]
ARCHS = ("qwen3_moe", "mixtral", "qwen2_moe")


def fixed_batch() -> Batch:
    """Left-padded prompts and right-padded responses of different lengths, one response fully masked."""
    return rollout_batch(PROMPT_LENGTHS, RESPONSE_LENGTHS, R, 0, advantages=NORMAL)


def tiny_moe(arch: str) -> torch.nn.Module:
    """Two MoE layers of 4 experts (2 per token), hidden 64, ``MoEBlock``s in, routers drawn N(0, 0.5)."""
    model = build_tiny_model(arch, vocab_size=64, hidden_size=64, num_hidden_layers=2, seed=1)
    assert install_moe(model) == 2
    with torch.no_grad(), torch.random.fork_rng():
        torch.manual_seed(2)
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # some families start their routers at zero
                p.normal_(0, 0.5)
    return model


def actor_config() -> ActorConfig:
    cfg = ActorConfig()
    cfg.ppo_mini_batch_size = B  # one mini-batch: one optimizer step
    cfg.ppo_micro_batch_size_per_gpu = 3  # gradient accumulation over uneven micro-batches
    cfg.grad_clip = 0.5  # clipping is on: the global norm must count each expert once
    cfg.optim.lr = 1e-2
    cfg.optim.eps = 1e-3  # Adam's first step linear in small gradients (see test_train_views)
    # The load-balancing loss is per micro-batch (a product of token means): other micro-batches, another
    # loss. Off here, so that the ranks' sum is the one rank's; router_terms' own tests cover it.
    cfg.router_aux_loss_coef = 0.0
    return cfg


def train_with_ep(
    rank: int, world: int, views: list[tuple[int, int, str]], run_dir: str | None = None
) -> list[dict]:
    """Per (tp, ep, arch): log-probs, one update's metrics, the updated full weights (rank 0), the experts
    held, the generation replica the switch refreshed; the first view's checkpoint in ``run_dir``."""
    from hybridflow.engine.hybrid.switch import held_box
    from hybridflow.engine.parallel.dims import ParallelDims, train_box
    from hybridflow.engine.parallel.ep import ExpertShard, is_expert
    from hybridflow.engine.parallel.fsdp import full_state_dict
    from hybridflow.engine.parallel.layout import kind_of
    from hybridflow.engine.roles.actor import ActorEngine

    out = []
    for tp, ep, arch in views:
        view = ParallelDims(world, tp=tp, ep=ep)
        engine = ActorEngine(tiny_moe(arch), actor_config(), use_remove_padding=True, dims=view)
        dp_rank, dp = view.coords(rank)[2], view.dp
        batch = fixed_batch()[list(range(dp_rank * B // dp, (dp_rank + 1) * B // dp))]  # its replica's rows
        logp = engine.compute_log_prob(batch, micro_batch_size=3)["log_probs"]
        batch["old_log_probs"] = logp - 0.05
        metrics = engine.update_policy(batch)
        shards = [m for m in engine.module.modules() if isinstance(m, ExpertShard)]
        held = [tuple(s.gate_up_proj.to_local().shape) for s in shards]  # FSDP2's shard of the local experts
        for name, param in engine.module.named_parameters():  # the plans' boxes are the DTensors' own
            kind = "replicated" if ".mlp." in name else kind_of(name)  # tp splits the attention only
            kind = "experts" if is_expert(name) and ep > 1 else kind
            assert held_box(param) == train_box(kind, tuple(param.shape), view, rank), name
        state = full_state_dict(engine.module)
        state = {k: v.clone() for k, v in state.items()} if rank == 0 else None
        out.append(
            {"log_probs": logp, "metrics": metrics, "state": state, "shards": len(shards), "held": held}
        )
        out[-1]["generation"] = generation_weights(engine.module.lm, world, rank) if world > 1 else None
        if world == 1:  # the one-rank engine's log-probs after the update, for the checkpoint's
            out[-1]["updated"] = engine.compute_log_prob(fixed_batch(), micro_batch_size=3)["log_probs"]
        if run_dir is not None and len(out) == 1:
            from hybridflow.checkpoint import RoleState, save

            save(run_dir, 1, {"actor": RoleState(engine.module, engine.engine.optimizer, "lm.")}, {}, {})
    return out


def load_at_one_rank(rank: int, ckpt: str, arch: str) -> torch.Tensor:
    """A one-rank engine loaded from an expert-parallel checkpoint: its log-probs on the whole batch."""
    from hybridflow.checkpoint import RoleState, load
    from hybridflow.engine.roles.actor import ActorEngine

    engine = ActorEngine(tiny_moe(arch), actor_config(), use_remove_padding=True)
    load(ckpt, {"actor": RoleState(engine.module, engine.engine.optimizer, "lm.")})
    return engine.compute_log_prob(fixed_batch(), micro_batch_size=3)["log_probs"]


def generation_weights(sharded: torch.nn.Module, world: int, rank: int) -> dict:
    """The hybrid engine's whole replica (tp_g = 1) refreshed from the expert-parallel shards by the plan."""
    from hybridflow.engine.hybrid.switch import RolloutShard
    from hybridflow.engine.parallel.view import GenerateView

    cpu = torch.device("cpu")
    weights = RolloutShard(sharded, GenerateView(world, 1), rank, torch.float32, cpu, bucket_bytes=1 << 16)
    received = weights.sync(sharded)
    return {"state": {k: v.clone() for k, v in weights.module.state_dict().items()}, "received": received}


@pytest.fixture(scope="module")
def one_rank() -> list[dict]:
    return run_world_kept(1, train_with_ep, 1, [(1, 1, arch) for arch in ARCHS])[0]


def assert_same(got: dict, want: dict, dp: int) -> None:
    torch.testing.assert_close(got["log_probs"], want["log_probs"][: B // dp], rtol=0, atol=1e-5)
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac"):
        assert got["metrics"][key] == pytest.approx(want["metrics"][key], rel=1e-5, abs=1e-6), key
    assert got["state"].keys() == want["state"].keys()
    for name, tensor in want["state"].items():
        torch.testing.assert_close(got["state"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)


# (tp, ep, family) of each view, those of one world size in one call of the kept processes (a later call's
# meshes are safe there too: ``forget_meshes`` drops the DTensor specs that held an earlier call's).
VIEWS_BY_WORLD = {
    2: [(1, 2, "qwen3_moe"), (1, 2, "mixtral"), (1, 2, "qwen2_moe"), (2, 1, "qwen2_moe")],
    4: [(2, 2, "qwen3_moe"), (1, 2, "mixtral"), (1, 4, "qwen2_moe")],
}


@pytest.mark.parametrize("world", sorted(VIEWS_BY_WORLD))
def test_expert_parallel_training_equals_one_rank(one_rank: list[dict], world: int, tmp_path: Path) -> None:
    """ep=2 on 2 ranks; ep=2 x dp_rep=2 and ep=4 on 4; tp=2 attention beside whole MoE blocks (ep=1 on 2
    ranks, ep=2 on 4): the same numbers as one rank, each rank 4 / ep experts; the switch to whole generation
    replicas moves each expert from its holders, bit-exact."""
    views = VIEWS_BY_WORLD[world]
    results = run_world_kept(world, train_with_ep, world, views, str(tmp_path), timeout=600)
    for (tp, _, arch), got in zip(views, results[0]):
        assert_same(got, one_rank[ARCHS.index(arch)], world // tp)
    for rank, per_view in enumerate(results):
        for (tp, ep, _), got, full in zip(views, per_view, results[0]):
            state = {k.removeprefix("lm."): v for k, v in full["state"].items()}
            generation = got["generation"]["state"]  # the replica is rank 0's gathered weights, exactly
            assert generation.keys() == state.keys()
            assert all(torch.equal(generation[k], state[k]) for k in state), [
                k for k in state if not torch.equal(generation[k], state[k])
            ]
            assert got["generation"]["received"] > 0
            assert got["shards"] == (2 if ep > 1 else 0)  # both MoE layers' experts split
            # FSDP2 splits the rank's 4 / ep experts again over the dp / ep ranks holding the same ones
            local, dp_rank = 4 // ep, rank % (world // tp)
            rows = -(-local // (world // tp // ep))
            first = min(rows, max(local - (dp_rank // ep) * rows, 0))
            assert all(shape[0] == first for shape in got["held"]), (rank, got["held"])
    if world == 2:  # the ep=2 checkpoint loads into one rank holding every expert: the updated weights
        (logp,) = run_world_kept(1, load_at_one_rank, str(tmp_path / "global_step_1"), views[0][2])
        torch.testing.assert_close(logp, one_rank[ARCHS.index(views[0][2])]["updated"], rtol=0, atol=1e-5)


def dispatch_against_whole(rank: int, skewed: bool) -> dict:
    """``dispatch_experts`` on 2 ranks (2 of 4 experts each) against ``run_experts`` on the whole weights:
    outputs, input and routing-weight gradients, and the local experts' gradients (their mean share)."""
    import torch.distributed as dist

    from hybridflow.engine.parallel.ep import dispatch_experts
    from hybridflow.models.moe import run_experts

    dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(5)
    gate_up, down = torch.randn(4, 32, 16, generator=g), torch.randn(4, 16, 16, generator=g)
    x = torch.randn(2, 7, 16, generator=g)[rank]  # (N, H): each rank its own tokens
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(14)])[rank * 7 : rank * 7 + 7]
    if skewed:  # every token to experts 0 and 1: rank 1's experts receive nothing
        ids = torch.tensor([[0, 1]] * 7)
    weights = torch.rand(7, 2, generator=g)
    whole = [t.clone().requires_grad_() for t in (x, weights, gate_up, down)]
    want = run_experts(whole[0], ids, whole[1], whole[2], whole[3])
    want.square().sum().backward()
    mine = slice(2 * rank, 2 * rank + 2)
    local = [t.clone().requires_grad_() for t in (x, weights, gate_up[mine], down[mine])]
    got = dispatch_experts(local[0], ids, local[1], local[2], local[3], dist.group.WORLD)
    got.square().sum().backward()
    expert_grads = [t.grad.clone() for t in whole[2:]]
    for t in expert_grads:  # the whole experts' gradient summed over both ranks' tokens
        dist.all_reduce(t)
    return {
        "out": (got, want),
        "input_grads": [(a.grad, b.grad) for a, b in zip(local[:2], whole[:2])],
        "expert_grads": [(a.grad * 2, b[mine]) for a, b in zip(local[2:], expert_grads)],  # x ep: a mean
    }


@pytest.mark.parametrize("skewed", [False, True])
def test_the_dispatch_equals_the_experts_on_one_rank(skewed: bool) -> None:
    for out in run_world_kept(2, dispatch_against_whole, skewed):
        torch.testing.assert_close(*out["out"], rtol=1e-5, atol=1e-5)
        for got, want in out["input_grads"] + out["expert_grads"]:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # sums in another order


def test_expert_parallel_sizes_the_model_cannot_take_are_refused_naming_the_field() -> None:
    from hybridflow.engine.parallel.dims import ParallelDims
    from hybridflow.utils.errors import UserError

    dense = build_tiny_model("qwen2", vocab_size=64, hidden_size=32, num_hidden_layers=1).config
    with pytest.raises(
        UserError, match=r"actor.parallel.ep=2: .* 'qwen2' is a dense model; set actor.parallel.ep=1"
    ):
        ParallelDims(2, ep=2).check_model(dense)
    moe = build_tiny_model("mixtral", vocab_size=64, hidden_size=32, num_hidden_layers=1).config  # 4 experts
    with pytest.raises(
        UserError, match=r"critic.parallel.ep=8 does not divide the model's 4 routed experts; use"
    ):
        ParallelDims(8, ep=8, role="critic").check_model(moe)
    ParallelDims(4, ep=4).check_model(moe)  # one expert per rank: fine
    assert str(ParallelDims(4, ep=2)) == "(fsdp=4, ep=2)" and not ParallelDims(4, ep=2).fsdp_only
    assert [ParallelDims(4, ep=2).ep_coords(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
