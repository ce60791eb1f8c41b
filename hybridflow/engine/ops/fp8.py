"""FP8 (e4m3) weights for the rollout: rowwise scales, quantisation, and the scaled matmul of a projection.

A projection weight W (N, K) is stored as ``data`` (N, K) float8_e4m3fn and ``scale`` (N,) float32 with
W ~= data * scale[:, None]; the scale of a row is its largest magnitude over 448 (e4m3's largest finite
value), so every row uses the format's whole range. In a matmul the activations x (M, K) are quantised the
same way per token, and ``torch._scaled_mm`` multiplies in FP8 and applies both scales (rowwise: (M, 1) and
(1, N)) on the way out in the activations' dtype; on CPU the same call runs a reference kernel. The
quantisation is elementwise given the scales, so quantising a slice with the full rows' scales equals slicing
the quantised full weight (the switch relies on that, ``hybrid.resharder``).

Two kernels run an FP8 projection (``use_kernel``, picked at start by ``fp8_probe``): ``scaled_mm`` (W8A8, as
above) and ``w8a16`` (``fp8_gemm``: the FP8 weight upcast in registers, bf16 activations, no activation
quantisation; on CPU its torch reference).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from hybridflow.engine.ops import fp8_gemm

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# Scales never reach zero: an all-zero row (a fresh LoRA-free bias-free pad row) would divide by it.
MIN_SCALE = 1e-12
# The projections quantised (dense attention and MLP); embeddings, the LM head, norms, routers, experts and
# shared experts stay in the rollout dtype.
QUANTISED = re.compile(r"\.self_attn\.[qkvo]_proj\.weight$|\.mlp\.(gate|up|down)_proj\.weight$")


FP8_KERNELS = ("w8a16", "scaled_mm")
# The process's FP8 projection kernel: one policy per process, chosen once at start (``use_kernel``) before
# any decode graph is captured, like torch.backends' flags.
_KERNEL = {"name": "scaled_mm"}


def use_kernel(name: str) -> None:
    """Run FP8 projections with ``name`` (one of ``FP8_KERNELS``) from now on in this process."""
    if name not in FP8_KERNELS:
        raise ValueError(f"unknown FP8 kernel {name!r}; use one of {FP8_KERNELS}")
    _KERNEL["name"] = name


def current_kernel() -> str:
    """The FP8 projection kernel in use (``use_kernel``)."""
    return _KERNEL["name"]


@dataclass
class Fp8Weight:
    """A projection's FP8 weight: ``data`` (N, K) float8_e4m3fn and its rows' ``scale`` (N,) float32."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        """The weight's shape (N, K), as a plain weight's."""
        return self.data.shape


def quantisable(name: str, shape: tuple[int, ...]) -> bool:
    """Whether the parameter ``name`` of ``shape`` is delivered in FP8: a dense projection whose dims
    ``_scaled_mm`` takes (multiples of 16)."""
    return bool(QUANTISED.search(name)) and len(shape) == 2 and shape[0] % 16 == 0 and shape[1] % 16 == 0


def row_scales(amax: torch.Tensor) -> torch.Tensor:
    """The float32 scales of rows whose largest magnitudes are ``amax`` (any shape)."""
    return (amax.float() / FP8_MAX).clamp(min=MIN_SCALE)


def quantise(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``w`` (..., K) in FP8 with the scales ``scale`` (...) of its rows (given, e.g. the full rows' ones)."""
    return (w.float() / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantise_rows(w: torch.Tensor) -> Fp8Weight:
    """``w`` (N, K) with rowwise scales of its own rows."""
    scale = row_scales(w.detach().abs().amax(dim=-1))  # (N,)
    return Fp8Weight(quantise(w.detach(), scale), scale)


def dequantise(w: Fp8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight ``w`` stands for, (N, K) in ``dtype``."""
    return (w.data.float() * w.scale.unsqueeze(-1)).to(dtype)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x (..., K) @ W.T (+ bias) with W in FP8, by the kernel in use; (..., N) in x's dtype. ``scaled_mm``:
    x quantised per token on the device (no host sync: CUDA graphs capture it), one scaled FP8 GEMM."""
    if _KERNEL["name"] == "w8a16":
        if x.is_cuda and fp8_gemm.available():
            return fp8_gemm.w8a16_linear(x, w.data, w.scale, bias)
        return fp8_gemm.w8a16_reference(x.reshape(-1, x.shape[-1]), w.data, w.scale, bias).reshape(
            *x.shape[:-1], w.data.shape[0]
        )
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k)  # (M, K)
    sx = row_scales(flat.abs().amax(dim=-1))  # (M,)
    xq = quantise(flat, sx)  # (M, K) fp8
    out = torch._scaled_mm(
        xq, w.data.t(), scale_a=sx.unsqueeze(1), scale_b=w.scale.unsqueeze(0), out_dtype=x.dtype
    )  # (M, N)
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, w.data.shape[0])


def fp8_parameters(module: torch.nn.Module) -> list[str]:
    """Turn ``module``'s quantisable projections into empty FP8 weights with a ``weight_scale`` (N,) buffer
    beside each (filled by the switch); returns their names. ``module`` is a generation shard (no grads)."""
    names = []
    for name, param in list(module.named_parameters()):
        if not quantisable(name, tuple(param.shape)):
            continue
        owner = module.get_submodule(name.rsplit(".", 1)[0])
        data = torch.empty(param.shape, dtype=FP8, device=param.device)
        owner.weight = torch.nn.Parameter(data, requires_grad=False)
        owner.register_buffer("weight_scale", torch.ones(param.shape[0], device=param.device))
        names.append(name)
    return names


@torch.no_grad()
def quantise_module(module: torch.nn.Module) -> list[str]:
    """Quantise ``module``'s dense projections in place (FP8 weights with their rows' scales, as the switch
    delivers them); returns their names. For benchmarks and tests of a module that is not refreshed."""
    weights = {n: p.detach().clone() for n, p in module.named_parameters()}
    names = fp8_parameters(module)
    for name in names:
        q = quantise_rows(weights[name])
        owner = module.get_submodule(name.rsplit(".", 1)[0])
        owner.weight.data.copy_(q.data)
        owner.weight_scale.copy_(q.scale)
    return names


def _graph_us(run, device: torch.device, repeats: int) -> float:
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


def fp8_probe(
    hidden: int, intermediate: int, device: torch.device, tokens: int = 64, repeats: int = 20
) -> dict[str, float]:
    """µs of the model's gate/up projection on ``tokens`` decode tokens for each FP8 kernel (activation
    quantisation included) and for bf16: ``{"w8a16": .., "scaled_mm": .., "bf16": ..}``, medians of
    ``repeats`` graph replays on ``device`` (CUDA). The engine keeps bf16 where no FP8 kernel is faster."""
    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(2 * intermediate, hidden, device=device, generator=g, dtype=torch.bfloat16) * 0.02
    x = torch.randn(tokens, hidden, device=device, generator=g, dtype=torch.bfloat16)
    q = quantise_rows(w)
    before = current_kernel()
    out = {}
    try:
        for name in FP8_KERNELS:
            use_kernel(name)
            out[name] = _graph_us(lambda: fp8_linear(x, q), device, repeats)
    finally:
        use_kernel(before)
    out["bf16"] = _graph_us(lambda: torch.nn.functional.linear(x, w), device, repeats)
    return out
