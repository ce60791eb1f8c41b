"""A decode layer's projections in bf16 against the FP8 kernels, per token count (GPU; not a test).

    python benchmarks/fp8_gemm.py [--shapes 0.5b 1.5b 7b] [--tokens 16 64 256] [--sweep] [--out r.jsonl]
    python benchmarks/fp8_gemm.py --device cpu --shapes tiny --tokens 4      (a smoke run: no timing)

For each Qwen2.5 shape the layer's projections (q and o: H x H, k and v: KV x H, gate and up: I x H, down:
H x I) run on random bf16 weights and activations, each timed as the median of graph replays (decode runs
in CUDA graphs, so launch costs a graph removes must not count):
  bf16        F.linear on the bf16 weights (cuBLAS);
  scaled_mm   W8A8: per-token activation quantisation + torch._scaled_mm with rowwise scales;
  blockwise   W8A8 with 1x128 activation / 128x128 weight scales (torch._scaled_mm's blockwise pairs; reported
              as unsupported where this torch/cuBLASLt refuses them); GEMM only, quantisation not counted;
  w8a16       the weight-only Triton kernel (``engine.ops.fp8_gemm``) with its configuration table;
  w8a16_best  with ``--sweep``: the fastest of a grid of launch configurations, and which one.
The layer's sum and the ratio to bf16 are printed as one JSON line per (shape, tokens); the table of
``fp8_gemm._CONFIGS`` is meant to be set from the sweep.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
from shapes import SHAPES

from hybridflow.engine.ops import fp8_gemm
from hybridflow.engine.ops.fp8 import _graph_us, fp8_linear, quantise_rows, use_kernel

SWEEP = [
    (bm, bn, bk, 4, st)
    for bm, bn, bk, st in itertools.product((16, 32, 64, 128), (16, 32, 64, 128), (64, 128, 256), (3, 4))
]


def projections(shape: dict) -> dict[str, tuple[int, int, int]]:
    """name -> (N, K, copies per layer)."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    return {"q_o": (h, h, 2), "k_v": (kv, h, 2), "gate_up": (i, h, 2), "down": (h, i, 1)}


def blockwise_us(x: torch.Tensor, w: torch.Tensor, device: torch.device) -> float | None:
    """µs of the blockwise-scaled GEMM (quantisation not counted), or None where it is refused."""
    m, k = x.shape
    n = w.shape[0]
    if k % 128 or n % 128:
        return None
    xq = x.to(torch.float8_e4m3fn)
    wq = w.to(torch.float8_e4m3fn)
    # The scale layouts torch has asked for differ between versions: try each (values are all ones).
    layouts = [
        (torch.ones(k // 128, m, device=device).t(), torch.ones(k // 128, n // 128, device=device)),
        (torch.ones(m, k // 128, device=device), torch.ones(n // 128, k // 128, device=device).t()),
        (torch.ones(k // 128, m, device=device).t(), torch.ones(n // 128, k // 128, device=device).t()),
        (torch.ones(m, k // 128, device=device), torch.ones(k // 128, n // 128, device=device)),
    ]
    for sa, sb in layouts:
        try:
            torch._scaled_mm(xq, wq.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
        except (RuntimeError, ValueError):
            continue
        return _graph_us(
            lambda sa=sa, sb=sb: torch._scaled_mm(
                xq, wq.t(), scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16
            ),
            device,
            20,
        )
    return None


def time_projection(n: int, k: int, m: int, device: torch.device, sweep: bool) -> dict:
    g = torch.Generator(device=device).manual_seed(n + k)
    w = torch.randn(n, k, device=device, generator=g, dtype=torch.bfloat16) * 0.02
    x = torch.randn(m, k, device=device, generator=g, dtype=torch.bfloat16)
    q = quantise_rows(w)
    out = {"bf16": _graph_us(lambda: torch.nn.functional.linear(x, w), device, 20)}
    use_kernel("scaled_mm")
    out["scaled_mm"] = _graph_us(lambda: fp8_linear(x, q), device, 20)
    out["blockwise"] = blockwise_us(x, w, device)
    out["w8a16"] = _graph_us(lambda: fp8_gemm.w8a16_linear(x, q.data, q.scale), device, 20)
    if sweep:
        best = (out["w8a16"], fp8_gemm.config_for(m))
        for cfg in SWEEP:
            if cfg[0] > max(16, 2 * m):
                continue
            try:
                us = _graph_us(lambda c=cfg: fp8_gemm.w8a16_linear(x, q.data, q.scale, config=c), device, 10)
            except Exception:  # a config the GPU cannot fit (shared memory): skip it
                continue
            best = min(best, (us, cfg))
        out["w8a16_best"], out["w8a16_best_config"] = best
    return out


def run(size: str, m: int, device: torch.device, sweep: bool) -> dict:
    row: dict = {"shape": size, "tokens": m, "gpu": torch.cuda.get_device_name(device)}
    totals: dict[str, float | None] = {}
    for name, (n, k, copies) in projections(SHAPES[size]).items():
        times = time_projection(n, k, m, device, sweep)
        row[name] = times
        for kernel, us in times.items():
            if kernel.endswith("config"):
                continue
            prev = totals.get(kernel, 0.0)
            totals[kernel] = None if us is None or prev is None else prev + copies * us
    row["layer_us"] = totals
    row["vs_bf16"] = {k: totals["bf16"] / v for k, v in totals.items() if v}
    return row


def smoke(size: str, m: int) -> dict:
    """CPU: the kernels' results agree (no timing)."""
    n, k, _ = projections(SHAPES[size])["gate_up"]
    w = torch.randn(n, k) * 0.02
    x = torch.randn(m, k)
    q = quantise_rows(w)
    ref = fp8_gemm.w8a16_reference(x, q.data, q.scale)
    got = fp8_gemm.w8a16_linear(x, q.data, q.scale) if fp8_gemm._interpreting() else ref
    return {"shape": size, "tokens": m, "max_abs_diff": float((got - ref).abs().max())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["0.5b", "1.5b", "7b"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--sweep", action="store_true", help="also search the Triton launch configurations")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=None, help="append the JSON lines here")
    args = ap.parse_args()
    device = torch.device(args.device)
    for size, m in itertools.product(args.shapes, args.tokens):
        row = run(size, m, device, args.sweep) if device.type == "cuda" else smoke(size, m)
        print(json.dumps(row), flush=True)
        if args.out is not None:
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
