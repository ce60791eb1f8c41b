"""FP8 (e4m3) weights for the rollout: rowwise scales, quantisation, and the scaled matmul of a projection.

A projection weight W (N, K) is stored as ``data`` (N, K) float8_e4m3fn and ``scale`` (N,) float32 with
W ~= data * scale[:, None]; the scale of a row is its largest magnitude over 448 (e4m3's largest finite
value), so every row uses the format's whole range. In a matmul the activations x (M, K) are quantised the
same way per token, and ``torch._scaled_mm`` multiplies in FP8 and applies both scales (rowwise: (M, 1) and
(1, N)) on the way out in the activations' dtype; on CPU the same call runs a reference kernel. The
quantisation is elementwise given the scales, so quantising a slice with the full rows' scales equals slicing
the quantised full weight (the switch relies on that, ``hybrid.resharder``).

Four kernels run an FP8 projection (``use_kernel``, picked at start by ``fp8_probe``): ``scaled_mm`` (W8A8, as
above), ``scaled_mm_static`` (W8A8 with a static activation scale, below), ``triton_w8a8`` (static scales too,
and ``fp8_w8a8``'s Triton GEMM tiled for decode batches, where its table says it is faster; ``_scaled_mm``
elsewhere and on CPU outside Triton's interpreter) and ``w8a16`` (``fp8_gemm``: the FP8
weight upcast in registers, bf16 activations, no activation quantisation; on CPU its torch reference).

Static activation scales (``STATIC_KERNELS``): per-token quantisation is a reduction (the row's amax) before
the elementwise divide, a chain of separate kernels that cost ~20 us a projection eagerly (benchmarks/
RESULTS.md, "FP8, second pass"). With one float32 scale per projection input (``Fp8Weight.act_scale``, (1,),
shared by the projections that read the same activations: q/k/v, gate/up) the quantisation is elementwise,
``(x / s).clamp(-448, 448)`` cast to e4m3, which inductor fuses into the RMSNorm or SiLU-mul that produced x
when the decode step is compiled, and ``fp8_fused``'s Triton kernels do in that op's place when it is not
(CUDA; they hand over a ``QuantisedInput``; an input no fused op produced, the attention output, goes through
``fp8_fused.quant``: one kernel). The scales are calibrated on the first prefill after each weight refresh
(``calibrate_act_scale``, margin ``ACT_SCALE_MARGIN``) and filled in place, so a CUDA graph captured on them stays
valid; that prefill, and any forward before the first calibration, runs the per-token path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from hybridflow.engine.ops import fp8_fused, fp8_gemm, fp8_w8a8
from hybridflow.engine.ops.fp8_fused import QuantisedInput

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# Scales never reach zero: an all-zero row (a fresh LoRA-free bias-free pad row) would divide by it.
MIN_SCALE = 1e-12
# The projections quantised (dense attention and MLP); embeddings, the LM head, norms, routers, experts and
# shared experts stay in the rollout dtype.
QUANTISED = re.compile(r"\.self_attn\.[qkvo]_proj\.weight$|\.mlp\.(gate|up|down)_proj\.weight$")


FP8_KERNELS = ("w8a16", "scaled_mm", "scaled_mm_static", "triton_w8a8")
# The kernels that quantise calibrated inputs with a static scale (``Fp8Weight.act_scale``).
STATIC_KERNELS = ("scaled_mm_static", "triton_w8a8")
# The calibrated range of a static activation scale over the calibrating prefill's largest magnitude: the
# scale is margin * amax / 448. As the KV cache's (kv_cache.KV_SCALE_MARGIN), and for the same reasons:
# e4m3 keeps ~6% relative precision over its 17 binades, so 2x headroom costs one binade at the bottom (values
# below amax / 14000 go subnormal, noise against the amax-sized ones in the same dot product), while a decode
# token whose activation exceeds every prompt token's by up to 2x is still represented instead of saturating.
# The outliers that set amax (the massive activations of a few channels, largest at the first and delimiter
# tokens) are in every prompt, so the prefill sees them; beyond 2x the value saturates at 448 * scale.
ACT_SCALE_MARGIN = 2.0
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
    # (1,) float32: the static scale of the input activations (``STATIC_KERNELS``), one tensor shared by the
    # projections of one input and filled in place by ``calibrate_act_scale``; None: per-token only.
    act_scale: torch.Tensor | None = None

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


def fp8_linear(
    x: torch.Tensor | QuantisedInput, w: Fp8Weight, bias: torch.Tensor | None = None, static: bool = False
) -> torch.Tensor:
    """x (..., K) @ W.T (+ bias) with W in FP8, by the kernel in use; (..., N) in x's dtype. ``scaled_mm``:
    x quantised per token on the device (no host sync: CUDA graphs capture it), one scaled FP8 GEMM.
    ``static`` (the caller's scales are calibrated) with a static kernel and ``w.act_scale``: x quantised
    elementwise with that scale instead (``quantise_static``), or already so (a ``QuantisedInput``)."""
    if isinstance(x, QuantisedInput):  # fp8_fused's kernels quantised it with w.act_scale
        return _gemm(x.data, x.rows, w, bias, x.dtype).reshape(*x.lead, w.data.shape[0])
    name = _KERNEL["name"]
    if name == "w8a16":
        if x.is_cuda and fp8_gemm.available():
            return fp8_gemm.w8a16_linear(x, w.data, w.scale, bias)
        return fp8_gemm.w8a16_reference(x.reshape(-1, x.shape[-1]), w.data, w.scale, bias).reshape(
            *x.shape[:-1], w.data.shape[0]
        )
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k)  # (M, K)
    if static and name in STATIC_KERNELS and w.act_scale is not None:
        if fp8_fused.runs_on(flat):
            xin = fp8_fused.quant(flat, w.act_scale)  # one kernel (compiled, inductor fuses the torch ops)
            return _gemm(xin.data, xin.rows, w, bias, x.dtype).reshape(*lead, w.data.shape[0])
        xq, sx = quantise_static(flat, w.act_scale), w.act_scale  # (M, K) fp8, (1,)
    else:
        rows = row_scales(flat.abs().amax(dim=-1))  # (M,)
        xq = quantise(flat, rows)  # (M, K) fp8
        sx = rows.unsqueeze(1)  # (M, 1)
    return _gemm(xq, sx, w, bias, x.dtype).reshape(*lead, w.data.shape[0])


def _triton_runs(x: torch.Tensor, w: Fp8Weight) -> bool:
    """Whether ``triton_w8a8``'s kernel takes this (M, K) input through ``w``: the kernel in use, CUDA (or
    Triton's CPU interpreter, which the tests run), and a shape its table holds (a decode batch; cuBLAS
    where it is faster)."""
    return (
        _KERNEL["name"] == "triton_w8a8"
        and fp8_w8a8.available()
        and (x.is_cuda or fp8_w8a8._interpreting())
        and fp8_w8a8.config_for(x.shape[0], *w.data.shape) is not None
    )


def _gemm(
    xq: torch.Tensor, sx: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """FP8 activations xq (M, K) with their scales ``sx`` ((M, 1) rows, or (1,) static) @ W.T (+ bias): (M, N)
    in ``dtype``."""
    if _triton_runs(xq, w):
        return fp8_w8a8.w8a8_linear(xq, sx.reshape(-1), w.data, w.scale, bias, dtype)
    if sx.dim() == 1:  # SM90's _scaled_mm takes rowwise with rowwise (the weights'): the scalar as (M, 1)
        sx = sx.expand(xq.shape[0], 1).contiguous()  # (M, 1)
    out = torch._scaled_mm(xq, w.data.t(), scale_a=sx, scale_b=w.scale.unsqueeze(0), out_dtype=dtype)
    return out if bias is None else out + bias


def quantise_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` (..., K) in FP8 with one static ``scale`` (1,): elementwise (no reduction), so it fuses into the
    kernel that produced x; beyond the calibrated range saturates at +-448."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)  # float32: a (1,) float32 tensor promotes bf16 x


def act_scale_for(amax: torch.Tensor) -> torch.Tensor:
    """The static scale of activations whose largest magnitude over the calibration tokens is ``amax``."""
    return amax.float().clamp(min=MIN_SCALE) * ACT_SCALE_MARGIN / FP8_MAX


def input_amax(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The largest magnitude of ``x`` (b, t, K) over the ``valid`` (b, t) tokens (right padding excluded): (1,)."""
    zero = torch.zeros((), dtype=x.dtype, device=x.device)
    return torch.where(valid[..., None], x.abs(), zero).amax().float().reshape(1)


@torch.library.custom_op("hybridflow::set_act_scale", mutates_args=("act_scale",))
def set_act_scale(amax: torch.Tensor, act_scale: torch.Tensor) -> None:
    """Fill the static scale ``act_scale`` (1,) in place from its input's calibrated ``amax`` (1,): an op on
    the buffer itself, so a compiled prefill writes the tensor that captured decode graphs read."""
    act_scale.copy_(act_scale_for(amax))


@set_act_scale.register_fake
def _(amax, act_scale):  # the op's signature
    return None


def calibrate_act_scale(x: torch.Tensor, valid: torch.Tensor, act_scale: torch.Tensor) -> None:
    """Set ``act_scale`` (1,) in place from ``x`` (b, t, K) over its ``valid`` (b, t) tokens (one rank)."""
    set_act_scale(input_amax(x, valid), act_scale)


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
