"""The decode step's SiLU * up + down projection: the cuBLAS path against the split-K Triton kernel (GPU).

    PYTHONPATH=$PWD python benchmarks/silu_down.py [--rows 256 128 64] [--sweep]

Qwen2.5-0.5B shapes (intermediate 4864, hidden 896), bf16. The cuBLAS path is what the compiled decode
step runs today: the SiLU * up kernel, the down GEMM (cuBLAS picks split-K and a reduce kernel there).
The kernel (``engine/rollout/mlp_kernel.py``) is timed alone and with the sum of its partials (which the
engine leaves to the next fused kernel). Microseconds per call, median of CUDA-graph replays; 24 weight
copies are cycled so that L2 does not serve them, as in a real step. ``--sweep`` also tries launch configs.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybridflow.engine.rollout import mlp_kernel as mk

INNER, HIDDEN, COPIES = 4864, 896, 24


def graph_us(run: Callable[[], object], reps: int = 20) -> float:
    """Median microseconds per weight copy of a CUDA-graph replay of ``run`` (after one warm-up call)."""
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / COPIES)
    return statistics.median(times)


def sweep(gate: torch.Tensor, up: torch.Tensor, weights: list[torch.Tensor]) -> list[tuple[float, dict]]:
    """(us, launch config) for every config that compiles, fastest first."""
    rows = []
    grid = itertools.product((16, 32, 64, 128), (32, 64, 128), (64, 128), (1, 2, 4, 8), (4, 8), (3, 4))
    for bm, bn, bk, splits, warps, stages in grid:
        if bm > max(16, gate.shape[0]):
            continue
        kw = dict(block_m=bm, block_n=bn, block_k=bk, num_splits=splits, num_warps=warps, num_stages=stages)
        try:
            rows.append(
                (graph_us(lambda kw=kw: [mk.silu_down_triton(gate, up, w, **kw) for w in weights], 10), kw)
            )
        except Exception as err:  # a config may not fit in shared memory: skip it
            print(f"  skipped {kw}: {type(err).__name__}")
    return sorted(rows, key=lambda r: r[0])


def report(rows: int, weights: list[torch.Tensor], gen: torch.Generator, with_sweep: bool) -> None:
    """Time the cuBLAS path and the kernel at ``rows`` rows; print the line (and the sweep's best)."""
    gate_up = torch.randn(rows, 2 * INNER, device="cuda", generator=gen, dtype=torch.bfloat16)
    gate, up = gate_up.split(INNER, dim=-1)  # (rows, INNER) views, as the engine passes them
    want = mk.silu_down_reference(gate, up, weights[0])
    err = (mk.silu_down_triton(gate, up, weights[0]).sum(0) - want).abs().max().item()
    cublas = graph_us(lambda: [F.linear(F.silu(gate) * up, w) for w in weights])
    kernel = graph_us(lambda: [mk.silu_down_triton(gate, up, w) for w in weights])
    summed = graph_us(lambda: [mk.silu_down_triton(gate, up, w).sum(0).bfloat16() for w in weights])
    print(
        f"rows {rows}: cuBLAS path {cublas:.1f} us; kernel {kernel:.1f} us (with the sum {summed:.1f}); "
        f"max |kernel - reference| {err:.1e}",
        flush=True,
    )
    if with_sweep:
        for us, kw in sweep(gate, up, weights)[:6]:
            print(f"  {us:.1f} us  {kw}", flush=True)


def main() -> None:
    """Print one line per row count (and the best launch configs with --sweep)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[256, 128, 64])
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    print(f"GPU: {torch.cuda.get_device_name()}  torch {torch.__version__}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [
        torch.randn(HIDDEN, INNER, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
        for _ in range(COPIES)
    ]
    for rows in args.rows:
        report(rows, weights, gen, args.sweep)


if __name__ == "__main__":
    main()
