"""Paged decode attention's achieved HBM bandwidth against the card's, over contexts and batches (GPU; not a test).

    python benchmarks/decode_attention.py [--contexts 512 1024 2048 4096 8192] [--batches 64 256 1024 2048]
        [--heads 14 2 64] [--block-size 128] [--fp8-kv] [--out FILE.jsonl]

One layer's decode attention as the engine launches it (``decode_attention_triton`` on a paged cache through
block tables, bf16 or FP8 KV), every row at the full context, the blocks of a row scattered over the cache as a
long-running engine leaves them. Bytes are the K and V in context plus q and the output; the card's bandwidth is
a 1 GiB device-to-device copy (read + write) measured at start. Each cell is the median of 5 timings of 20
back-to-back launches (CUDA events). Rows whose cache would pass ``--max-gb`` are skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics

import torch
from decode_profile import copy_bandwidth

from hybridflow.engine.rollout.decode_attention import decode_attention_triton, launch_config, split_layout


def time_launches(fn, launches: int = 20, repeats: int = 5) -> float:
    """Median seconds of one launch of ``fn`` over ``repeats`` timings of ``launches`` back to back."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(launches):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / launches)
    return statistics.median(times)


def paged_case(batch: int, context: int, heads: int, kv_heads: int, dim: int, block: int, fp8: bool):
    """(q, k cache, v cache, positions, tables, kv scales) for ``batch`` rows at ``context`` positions."""
    dev = torch.device("cuda")
    per_row = math.ceil((context + 1) / block)
    blocks = batch * per_row
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(batch, heads, 1, dim, device=dev, dtype=torch.bfloat16, generator=g)  # (B, H, 1, D)
    shape = (blocks, kv_heads, block, dim)
    k = torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=g)  # (blocks, KVH, block, D)
    v = torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=g)
    scales = None
    if fp8:
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        scales = torch.ones(2, kv_heads, device=dev)  # (2, KVH)
    tables = (
        torch.randperm(blocks, device=dev, generator=g).view(batch, per_row).to(torch.int32)
    )  # (B, blocks)
    positions = torch.full((batch,), context, device=dev, dtype=torch.int64)  # (B,)
    return q, k, v, positions, tables, scales


def measure(batch: int, context: int, heads: int, kv_heads: int, dim: int, block: int, fp8: bool):
    """(seconds per launch, bytes moved, splits per row and KV head) of one cell."""
    q, k, v, pos, tables, scales = paged_case(batch, context, heads, kv_heads, dim, block, fp8)
    seconds = time_launches(
        lambda: decode_attention_triton(q, k, v, pos, dim**-0.5, table=tables, kv_scales=scales)
    )
    moved = 2 * batch * (context + 1) * kv_heads * dim * k.element_size() + 2 * q.numel() * q.element_size()
    block_n = launch_config(batch, kv_heads, q.device)[0]
    splits, _ = split_layout(batch, kv_heads, tables.shape[1] * block, block_n, None, q.device)
    return seconds, moved, splits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256, 1024, 2048])
    ap.add_argument(
        "--heads", type=int, nargs=3, default=[14, 2, 64], metavar=("H", "KVH", "D"), help="0.5B's by default"
    )
    ap.add_argument("--block-size", type=int, default=128)
    ap.add_argument("--fp8-kv", action="store_true", help="an FP8 cache (one byte per value)")
    ap.add_argument("--max-gb", type=float, default=24.0, help="skip cells whose cache is larger")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    heads, kv_heads, dim = args.heads
    peak = copy_bandwidth(torch.device("cuda"))
    name = torch.cuda.get_device_name(0)
    print(f"{name}: copy bandwidth {peak / 1e12:.2f} TB/s; H {heads}, KVH {kv_heads}, D {dim}, "
          f"block {args.block_size}, KV {'fp8' if args.fp8_kv else 'bf16'}")  # fmt: skip
    print(f"{'batch':>6} {'context':>8} {'splits':>7} {'us':>9} {'TB/s':>7} {'of copy':>8}")
    item = 1 if args.fp8_kv else 2
    for batch in args.batches:
        for context in args.contexts:
            kv_bytes = 2 * batch * (context + 1) * kv_heads * dim * item
            if kv_bytes / 1e9 > args.max_gb:
                continue
            seconds, moved, splits = measure(
                batch, context, heads, kv_heads, dim, args.block_size, args.fp8_kv
            )
            tbs = moved / seconds / 1e12
            print(
                f"{batch:6d} {context:8d} {splits:7d} {seconds * 1e6:9.1f} {tbs:7.2f} {tbs * 1e12 / peak:8.1%}"
            )
            if args.out:
                with open(args.out, "a") as f:
                    row = dict(gpu=name, batch=batch, context=context, us=seconds * 1e6, tb_s=tbs,
                               fraction=tbs * 1e12 / peak, heads=args.heads, fp8_kv=args.fp8_kv)  # fmt: skip
                    f.write(json.dumps(row) + "\n")
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
