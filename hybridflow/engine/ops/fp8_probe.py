"""The start-up probe that picks the FP8 projection kernel: one decode layer's projections timed per kernel.

Whether FP8 weights pay depends on the GPU, the model's widths and the kernel: on an H200 cuBLAS's FP8 GEMM
loses to bf16 on the 0.5B shape's small projections while the Triton W8A8 kernel wins on the 7B's
(benchmarks/RESULTS.md, issue 45). So the engine measures before it decides: every projection of one layer
at this rank's tensor-parallel widths (q/k/v joined, o, gate/up joined, down), each with the op that produces
its input in a decode step (the RMSNorm, the attention output, the SiLU-mul), replayed from a CUDA graph as
decode runs, over enough layers' weights that they stream from HBM as decode's do (a small model's layer
replayed alone stays in L2). The static kernels' producers are ``fp8_fused``'s norm / SiLU-mul kernels that quantise as they
write, as an uncompiled decode runs them; the attention output goes through ``fp8_fused.quant``. A compiled
decode fuses the producers for bf16 too (on the 0.5B shape at batch 64 the compiled bf16 decode is ~1.8x the
uncompiled one), so there only the GEMMs are compared (``compiled``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybridflow.engine.ops import fp8_fused
from hybridflow.engine.ops.fp8 import (
    FP8_KERNELS,
    STATIC_KERNELS,
    Fp8Weight,
    act_scale_for,
    current_kernel,
    fp8_linear,
    quantise_rows,
    quantise_static,
    use_kernel,
)

# FP8 is kept only where its layer is at least this much faster than bf16's: a near tie is not worth FP8's
# fixed costs (quantising at every switch, a per-token calibrating prefill, the rollout-trainer mismatch). On
# an H200 the compiled 0.5B decode probes at 26.1 against 26.4 µs, and its W1 step was slower in FP8 (1.05
# against 0.87 s; benchmarks/RESULTS.md, issue 45).
MIN_GAIN = 1.05


def pick_kernel(probe: dict[str, float], asked: str = "auto") -> tuple[str, bool]:
    """(the FP8 kernel to use: the probe's fastest, or ``asked``; whether it pays: ``MIN_GAIN`` x faster than
    bf16) from ``fp8_probe``'s figures."""
    kernel = min(FP8_KERNELS, key=probe.get) if asked == "auto" else asked
    return kernel, probe[kernel] * MIN_GAIN < probe["bf16"]


def graph_us(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median µs of one ``run()`` replayed from a CUDA graph of 10 calls (decode runs in graphs: launch costs
    that a graph removes must not decide the kernel)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(3):
            run()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            run()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / 10)
    return sorted(times)[len(times) // 2]


def _rms_norm(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """blocks.rms_norm (HF's order of casts), without importing the rollout layer."""
    hf = h.float()
    return weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)


def _randn(g: torch.Generator, device: torch.device, *shape: int, std: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, device=device, generator=g, dtype=torch.bfloat16) * std


def _weights(
    dims: tuple[int, int, int, int], g: torch.Generator, device: torch.device
) -> tuple[dict[str, torch.Tensor], dict[str, Fp8Weight]]:
    """Random bf16 weights of one layer's projections (hidden, q/k/v rows, attention width, intermediate) and
    their FP8 copies (no activation scales yet)."""
    hidden, qkv, attn, inter = dims
    w = {"qkv": _randn(g, device, qkv, hidden, std=0.02), "o": _randn(g, device, hidden, attn, std=0.02)}
    w |= {
        "gate_up": _randn(g, device, 2 * inter, hidden, std=0.02),
        "down": _randn(g, device, hidden, inter, std=0.02),
    }
    return w, {name: quantise_rows(t) for name, t in w.items()}


def copies_for(layer_bytes: int, l2_bytes: int, model_layers: int) -> int:
    """How many layers the probe cycles through: enough that their FP8 weights are twice the GPU's L2 cache
    (decode streams every layer's weights from HBM once a step, and a small layer replayed alone would stay in
    L2), but no more than the model has (a model whose weights fit in L2 decodes from L2 too)."""
    return max(1, min(model_layers, math.ceil(2 * l2_bytes / max(1, layer_bytes))))


def _copies(q: dict[str, Fp8Weight], device: torch.device, model_layers: int) -> int:
    """``copies_for`` this layer's FP8 weights (one byte an element) on ``device`` (1 off CUDA)."""
    if device.type != "cuda":
        return 1
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    return copies_for(sum(t.data.numel() for t in q.values()), l2, model_layers)


def layer_runs(
    dims: tuple[int, int, int, int],
    tokens: int,
    device: torch.device,
    compiled: bool = False,
    model_layers: int = 32,
) -> tuple[Callable[[], list[torch.Tensor]], Callable[[], list[torch.Tensor]], int]:
    """(bf16 run, FP8 run under the kernel in use, layers per run): one decode step's projections over enough
    random layers of ``dims`` (hidden, q/k/v rows, attention width, intermediate; ``_copies``), each with its
    producer (see ``fp8_probe``), on ``tokens`` tokens; each run returns the last layer's four outputs."""
    g = torch.Generator(device=device).manual_seed(0)
    hidden, _, attn, inter = dims
    x = {n: _randn(g, device, tokens, k) for n, k in (("h", hidden), ("a", attn), ("g", inter), ("u", inter))}
    x["norm"] = 1 + 0.1 * _randn(g, device, hidden)
    layers = [_weights(dims, g, device)]
    copies = _copies(layers[0][1], device, model_layers)
    layers += [_weights(dims, g, device) for _ in range(copies - 1)]
    normed, act = _rms_norm(x["h"], x["norm"]), F.silu(x["g"]) * x["u"]
    inputs = {"qkv": normed, "o": x["a"], "gate_up": normed, "down": act}
    ready = {}  # the static kernels' inputs as a compiled producer hands them over
    for name, t in inputs.items():
        scale = act_scale_for(t.abs().amax()).reshape(1)  # (1,): as calibrated on a prefill
        for _, q in layers:
            q[name].act_scale = scale
        rows = scale.expand(tokens, 1).contiguous()  # (M, 1)
        ready[name] = fp8_fused.QuantisedInput(quantise_static(t, scale), rows, (tokens,), t.dtype)

    def bf16() -> list[torch.Tensor]:
        for w, _ in layers:
            h = normed if compiled else _rms_norm(x["h"], x["norm"])
            a = act if compiled else F.silu(x["g"]) * x["u"]
            out = [
                F.linear(h, w["qkv"]),
                F.linear(x["a"], w["o"]),
                F.linear(h, w["gate_up"]),
                F.linear(a, w["down"]),
            ]
        return out  # the last layer's: what the tests compare

    def fp8() -> list[torch.Tensor]:
        static = current_kernel() in STATIC_KERNELS and fp8_fused.available()
        for _, q in layers:
            if static and compiled:
                out = [fp8_linear(ready[name], q[name]) for name in ("qkv", "o", "gate_up", "down")]
                continue
            h = {}
            for name in ("qkv", "gate_up"):
                s = q[name].act_scale
                h[name] = (
                    fp8_fused.rms_norm_quant(x["h"], x["norm"], 1e-6, s)
                    if static
                    else _rms_norm(x["h"], x["norm"])
                )
            s = q["down"].act_scale
            a = fp8_fused.silu_mul_quant(x["g"], x["u"], s) if static else F.silu(x["g"]) * x["u"]
            out = [fp8_linear(h["qkv"], q["qkv"], static=True), fp8_linear(x["a"], q["o"], static=True)]
            out += [
                fp8_linear(h["gate_up"], q["gate_up"], static=True),
                fp8_linear(a, q["down"], static=True),
            ]
        return out

    return bf16, fp8, len(layers)


def fp8_probe(
    hidden: int,
    intermediate: int,
    device: torch.device,
    q_dim: int | None = None,
    kv_dim: int | None = None,
    tp: int = 1,
    tokens: int = 64,
    repeats: int = 20,
    compiled: bool = False,
    model_layers: int = 32,
) -> dict[str, float]:
    """µs of one decode layer's projections with their producers on ``tokens`` tokens, per FP8 kernel and for
    bf16: ``{"w8a16": .., "scaled_mm": .., "scaled_mm_static": .., "triton_w8a8": .., "bf16": ..}``, medians of
    ``repeats`` graph replays on ``device`` (CUDA) over enough layers to stream the weights from HBM, per
    layer. ``q_dim``, ``kv_dim``: the q and K/V projections' widths (default ``hidden``); ``tp``: the
    rollout's tensor-parallel degree (each rank's slices). ``compiled``: the decode step is compiled, where
    inductor fuses the producers (and a static quantisation) for bf16 and FP8 alike, so the static kernels and
    bf16 are timed on ready inputs, the GEMMs alone. ``model_layers``: the model's decoder layers (at most
    that many are cycled). The engine keeps bf16 where no FP8 kernel is faster (``pick_kernel``)."""
    qd = hidden if q_dim is None else q_dim
    kv = qd if kv_dim is None else kv_dim
    dims = (hidden, (qd + 2 * kv) // tp, qd // tp, intermediate // tp)
    bf16, fp8, layers = layer_runs(dims, tokens, device, compiled, model_layers)
    before = current_kernel()
    out = {}
    try:
        for name in FP8_KERNELS:
            use_kernel(name)
            out[name] = graph_us(fp8, device, repeats) / layers
    finally:
        use_kernel(before)
    out["bf16"] = graph_us(bf16, device, repeats) / layers
    return out
