"""Memory per rank of each training view and its switch into each generation view, from the plan (any machine).

    python benchmarks/views.py --model-size 1.5b 7b --world 8

No weights are made: the model is built on the meta device and every figure comes from its shapes. For each
training view (tp_t x dp over W ranks, FSDP2 over dp, the layers' projections split over tp_t, the
embedding, norms and head replicated over tp_t) and each generation view (tp_g), per rank:
  train  the trained actor's state: float32 masters + float32 gradients + AdamW's two float32 moments;
  layer  FSDP2's gathered bf16 copy of one decoder layer during forward/backward (its tp_t piece);
  gen    the generation shard in bf16 (``ReshardPlan.generation_bytes``);
  recv   the most any rank receives at a switch, from the reshard plan of the two views' boxes;
  peak   train + gen: what a rank holds during a rollout before the KV cache (the switch frees nothing
         of the training state; param/optimizer offload would take ``train`` off the device).
Timing on several GPUs belongs to the multi-GPU issue.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    import hybridflow  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from switch import PLAN_SHAPES, meta_model

from hybridflow.engine.parallel import GenerateView, ReshardPlan
from hybridflow.engine.parallel.plan import ParamSpec, volume
from hybridflow.engine.parallel.tp_rollout import ShardLayout, check_tp, kind_of
from hybridflow.engine.parallel.tp_train import check_train_tp
from hybridflow.engine.parallel.train_view import TrainView, train_box

GB = 1e9
STATE_BYTES = 4 + 4 + 8  # float32 master, float32 gradient, AdamW exp_avg and exp_avg_sq


def _fits(check, config, tp: int) -> str | None:
    """None when ``tp`` splits the model, else the field that it does not split."""
    try:
        check(config, tp)
    except ValueError as e:
        return str(e).split(": ")[1].split(" (")[0].split(";")[0]
    return None


def view_row(size: str, model, world: int, tp_t: int, tp_g: int) -> str:
    """One table row: the figures of train view (tp_t, dp) -> generate view (tp_g) for ``size``."""
    config = model.config
    bad = _fits(check_train_tp, config, tp_t) or _fits(check_tp, config, tp_g)
    train = TrainView(world, tp_t)
    if bad:
        return f"| {size} | {train} | (tp={tp_g}) | - | - | - | - | - | {bad} |"
    head_dim = config.hidden_size // config.num_attention_heads
    params = list(model.named_parameters())
    kinds = [kind_of(n) for n, _ in params]
    fsdp_dims = [  # as follow_rollout_shards marks them for FSDP2-only training with a tp rollout
        1 if train.fsdp_only and tp_g > 1 and k == "row" and p.shape[1] % world == 0 else 0
        for k, (_, p) in zip(kinds, params)
    ]
    holdings = [
        [train_box(k, tuple(p.shape), train, r, d) for k, (_, p), d in zip(kinds, params, fsdp_dims)]
        for r in range(world)
    ]
    specs = [
        ParamSpec(n, tuple(p.shape), None, ShardLayout(k, tuple(p.shape), tp_g, head_dim))
        for k, (n, p) in zip(kinds, params)
    ]
    plan = ReshardPlan(specs, GenerateView(world, tp_g), 2, 512 * 2**20, holdings, str(train))
    state = max(sum(volume(b) for b in holdings[r]) for r in range(world)) * STATE_BYTES
    layer = sum(p.numel() for n, p in params if ".layers.0." in n) * 2 // tp_t
    gen = plan.generation_bytes()
    recv = max(plan.bytes_received(r) for r in range(world))
    return (
        f"| {size} | {train} | (tp={tp_g}) | {state / GB:.2f} | {layer / GB:.3f} | {gen / GB:.2f} | "
        f"{recv / GB:.3f} | {(state + gen) / GB:.2f} | |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-size", nargs="+", default=["1.5b", "7b"], choices=sorted(PLAN_SHAPES))
    parser.add_argument("--world", type=int, default=8, help="ranks (GPUs) of the role")
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


if __name__ == "__main__":
    main()
