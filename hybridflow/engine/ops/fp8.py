"""FP8 (e4m3) weights for the rollout: rowwise scales, quantisation, and the scaled matmul of a projection.

A projection weight W (N, K) is stored as ``data`` (N, K) float8_e4m3fn and ``scale`` (N,) float32 with
W ~= data * scale[:, None]; the scale of a row is its largest magnitude over 448 (e4m3's largest finite
value), so every row uses the format's whole range. In a matmul the activations x (M, K) are quantised the
same way per token, and ``torch._scaled_mm`` multiplies in FP8 and applies both scales (rowwise: (M, 1) and
(1, N)) on the way out in the activations' dtype; on CPU the same call runs a reference kernel. The
quantisation is elementwise given the scales, so quantising a slice with the full rows' scales equals slicing
the quantised full weight (the switch relies on that, ``hybrid.resharder``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# Scales never reach zero: an all-zero row (a fresh LoRA-free bias-free pad row) would divide by it.
MIN_SCALE = 1e-12
# The projections quantised (dense attention and MLP); embeddings, the LM head, norms, routers, experts and
# shared experts stay in the rollout dtype.
QUANTISED = re.compile(r"\.self_attn\.[qkvo]_proj\.weight$|\.mlp\.(gate|up|down)_proj\.weight$")


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
    """x (..., K) @ W.T (+ bias) with W in FP8: x quantised per token, one scaled FP8 GEMM; (..., N) in x's
    dtype. Dynamic per-token scales are computed on the device (no host sync: CUDA graphs capture it)."""
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


def fp8_probe(
    hidden: int, intermediate: int, device: torch.device, tokens: int = 64, repeats: int = 20
) -> tuple:
    """(FP8 µs, bf16 µs): the model's gate/up projection on ``tokens`` decode tokens, activation quantisation
    included, median of ``repeats`` timed on ``device`` (CUDA) after a warm-up. The engine keeps bf16 where
    FP8 is not faster (small models at small batch can be slower: the quantisation is a kernel of its own)."""
    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(2 * intermediate, hidden, device=device, generator=g, dtype=torch.bfloat16) * 0.02
    x = torch.randn(tokens, hidden, device=device, generator=g, dtype=torch.bfloat16)
    q = quantise_rows(w)
    out = []
    for run in (lambda: fp8_linear(x, q), lambda: torch.nn.functional.linear(x, w)):
        for _ in range(3):
            run()
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        out.append(sorted(times)[len(times) // 2])
    return out[0], out[1]
