"""A Llama-family decoder layer's math as pure functions of tensors, around the attention call.

The runner (``model.LlamaRunner``) splits each layer at attention, which differs between prefill and decode
and touches the KV cache: ``attention_inputs`` (input RMSNorm, the q/k/v projections, Qwen3's q/k norms,
RoPE) and ``attention_output_and_mlp`` (o projection, residual, post-attention RMSNorm, SiLU-gated MLP,
residual). Being pure functions of tensors, they trace cleanly into ``torch.compile``: when the engine
compiles, prefill's layers run as one compiled graph per chunk shape and the decode step as one per batch
bucket (one fused kernel per elementwise chain instead of ~7 eager passes over the activations).

The math follows transformers' modeling_llama / modeling_qwen2 / modeling_qwen3 op for op: RMSNorm in
float32 then cast back before the weight multiply, RoPE in the compute dtype in HF's rotate-half convention.
A mixture-of-experts layer (Qwen2/3-MoE, Mixtral) replaces the MLP by ``attention_output_and_moe``, which
routes and runs the experts through ``hybridflow.models.moe`` (the trainer's own functions, so both sides
choose a token's experts by the same arithmetic).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from hybridflow.engine.ops import fp8_fused
from hybridflow.engine.ops.fp8 import (
    STATIC_KERNELS,
    Fp8Weight,
    current_kernel,
    fp8_linear,
    input_amax,
    set_act_scale,
)
from hybridflow.engine.ops.fp8_fused import QuantisedInput
from hybridflow.models.moe import RouterSpec, route, router_logits, run_experts

# experts(x (N, H), ids (N, k), weights (N, k), gate_up (E, 2I, H), down (E, H, I)) -> (N, H)
Experts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class ActQuant(NamedTuple):
    """How a forward quantises the inputs of FP8 projections that carry a static scale (``Fp8Weight.act_scale``,
    kernel ``scaled_mm_static``): a static value for torch.compile, one per forward."""

    static: bool = False  # the scales are calibrated: quantise with them (elementwise, fusable)
    calib: torch.Tensor | None = None  # (b, t) bool: set the scales from these tokens (and run per token)
    # Tensor parallelism: the max of an amax (1,) over the group, so every rank sets the same scale (once per
    # refresh). The o and down inputs are sharded along K: with the group's scale each rank quantises its
    # slice as one rank would quantise the whole input with that scale (per token, each rank's slice gets its
    # own amax). The scale is one rank's up to the calibrating prefill's own (per-token) rounding.
    reduce_max: Callable[[torch.Tensor], torch.Tensor] | None = None


DYNAMIC = ActQuant()  # per-token quantisation, no calibration (and no FP8 weights: no effect)


@dataclass
class MoEWeights:
    """A sparse layer's bound tensors: router, fused experts, and Qwen2-MoE's gated shared expert."""

    spec: RouterSpec
    index: int  # the layer's place among the sparse layers (its column in routing records)
    router: torch.Tensor  # (E, H)
    gate_up: torch.Tensor  # (E, 2I, H), gate half first
    down: torch.Tensor  # (E, H, I)
    shared_gate_up: list[torch.Tensor] | None = None  # [fused (2S, H)] or [gate (S, H), up (S, H)]
    shared_down: torch.Tensor | None = None  # (H, S)
    shared_gate: torch.Tensor | None = None  # (1, H)
    shared_splits: tuple[int, ...] = ()  # (S, S)
    # moe.grouped_experts or moe.loop_experts, picked at bind time as run_experts would pick per call, so a
    # traced or captured step never runs the host-side check (CUDA capability) itself.
    experts: Experts = run_experts


@dataclass
class LayerWeights:
    """One decoder layer's bound tensors; each projection group is [fused] or [one per projection]."""

    input_norm: torch.Tensor
    qkv: list[torch.Tensor]
    qkv_bias: list[torch.Tensor] | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: list[torch.Tensor]
    o_bias: list[torch.Tensor] | None
    post_norm: torch.Tensor
    gate_up: list[torch.Tensor]
    gate_up_bias: list[torch.Tensor] | None
    down: list[torch.Tensor]
    down_bias: list[torch.Tensor] | None
    moe: MoEWeights | None = None  # set: a sparse layer (gate_up and down are then empty)


@dataclass(frozen=True)
class KSplits:
    """How many batched GEMMs over slices of the input dim each projection group runs as (1: one GEMM).

    At decode's small M a GEMM has few output tiles (q/k/v at M = 64 is ~9 tiles of 128 columns) or a long
    K loop (down); slicing K multiplies the tiles, and the float32 partials' sum fuses into the consumer
    under torch.compile (``split_linear``). Only worth it compiled, on CUDA; on an H200 only the down
    projection's split paid (benchmarks/RESULTS.md has the sweep).
    """

    qkv: int = 1
    o: int = 1
    gate_up: int = 1
    down: int = 1

    @classmethod
    def parse(cls, spec: str) -> KSplits:
        """Parse ``"o=2,down=4"`` (unnamed groups stay 1); raises ValueError naming a bad entry."""
        values: dict[str, int] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            name, _, count = item.partition("=")
            if name not in cls.__dataclass_fields__ or not count.isdigit() or int(count) < 1:
                raise ValueError(
                    f"bad K split {item!r} in {spec!r}: use group=count with a group among "
                    f"{', '.join(cls.__dataclass_fields__)} and a count >= 1, e.g. 'o=2,down=4'"
                )
            values[name] = int(count)
        return cls(**values)


@dataclass(frozen=True)
class LayerDims:
    """The shapes and constants every layer shares (static values for torch.compile)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    qkv_splits: tuple[int, ...]
    mlp_splits: tuple[int, ...]
    k_splits: KSplits = KSplits()  # > 1: that projection group through split_linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF RMSNorm: normalise in float32, cast back to the input dtype, then scale (the order matters in bf16)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_scale(weights: list, x: torch.Tensor, act: ActQuant) -> torch.Tensor | None:
    """The static scale (1,) of ``weights``' input where the kernel producing x should quantise it too
    (``fp8_fused``): calibrated FP8 weights with a static kernel (``STATIC_KERNELS``), on CUDA, uncompiled (compiled,
    inductor fuses the elementwise quantisation itself); else None."""
    first = weights[0] if weights else None
    if not (
        act.static and act.calib is None and isinstance(first, Fp8Weight) and first.act_scale is not None
    ):
        return None
    return first.act_scale if fp8_fused.runs_on(x) and current_kernel() in STATIC_KERNELS else None


def norm_input(
    h: torch.Tensor, weight: torch.Tensor, eps: float, weights: list, act: ActQuant
) -> torch.Tensor | QuantisedInput:
    """``rms_norm(h)``, normed and quantised in one kernel where ``fused_scale`` says so."""
    scale = fused_scale(weights, h, act) if weight.dtype == h.dtype else None
    return rms_norm(h, weight, eps) if scale is None else fp8_fused.rms_norm_quant(h, weight, eps, scale)


def silu_mul(
    gate: torch.Tensor, up: torch.Tensor, weights: list, act: ActQuant
) -> torch.Tensor | QuantisedInput:
    """``F.silu(gate) * up``, and quantised in the same kernel where ``fused_scale`` says so."""
    scale = fused_scale(weights, gate, act)
    return F.silu(gate) * up if scale is None else fp8_fused.silu_mul_quant(gate, up, scale)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE in HF's rotate-half convention: x (b, h, t, D), cos/sin (b, 1, t, D)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def project(
    x: torch.Tensor | QuantisedInput,
    weights: list[torch.Tensor],
    biases: list[torch.Tensor] | None,
    splits: tuple[int, ...],
    k_splits: int = 1,
    act: ActQuant = DYNAMIC,
) -> list[torch.Tensor]:
    """Apply a group of linear layers, fused (one weight, split after) or separate (one weight each).

    ``k_splits`` > 1 runs a fused group through ``split_linear`` (separate weights ignore it). ``act``: how FP8
    weights with a static activation scale quantise x (the group shares one scale: x is their one input).
    """
    first = weights[0]
    static = act.static
    if act.calib is not None and isinstance(first, Fp8Weight) and first.act_scale is not None:
        amax = input_amax(x, act.calib)  # (1,)
        set_act_scale(amax if act.reduce_max is None else act.reduce_max(amax), first.act_scale)
        static = False  # the calibrating forward runs per token
    if len(weights) == 1:
        bias = None if biases is None else biases[0]
        y = (
            linear(x, first, bias, static)
            if k_splits == 1 or isinstance(first, Fp8Weight)
            else split_linear(x, first, bias, k_splits)
        )
        return list(y.split(list(splits), dim=-1)) if len(splits) > 1 else [y]
    biases = biases if biases is not None else [None] * len(weights)
    return [linear(x, w, b, static) for w, b in zip(weights, biases)]


def linear(
    x: torch.Tensor | QuantisedInput,
    w: torch.Tensor | Fp8Weight,
    bias: torch.Tensor | None = None,
    static: bool = False,
) -> torch.Tensor:
    """``F.linear``, or the FP8 scaled GEMM for a weight the switch delivered in FP8 (``rollout.quantization``;
    ``static``: with its calibrated activation scale, where it has one)."""
    return fp8_linear(x, w, bias, static) if isinstance(w, Fp8Weight) else F.linear(x, w, bias)


def attention_inputs(
    h: torch.Tensor,
    w: LayerWeights,
    cos: torch.Tensor,
    sin: torch.Tensor,
    dims: LayerDims,
    rope: bool = True,
    act: ActQuant = DYNAMIC,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Norm, q/k/v projections and RoPE on h (b, t, hidden): q (b, H, t, D), k and v (b, KVH, t, D).

    ``rope=False`` returns q and k before RoPE, for an attention kernel that applies it itself. ``act``: how
    FP8 projections quantise their inputs (``ActQuant``).
    """
    b, t, _ = h.shape
    x = norm_input(h, w.input_norm, dims.eps, w.qkv, act)
    q, k, v = project(x, w.qkv, w.qkv_bias, dims.qkv_splits, dims.k_splits.qkv, act)
    q = q.view(b, t, dims.num_heads, dims.head_dim)  # (b, t, H, D)
    k = k.view(b, t, dims.num_kv_heads, dims.head_dim)  # (b, t, KVH, D)
    v = v.view(b, t, dims.num_kv_heads, dims.head_dim).transpose(1, 2)  # (b, KVH, t, D)
    if w.q_norm is not None:  # Qwen3: RMSNorm over each head's D before RoPE
        q = rms_norm(q, w.q_norm, dims.eps)
        k = rms_norm(k, w.k_norm, dims.eps)
    q, k = q.transpose(1, 2), k.transpose(1, 2)  # (b, H, t, D), (b, KVH, t, D)
    if not rope:
        return q, k, v
    return rotate(q, cos, sin), rotate(k, cos, sin), v


def attention_output(
    h: torch.Tensor,
    o: torch.Tensor,
    w: LayerWeights,
    dims: LayerDims,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    act: ActQuant = DYNAMIC,
) -> torch.Tensor:
    """h (b, t, hidden) plus o's projection of the attention output o (b, H, t, D)."""
    b, t, _ = h.shape
    o = o.transpose(1, 2).reshape(b, t, dims.num_heads * dims.head_dim)  # (b, H, t, D) -> (b, t, H * D)
    out = project(o, w.o, w.o_bias, (0,), dims.k_splits.o, act)[0]  # (b, t, hidden)
    return h + (out if reduce is None else reduce(out))


def attention_output_and_mlp(
    h: torch.Tensor,
    o: torch.Tensor,
    w: LayerWeights,
    dims: LayerDims,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    act: ActQuant = DYNAMIC,
) -> torch.Tensor:
    """The rest of the layer: h (b, t, hidden) plus o's projection, then plus the MLP of its norm.

    ``reduce`` sums the partial products of the row-parallel o and down projections over a tensor-parallel
    group (their biases sit on one rank, so the sum adds them once); None: this rank holds whole weights.
    """
    h = attention_output(h, o, w, dims, reduce, act)
    x = norm_input(h, w.post_norm, dims.eps, w.gate_up, act)
    gate, up = project(x, w.gate_up, w.gate_up_bias, dims.mlp_splits, dims.k_splits.gate_up, act)
    hidden = silu_mul(gate, up, w.down, act)  # (b, t, I)
    out = project(hidden, w.down, w.down_bias, (0,), dims.k_splits.down, act)[0]  # (b, t, hidden)
    return h + (out if reduce is None else reduce(out))


def attention_output_and_moe(
    h: torch.Tensor,
    o: torch.Tensor,
    w: LayerWeights,
    dims: LayerDims,
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    act: ActQuant = DYNAMIC,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A sparse layer's rest: (h (b, t, hidden), the chosen experts (b * t, k) int64).

    As ``MoEBlock.forward``: the experts' sum plus the shared expert's sigmoid-gated output. Under tensor
    parallelism each rank holds a slice of every expert's intermediate dim, so ``reduce`` sums the slices.
    ``act`` reaches the o projection only: the experts and the shared expert stay in the rollout dtype.
    """
    h = attention_output(h, o, w, dims, reduce, act)
    out, ids = moe_mlp(rms_norm(h, w.post_norm, dims.eps), w.moe)  # (b, t, hidden), (b * t, k)
    return h + (out if reduce is None else reduce(out)), ids


def moe_mlp(x: torch.Tensor, m: MoEWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """x (b, t, hidden) through the router and the experts: (out (b, t, hidden), expert ids (b * t, k)).

    Fixed shapes and no host sync where ``run_experts`` takes its grouped GEMMs (CPU, CUDA bf16 on SM90+).
    """
    shape = x.shape
    flat = x.reshape(-1, shape[-1])  # (N, hidden)
    weights, ids = route(router_logits(flat, m.router, m.spec), m.spec)  # (N, k) each
    out = m.experts(flat, ids, weights, m.gate_up, m.down)  # (N, hidden)
    if m.shared_gate_up is not None:
        gate, up = project(flat, m.shared_gate_up, None, m.shared_splits)  # (N, S) each
        shared = F.linear(F.silu(gate) * up, m.shared_down)  # (N, hidden)
        out = out + torch.sigmoid(F.linear(flat, m.shared_gate)) * shared
    return out.reshape(shape), ids


def split_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, splits: int
) -> torch.Tensor:
    """F.linear as ``splits`` batched GEMMs over slices of the input dim, summed in float32.

    cuBLAS runs a small-M GEMM with a long K (decode's down projection) as split-K plus a reduce kernel of
    its own, and a short-K one on few output tiles. Here the partials come out of one batched GEMM in
    float32 and their sum (at most 8 terms, which inductor unrolls) fuses into the consumer: the residual
    add and the next RMSNorm, or SiLU*up. Same math as cuBLAS's split-K: bf16 products, float32
    accumulation and reduction, one rounding at the end.
    """
    *lead, inner = x.shape
    out_dim = weight.shape[0]
    if inner % splits:
        return F.linear(x, weight, bias)
    part = inner // splits
    xs = x.reshape(-1, splits, part).transpose(0, 1)  # (S, M, I / S)
    ws = weight.view(out_dim, splits, part).permute(1, 2, 0)  # (S, I / S, N), no copy
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
        partials = torch.bmm(xs, ws, out_dtype=torch.float32)  # (S, M, N)
    else:  # bmm's out_dtype is CUDA-only; upcasting first is the same float32 math (float64 stays float64)
        acc = torch.promote_types(x.dtype, torch.float32)
        partials = torch.bmm(xs.to(acc), ws.to(acc))
    out = partials.sum(0)  # (M, N)
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.to(x.dtype).view(*lead, out_dim)
