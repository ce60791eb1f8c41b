"""A sparse MoE block's decode step: grouped GEMMs (``grouped_experts``) against the loop over experts (GPU).

    python benchmarks/moe_kernel.py [--batches 1 8 64 256] [--repeats 50] [--out moe_kernel.jsonl]
    python benchmarks/moe_kernel.py --device cpu --hidden 64 --experts 8 --top-k 2 --intermediate 32  (smoke)
    python benchmarks/moe_kernel.py --rollout-tp 2   (+ one rank's share in a tensor-parallel rollout)

One layer of Qwen3-30B-A3B's shape by default (hidden 2048, 128 experts, 8 per token, expert intermediate 768,
bf16, random weights and a N(0, 0.02) router): the router's logits, ``route`` and the experts, exactly what the
rollout engine's decode runs per sparse layer (``blocks.moe_mlp`` without a shared expert). Each row is one
batch size and implementation; ``grouped_experts`` is captured in a CUDA graph (fixed shapes, no host sync),
the loop cannot be (``torch.where`` sizes its work from the data) and runs eagerly. Times are the median of
``--repeats`` calls after ``--warmup`` calls. "GB/s" is the expert weights the step must read (the experts
its tokens chose, counted) over its time: at small batches the step is bound by these bytes.

``--rollout-tp N`` adds what one rank of a rollout group of N computes per sparse layer, both layouts:
"sliced" (every expert's intermediate dim / N, ``rollout.expert_parallel_size=1``) and "split" (E / N whole
experts, the token's other experts masked out, ``rollout.expert_parallel_size=N``), rank 0's share, captured
alike; the all-reduce that sums the shares is the same for both and not timed here (one GPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from hybridflow.models.moe import RouterSpec, grouped_experts, loop_experts, route, router_logits

IMPLS = {"grouped": grouped_experts, "loop": loop_experts}


def make_layer(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random router (E, H), fused experts (E, 2I, H) and (E, H, I)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    e, h, i = args.experts, args.hidden, args.intermediate

    def rand(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(device, dtype)

    return dict(
        router=rand(e, h, std=0.02), gate_up=rand(e, 2 * i, h, std=0.02), down=rand(e, h, i, std=0.02)
    )


def block(x: torch.Tensor, w: dict[str, torch.Tensor], spec: RouterSpec, experts: Callable) -> torch.Tensor:
    """The sparse block's decode: router, routing, experts; x (B, H) -> (B, H)."""
    weights, ids = route(router_logits(x, w["router"], spec), spec)  # (B, k) each
    return experts(x, ids, weights, w["gate_up"], w["down"])


def timed(fn: Callable[[], None], device: torch.device, warmup: int, repeats: int) -> float:
    """Median seconds of one call of ``fn`` after ``warmup`` calls (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rank_shares(w: dict[str, torch.Tensor], tp: int) -> dict[str, tuple[Callable, dict[str, torch.Tensor]]]:
    """Rank 0's experts in a rollout group of ``tp``: every expert sliced on its intermediate dim, or E / tp
    whole experts (an expert-parallel rollout, its other experts masked by ``offset``)."""
    i = w["down"].shape[-1]
    part = i // tp
    sliced = dict(
        router=w["router"],
        gate_up=torch.cat([w["gate_up"][:, :part], w["gate_up"][:, i : i + part]], dim=1).contiguous(),
        down=w["down"][:, :, :part].contiguous(),
    )
    e = w["gate_up"].shape[0] // tp
    split = dict(router=w["router"], gate_up=w["gate_up"][:e].contiguous(), down=w["down"][:e].contiguous())
    return {"sliced": (grouped_experts, sliced), "split": (partial(grouped_experts, offset=0), split)}


def run_one(
    args, w, spec, x: torch.Tensor, impl: str, graphs: bool, fn: Callable | None = None
) -> tuple[float, torch.Tensor, bool]:
    """(median seconds, output, captured) of one implementation at x's batch."""
    fn = IMPLS[impl] if fn is None else fn
    out = torch.empty_like(x)

    def step() -> None:
        out.copy_(block(x, w, spec, fn))

    captured = False
    if graphs and x.is_cuda and impl != "loop":
        step()  # warm up kernels and workspaces outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        run, captured = graph.replay, True
    else:
        run = step
    seconds = timed(run, x.device, args.warmup, args.repeats)
    return seconds, out.clone(), captured


def expert_bytes(x: torch.Tensor, w: dict[str, torch.Tensor], spec: RouterSpec) -> int:
    """Bytes of the experts the batch's tokens chose (each read once per step)."""
    _, ids = route(router_logits(x, w["router"], spec), spec)
    per = (w["gate_up"][0].numel() + w["down"][0].numel()) * w["gate_up"].element_size()
    return int(ids.unique().numel()) * per


def main() -> None:
    """Time every batch size and implementation; print a table, and JSON lines to ``--out``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--no-graphs", action="store_true", help="run grouped_experts eagerly too")
    ap.add_argument("--rollout-tp", type=int, default=1, help="also time one rank's share in a group of N")
    ap.add_argument("--out", default=None, help="append one JSON line per row to this file")
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("moe_kernel.py needs a GPU (or --device cpu for a smoke run)")
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"GPU: {gpu}  torch {torch.__version__}  {args.dtype}")
    spec = RouterSpec(args.experts, args.top_k, renormalize=True)  # Qwen3-MoE's norm_topk_prob
    w = make_layer(args, device, dtype)
    shares = rank_shares(w, args.rollout_tp) if args.rollout_tp > 1 else {}
    print(f"{'batch':>6} {'impl':>8} {'graph':>6} {'us':>10} {'GB/s':>8}")
    rows = []
    g = torch.Generator(device="cpu").manual_seed(1)
    for batch in args.batches:
        x = torch.randn(batch, args.hidden, generator=g).to(device, dtype)
        moved = expert_bytes(x, w, spec)
        outs = {}
        for impl in IMPLS:
            seconds, outs[impl], captured = run_one(args, w, spec, x, impl, not args.no_graphs)
            row = dict(
                gpu=gpu, dtype=args.dtype, batch=batch, impl=impl, graph=captured, us=seconds * 1e6,
                gb_per_s=moved / seconds / 1e9, hidden=args.hidden, experts=args.experts, top_k=args.top_k,
                intermediate=args.intermediate,
            )  # fmt: skip
            rows.append(row)
            print(
                f"{batch:>6} {impl:>8} {captured!s:>6} {row['us']:>10.1f} {row['gb_per_s']:>8.1f}", flush=True
            )
        gap = (outs["grouped"].float() - outs["loop"].float()).abs().max().item()
        print(f"{'':>6} grouped vs loop: max |diff| {gap:.3g}", flush=True)
        rows[-2]["max_diff_vs_loop"] = gap  # the grouped row's
        for name, (fn, part) in shares.items():
            seconds, _, captured = run_one(args, part, spec, x, name, not args.no_graphs, fn)
            row = dict(rows[-1], impl=f"tp{args.rollout_tp}-{name}", graph=captured, us=seconds * 1e6)
            row["gb_per_s"] = moved / args.rollout_tp / seconds / 1e9  # a rank reads about 1/tp of the bytes
            rows.append(row)
            print(f"{batch:>6} {row['impl']:>8} {captured!s:>6} {row['us']:>10.1f} {row['gb_per_s']:>8.1f}")
    if args.out:
        with open(args.out, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
