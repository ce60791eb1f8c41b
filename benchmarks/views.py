"""Memory per rank of each training view and its switch into each generation view, from the plan (any machine).

    python benchmarks/views.py --model-size 1.5b 7b --world 8

No weights are made: the model is built on the meta device and every figure comes from its shapes. For each
training view (pp stages x tp_t x dp over W ranks: each stage holding its own layers, FSDP2 over dp, the
layers' projections split over tp_t, the embedding, norms and head replicated over tp_t) and each generation
view (tp_g; for pp > 1 the tp_g of tp_t and of tp_t x pp), per rank:
  train  the trained actor's state: float32 masters + float32 gradients + AdamW's two float32 moments;
  layer  FSDP2's gathered bf16 copy of one decoder layer during forward/backward (its tp_t piece);
  gen    the generation shard in bf16 (``ReshardPlan.generation_bytes``);
  recv   the most any rank receives at a switch, from the reshard plan of the two views' boxes;
  peak   train + gen: what a rank holds during a rollout before the KV cache (the switch frees nothing
         of the training state; param/optimizer offload would take ``train`` off the device).
Mixtures of experts (``--moe-size``, on ``--moe-world`` ranks): training views with expert parallelism (ep
whole experts per group of ep data-parallel ranks, FSDP2 over the rest; the MoE blocks whole on every tp rank)
into generation views whose experts are sliced over tp_g (ep_g = 1), split whole over it (ep_g = tp_g) or over
tp_g x k ranks of k rollout groups (the largest such ep_g the experts divide, ``plan.switch``: the expert
dimension independent of tp), among them the write-ups' mapping train (tp=8, ep=2) -> generate tp=4 at 16
ranks. Both views print their ep; the mixture-of-experts ``layer`` is its largest layer as FSDP2 gathers it
(E / ep whole experts).
Timing on several GPUs belongs to the multi-GPU issue.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

try:
    import hybridflow  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from switch import PLAN_SHAPES, meta_model

from hybridflow.engine.hybrid.memory import unsplit_reason, view_memory
from hybridflow.engine.parallel.dims import ParallelDims
from hybridflow.models.family import family_of
from hybridflow.plan.memory import gathered_layer_bytes
from hybridflow.plan.switch import GenerateSplit, expert_sizes, moe_experts, switch_figures
from hybridflow.utils.errors import UserError

GB = 1e9
MOE_SIZES = (
    "mixtral-8x7b",
    "qwen3-30b-a3b",
    "deepseek-v3-671b",
)  # ``hybridflow plan --model-shape``'s mixtures of experts


def moe_meta_model(size: str):
    """A mixture of experts of ``model_shapes.MODEL_SHAPES`` on the meta device (shapes only)."""
    from transformers import AutoModelForCausalLM

    from hybridflow.plan.shapes import shape_config

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(shape_config(size))


def moe_views(world: int, experts: int) -> list[tuple[int, int, int, int]]:
    """(tp_t, ep, tp_g, ep_g) rows: FSDP2 alone, ep = 2 into a sliced and an expert-parallel rollout, and
    train (tp = W/2, ep = 2) -> generate tp = W/4 sliced, whole over the group and whole over the most rollout
    groups the experts divide (the write-ups' mapping at W = 16), and the same from FSDP2 with ep = 2."""
    rows = [(1, 1, 1, 1), (1, 2, 2, 1), (1, 2, 2, 2), (1, world, world, world)]
    if world >= 4:
        wide = expert_sizes(world, world // 4, experts)[-1]  # experts over the most groups they divide
        for tp_t in (world // 2, 1):
            rows += [(tp_t, 2, world // 4, ep_g) for ep_g in (1, world // 4, wide)]
    return list(dict.fromkeys(rows))


def moe_row(size: str, model, world: int, tp_t: int, ep: int, tp_g: int, ep_g: int) -> str:
    """One table row of a mixture of experts (columns as ``view_row``'s)."""
    generate = f"(tp={tp_g}, ep={ep_g})" if ep_g > 1 else f"(tp={tp_g})"
    try:
        train = ParallelDims(world, tp_t, ep=ep)
        GenerateSplit(world, tp_g, ep_g)
        bad = unsplit_reason(model, tp_t, tp_g, min(ep_g, tp_g))  # whole experts across groups as inside one
        if ep_g > 1 and moe_experts(model) % ep_g:
            field = family_of(model.config).experts.count
            bad = f"experts: {field}={moe_experts(model)} does not split whole {ep_g} ways"
    except (UserError, ValueError) as e:
        train, bad = f"(tp={tp_t}, ep={ep})", str(e)
    if bad:
        return (
            f"| {size} | {train} | {generate} | - | - | - | - | - | {bad.split(': ', 1)[-1].split(';')[0]} |"
        )
    state = view_memory(model, train, tp_g, switch=False).state_bytes()
    layer, switch = gathered_layer_bytes(model, train), switch_figures(model, train, tp_g, ep_g)
    gen = switch.generation_bytes
    return (
        f"| {size} | {train} | {generate} | {state / GB:.2f} | {layer / GB:.3f} | {gen / GB:.2f} | "
        f"{switch.received_bytes / GB:.3f} | {(state + gen) / GB:.2f} | |"
    )


def view_row(size: str, model, world: int, tp_t: int, tp_g: int, pp: int = 1) -> str:
    """One table row: the figures of train view (tp_t, pp, dp) -> generate view (tp_g) for ``size``."""
    train = ParallelDims(world, tp_t, pp)
    bad = unsplit_reason(model, tp_t, tp_g)
    if bad:
        return f"| {size} | {train} | (tp={tp_g}) | - | - | - | - | - | {bad.split(': ')[1].split(' (')[0].split(';')[0]} |"
    m = view_memory(model, train, tp_g)
    state, gen = m.state_bytes(), m.generation_bytes
    return (
        f"| {size} | {train} | (tp={tp_g}) | {state / GB:.2f} | {m.layer_bytes / GB:.3f} | {gen / GB:.2f} | "
        f"{m.received_bytes / GB:.3f} | {(state + gen) / GB:.2f} | |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-size", nargs="*", default=["1.5b", "7b"], choices=sorted(PLAN_SHAPES))
    parser.add_argument("--world", type=int, default=8, help="ranks (GPUs) of the role")
    parser.add_argument("--moe-size", nargs="*", default=["mixtral-8x7b"], choices=MOE_SIZES)
    parser.add_argument("--moe-world", type=int, default=16, help="ranks of the mixture-of-experts rows")
    args = parser.parse_args()
    sizes = [tp for tp in (1, 2, 4, 8) if tp <= args.world and args.world % tp == 0]
    print(
        "| model | train view | generate view | train state GB | one layer bf16 GB | gen shard GB | "
        "max recv GB | peak GB | not split |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for size in args.model_size:
        model = meta_model(size)
        for tp_t in sizes:
            for tp_g in sizes:
                print(view_row(size, model, args.world, tp_t, tp_g))
        for pp in (2, 4):  # pipeline views: into the same tp, and into tp x pp (stages become tensor ranks)
            for tp_t in [t for t in sizes if args.world % (t * pp) == 0]:
                for tp_g in sorted({tp_t, tp_t * pp}):
                    print(view_row(size, model, args.world, tp_t, tp_g, pp))
    for size in args.moe_size:
        model = moe_meta_model(size)
        for tp_t, ep, tp_g, ep_g in moe_views(args.moe_world, moe_experts(model)):
            print(moe_row(size, model, args.moe_world, tp_t, ep, tp_g, ep_g))


if __name__ == "__main__":
    main()
