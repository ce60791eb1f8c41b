"""A decode layer's projections in bf16 against the FP8 kernels, per token count (GPU; not a test).

    python benchmarks/fp8_gemm.py [--shapes 0.5b 1.5b 7b] [--tokens 16 64 256] [--sweep] [--out r.jsonl]
        [--kernels scaled_mm scaled_mm_static triton_w8a8 blockwise w8a16] [--compile]
    python benchmarks/fp8_gemm.py --device cpu --shapes tiny --tokens 4      (a smoke run: no timing)

For each Qwen2.5 shape the layer's projections as the rollout binds them (q/k/v joined: (H + 2 KV) x H, o:
H x H, gate/up joined: 2I x H, down: H x I) run on random bf16 weights and activations, each timed as the median of graph replays (decode runs
in CUDA graphs, so launch costs a graph removes must not count):
  bf16        F.linear on the bf16 weights (cuBLAS);
  scaled_mm   W8A8: per-token activation quantisation + torch._scaled_mm with rowwise scales;
  scaled_mm_static  W8A8 with a static activation scale (set beforehand, as calibrated): elementwise
              quantisation (divide, clamp, cast) + torch._scaled_mm with the scale as a contiguous (M, 1);
  blockwise   W8A8 with 1x128 activation / 128x128 weight scales (torch._scaled_mm's blockwise pairs; reported
              as unsupported where this torch/cuBLASLt refuses them); GEMM only, quantisation not counted;
  triton_w8a8 static scales and ``engine.ops.fp8_w8a8``'s Triton W8A8 kernel, which quantises the bf16 input
              as it loads it (as for o_proj); ``triton_w8a8_fp8_in``: the same on an input quantised upstream
              (as a fused norm hands it over), ``triton_w8a8_best`` with ``--sweep``: its best configuration;
  w8a16       the weight-only Triton kernel (``engine.ops.fp8_gemm``) with its configuration table;
  w8a16_best  with ``--sweep``: the fastest of a grid of launch configurations, and which one.
``--kernels`` picks the FP8 variants (bf16 always runs). ``--compile``: each projection is timed with the op
that produces its input in a decode layer (RMSNorm of the residual for q/k/v, o and gate/up; SiLU-mul for down),
the two compiled together by inductor as the compiled decode step is, so the static quantisation can fuse into
that op (bf16 likewise: norm + GEMM); only bf16 and the W8A8 kernels run then (the o projection's
real producer is attention, which does not fuse: its figure is the best case). The same rows also time the
uncompiled pair an eager decode graph runs: ``bf16_eager`` (the torch producer + cuBLAS) against
``scaled_mm_static_fused`` / ``triton_w8a8_fused`` (``engine.ops.fp8_fused``'s Triton producer that
quantises as it writes, then the kernel).
The layer's sum and the ratio to bf16 are printed as one JSON line per (shape, tokens); the table of
``fp8_gemm._CONFIGS`` and ``fp8_w8a8._CONFIGS`` are meant to be set from the sweep.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch
from shapes import SHAPES

from hybridflow.engine.ops import fp8_fused, fp8_gemm, fp8_w8a8
from hybridflow.engine.ops.fp8 import act_scale_for, fp8_linear, quantise_rows, use_kernel
from hybridflow.engine.ops.fp8_probe import graph_us as _graph_us
from hybridflow.engine.rollout.blocks import rms_norm

KERNELS = ("scaled_mm", "scaled_mm_static", "triton_w8a8", "blockwise", "w8a16")
COMPILED = ("scaled_mm", "scaled_mm_static", "triton_w8a8")  # the variants --compile times (beside bf16)

SWEEP = [
    (bm, bn, bk, 4, st)
    for bm, bn, bk, st in itertools.product((16, 32, 64, 128), (16, 32, 64, 128), (64, 128, 256), (3, 4))
]
# The W8A8 kernel's grid: its M tile is the batch's (16 / 32 / 64, or 64 / 128 at 256 tokens).
SWEEP_W8A8 = [
    (bn, bk, w, st) for bn, bk, w, st in itertools.product((32, 64, 128), (128, 256), (4, 8), (3, 5))
]


def projections(shape: dict) -> dict[str, tuple[int, int, int]]:
    """name -> (N, K, copies per layer): as the rollout binds them, q/k/v and gate/up joined."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    return {"qkv": (h + 2 * kv, h, 1), "o": (h, h, 1), "gate_up": (2 * i, h, 1), "down": (h, i, 1)}


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


def time_projection(
    n: int, k: int, m: int, device: torch.device, args: argparse.Namespace, down: bool
) -> dict:
    """µs of each variant of one (N, K) projection on m tokens (``down``: its input is a SiLU-mul's)."""
    if args.compile:
        return time_compiled(n, k, m, device, args.kernels, down)
    g = torch.Generator(device=device).manual_seed(n + k)
    w = torch.randn(n, k, device=device, generator=g, dtype=torch.bfloat16) * 0.02
    x = torch.randn(m, k, device=device, generator=g, dtype=torch.bfloat16)
    q = quantise_rows(w)
    q.act_scale = act_scale_for(x.abs().amax()).reshape(1)  # (1,): as calibrated on a prefill
    out = {"bf16": _graph_us(lambda: torch.nn.functional.linear(x, w), device, 20)}
    for name in ("scaled_mm", "scaled_mm_static", "triton_w8a8"):
        if name in args.kernels:
            use_kernel(name)
            out[name] = _graph_us(lambda: fp8_linear(x, q, static=True), device, 20)
    if "triton_w8a8" in args.kernels:  # the input quantised upstream (a fused norm's output): GEMM alone
        xq = (x.float() / q.act_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        out["triton_w8a8_fp8_in"] = _graph_us(
            lambda: fp8_w8a8.w8a8_linear(xq, q.act_scale, q.data, q.scale), device, 20
        )
        if args.sweep:
            out["triton_w8a8_sweep"] = sweep_w8a8(xq, q, m, device)
            best = min(out["triton_w8a8_sweep"], key=out["triton_w8a8_sweep"].get)
            out["triton_w8a8_best"], out["triton_w8a8_best_config"] = out["triton_w8a8_sweep"][best], best
    if "blockwise" in args.kernels:
        out["blockwise"] = blockwise_us(x, w, device)
    if "w8a16" in args.kernels:
        out["w8a16"] = _graph_us(lambda: fp8_gemm.w8a16_linear(x, q.data, q.scale), device, 20)
    if args.sweep and "w8a16" in args.kernels:
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


def sweep_w8a8(xq: torch.Tensor, q, m: int, device: torch.device) -> dict[str, float]:
    """µs of the W8A8 kernel on FP8 input ``xq`` (m, K) per launch configuration ("bm,bn,bk,warps,stages")."""
    times = {}
    for bm in sorted({max(16, min(m, 64)), max(16, min(m, 128))}):
        for bn, bk, warps, stages in SWEEP_W8A8:
            cfg = (bm, bn, bk, warps, stages)
            try:
                us = _graph_us(
                    lambda c=cfg: fp8_w8a8.w8a8_linear(xq, q.act_scale, q.data, q.scale, config=c), device, 10
                )
            except Exception:  # a config the GPU cannot fit (shared memory): skip it
                continue
            times[",".join(map(str, cfg))] = us
    return times


def pick_table(rows: list[dict]) -> list[tuple[int, dict[str, list[int]]]]:
    """A W8A8 table from a sweep's rows in ``fp8_w8a8._CONFIGS``'s layout: per token count swept and projection
    class, the configuration (among those that ran on every projection of the class) least slower than each
    projection's best, summed; each token count's row covers up to it. Where cuBLAS should run instead is
    left to the reader (the rows' ``scaled_mm_static`` column)."""
    table = []
    for m in sorted({r["tokens"] for r in rows}):
        by_class: dict[str, list[dict[str, float]]] = {}
        for r in (r for r in rows if r["tokens"] == m):
            for name, (n, k, _) in projections(SHAPES[r["shape"]]).items():
                times = r[name]["triton_w8a8_sweep"]
                best = min(times.values())
                by_class.setdefault(fp8_w8a8.projection_class(n, k), []).append(
                    {c: us / best for c, us in times.items()}
                )
        row = {}
        for cls, ratios in by_class.items():
            ran = set.intersection(*(set(r) for r in ratios))
            pick = min(ran, key=lambda c: sum(r[c] for r in ratios))
            row[cls] = [int(v) for v in pick.split(",")]
        table.append((m, row))
    return table


def time_compiled(n: int, k: int, m: int, device: torch.device, kernels: list[str], down: bool) -> dict:
    """µs of producer + projection compiled together (``--compile``), for bf16 and the kernels that quantise
    the activations (where fusing the quantisation into the producer is the point)."""
    g = torch.Generator(device=device).manual_seed(n + k)
    w = torch.randn(n, k, device=device, generator=g, dtype=torch.bfloat16) * 0.02
    h = torch.randn(m, k, device=device, generator=g, dtype=torch.bfloat16)  # residual, or the gate half
    u = torch.randn(m, k, device=device, generator=g, dtype=torch.bfloat16)  # the up half (down only)
    norm = torch.ones(k, device=device, dtype=torch.bfloat16)

    def produce() -> torch.Tensor:
        return torch.nn.functional.silu(h) * u if down else rms_norm(h, norm, 1e-6)  # (m, k)

    q = quantise_rows(w)
    q.act_scale = act_scale_for(produce().abs().amax()).reshape(1)  # (1,): as calibrated on a prefill
    fns = {"bf16": lambda: torch.nn.functional.linear(produce(), w)}
    fns.update({name: lambda: fp8_linear(produce(), q, static=True) for name in COMPILED if name in kernels})
    out = {}
    for name, fn in fns.items():
        if name != "bf16":
            use_kernel(name)
        torch._dynamo.reset()  # a fresh cache per variant: no recompile limit, no shape generalisation
        out[name] = _graph_us(torch.compile(fn, fullgraph=True, dynamic=False), device, 20)
    out["bf16_eager"] = _graph_us(fns["bf16"], device, 20)
    for name in ("scaled_mm_static", "triton_w8a8"):
        if name not in kernels:
            continue
        use_kernel(name)

        def fused() -> torch.Tensor:
            s = q.act_scale
            x = fp8_fused.silu_mul_quant(h, u, s) if down else fp8_fused.rms_norm_quant(h, norm, 1e-6, s)
            return fp8_linear(x, q)

        out[f"{name}_fused"] = _graph_us(fused, device, 20)
    return out


def run(size: str, m: int, device: torch.device, args: argparse.Namespace) -> dict:
    row: dict = {
        "shape": size,
        "tokens": m,
        "gpu": torch.cuda.get_device_name(device),
        "compile": args.compile,
    }
    totals: dict[str, float | None] = {}
    for name, (n, k, copies) in projections(SHAPES[size]).items():
        times = time_projection(n, k, m, device, args, down=name == "down")
        row[name] = times
        for kernel, us in times.items():
            if not isinstance(us, float | None):  # a configuration, or the sweep's table
                continue
            prev = totals.get(kernel, 0.0)
            totals[kernel] = None if us is None or prev is None else prev + copies * us
    row["layer_us"] = totals
    row["vs_bf16"] = {k: totals["bf16"] / v for k, v in totals.items() if v}
    return row


def smoke(size: str, m: int, kernels: list[str]) -> dict:
    """CPU: the kernels' results agree with the weight-only reference (no timing)."""
    n, k, _ = projections(SHAPES[size])["gate_up"]
    w = torch.randn(n, k) * 0.02
    x = torch.randn(m, k)
    q = quantise_rows(w)
    q.act_scale = act_scale_for(x.abs().amax()).reshape(1)
    ref = fp8_gemm.w8a16_reference(x, q.data, q.scale)
    got = fp8_gemm.w8a16_linear(x, q.data, q.scale) if fp8_gemm._interpreting() else ref
    row = {"shape": size, "tokens": m, "max_abs_diff": float((got - ref).abs().max())}
    for name in COMPILED:  # W8A8: the activations' rounding too, relative to the output's norm
        if name in kernels:
            use_kernel(name)
            y = fp8_linear(x, q, static=True)
            row[f"{name}_rel_err"] = float((y - ref).norm() / ref.norm())
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["0.5b", "1.5b", "7b"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--sweep", action="store_true", help="also search the Triton launch configurations")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=KERNELS, help="FP8 variants run")
    ap.add_argument("--compile", action="store_true", help="producer + projection compiled (see above)")
    ap.add_argument("--out", type=Path, default=None, help="append the JSON lines here")
    ap.add_argument(
        "--pick-table", type=Path, default=None, help="with --sweep: write the W8A8 table chosen here (JSON)"
    )
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = []
    for size, m in itertools.product(args.shapes, args.tokens):
        row = run(size, m, device, args) if device.type == "cuda" else smoke(size, m, args.kernels)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out is not None:
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")
    if args.pick_table is not None and args.sweep and device.type == "cuda":
        table = pick_table(rows)
        args.pick_table.write_text(json.dumps({"configs": table}))
        print("W8A8 table:", table, flush=True)


if __name__ == "__main__":
    main()
