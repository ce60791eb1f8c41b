"""FP8 (e4m3) weights for the rollout: rowwise scales, quantisation, and the scaled matmul of a projection.

A projection weight W (N, K) is stored as ``data`` (N, K) float8_e4m3fn and ``scale`` (N,) float32 with
W ~= data * scale[:, None]; the scale of a row is its largest magnitude over 448 (e4m3's largest finite
value), so every row uses the format's whole range. In a matmul the activations x (M, K) are quantised the
same way per token, and ``torch._scaled_mm`` multiplies in FP8 and applies both scales (rowwise: (M, 1) and
(1, N)) on the way out in the activations' dtype; on CPU the same call runs a reference kernel. The
quantisation is elementwise given the scales, so quantising a slice with the full rows' scales equals slicing
the quantised full weight (the switch relies on that, ``hybrid.resharder``).

Three kernels run an FP8 projection (``use_kernel``, picked at start by ``fp8_probe``): ``scaled_mm`` (W8A8, as
above), ``scaled_mm_static`` (W8A8 with a static activation scale, below) and ``w8a16`` (``fp8_gemm``: the FP8
weight upcast in registers, bf16 activations, no activation quantisation; on CPU its torch reference).

Static activation scales (``scaled_mm_static``): per-token quantisation is a reduction (the row's amax) before
the elementwise divide, a chain of separate kernels that cost ~20 us a projection eagerly (benchmarks/
RESULTS.md, "FP8, second pass"). With one float32 scale per projection input (``Fp8Weight.act_scale``, (1,),
shared by the projections that read the same activations: q/k/v, gate/up) the quantisation is elementwise,
``(x / s).clamp(-448, 448)`` cast to e4m3, which inductor fuses into the RMSNorm or SiLU-mul that produced x
when the decode step is compiled, and ``fp8_fused``'s Triton kernels do in that op's place when it is not
(CUDA; they hand over a ``QuantisedInput``). The scales are calibrated on the first prefill after each weight refresh
(``calibrate_act_scale``, margin ``ACT_SCALE_MARGIN``) and filled in place, so a CUDA graph captured on them stays
valid; that prefill, and any forward before the first calibration, runs the per-token path.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from hybridflow.engine.ops import fp8_fused, fp8_gemm
from hybridflow.engine.ops.fp8_fused import QuantisedInput

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# Scales never reach zero: an all-zero row (a fresh LoRA-free bias-free pad row) would divide by it.
MIN_SCALE = 1e-12
# The projections quantised (dense attention and MLP); embeddings, the LM head, norms, routers, experts and
# shared experts stay in the rollout dtype.
QUANTISED = re.compile(r"\.self_attn\.[qkvo]_proj\.weight$|\.mlp\.(gate|up|down)_proj\.weight$")


FP8_KERNELS = ("w8a16", "scaled_mm", "scaled_mm_static")
# The calibrated range of a static activation scale over the calibrating prefill's largest magnitude: the
# scale is margin * amax / 448. As the KV cache's (paged_cache.KV_SCALE_MARGIN), and for the same reasons:
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
    # (1,) float32: the static scale of the input activations (``scaled_mm_static``), one tensor shared by the
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
    ``static`` (the caller's scales are calibrated) with ``scaled_mm_static`` and ``w.act_scale``: x quantised
    elementwise with that scale instead (``quantise_static``), or already so (a ``QuantisedInput``)."""
    if isinstance(x, QuantisedInput):  # fp8_fused's kernels quantised it with w.act_scale
        out = torch._scaled_mm(
            x.data, w.data.t(), scale_a=x.rows, scale_b=w.scale.unsqueeze(0), out_dtype=x.dtype
        )  # (M, N)
        out = out if bias is None else out + bias
        return out.reshape(*x.lead, w.data.shape[0])
    name = _KERNEL["name"]
    if name == "w8a16":
        if x.is_cuda and fp8_gemm.available():
            return fp8_gemm.w8a16_linear(x, w.data, w.scale, bias)
        return fp8_gemm.w8a16_reference(x.reshape(-1, x.shape[-1]), w.data, w.scale, bias).reshape(
            *x.shape[:-1], w.data.shape[0]
        )
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k)  # (M, K)
    if static and name == "scaled_mm_static" and w.act_scale is not None:
        xq = quantise_static(flat, w.act_scale)  # (M, K) fp8
        # Rowwise on both sides (SM90's _scaled_mm takes rowwise with rowwise, tensorwise with tensorwise, and
        # the weights are rowwise): the scalar as a contiguous (M, 1), which rowwise scales must be.
        sx = w.act_scale.expand(flat.shape[0], 1).contiguous()  # (M, 1)
    else:
        rows = row_scales(flat.abs().amax(dim=-1))  # (M,)
        xq = quantise(flat, rows)  # (M, K) fp8
        sx = rows.unsqueeze(1)  # (M, 1)
    out = torch._scaled_mm(
        xq, w.data.t(), scale_a=sx, scale_b=w.scale.unsqueeze(0), out_dtype=x.dtype
    )  # (M, N)
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, w.data.shape[0])


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
    """µs of the model's post-attention RMSNorm and gate/up projection on ``tokens`` decode tokens for each FP8
    kernel (activation quantisation included: per token; or, for ``scaled_mm_static``, with a pre-set static
    scale, by ``fp8_fused``'s norm kernel that quantises as it writes, as an uncompiled decode runs it) and for
    bf16: ``{"w8a16": .., "scaled_mm": .., "scaled_mm_static": .., "bf16": ..}``, medians of ``repeats`` graph
    replays on ``device`` (CUDA). The norm is in every figure: it is what the static kernel's quantisation
    rides on. The engine keeps bf16 where no FP8 kernel is faster."""
    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(2 * intermediate, hidden, device=device, generator=g, dtype=torch.bfloat16) * 0.02
    h = torch.randn(tokens, hidden, device=device, generator=g, dtype=torch.bfloat16)  # the residual
    norm = 1 + 0.1 * torch.randn(hidden, device=device, generator=g, dtype=torch.bfloat16)

    def normed() -> torch.Tensor:  # blocks.rms_norm (HF's order of casts)
        hf = h.float()
        return norm * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(h.dtype)

    q = quantise_rows(w)
    q.act_scale = act_scale_for(normed().abs().amax()).reshape(1)  # (1,): as calibrated
    before = current_kernel()
    out = {}
    try:
        for name in FP8_KERNELS:
            use_kernel(name)
            if name == "scaled_mm_static" and fp8_fused.available():
                run = lambda: fp8_linear(fp8_fused.rms_norm_quant(h, norm, 1e-6, q.act_scale), q)  # noqa: E731
            else:
                run = lambda: fp8_linear(normed(), q, static=True)  # noqa: E731
            out[name] = _graph_us(run, device, repeats)
    finally:
        use_kernel(before)
    out["bf16"] = _graph_us(lambda: torch.nn.functional.linear(normed(), w), device, repeats)
    return out
