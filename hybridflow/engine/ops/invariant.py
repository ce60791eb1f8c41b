"""Batch-invariant kernels: a row's result does not depend on the other rows of the call (``rollout.exact``).

A matmul, a mean or a log-softmax over a row normally reduces in an order that the library picks from the
whole call's shape: cuBLAS chooses a tiling and a split of K from M, the CPU libraries block differently for
different row counts, a reduction kernel spreads a row over more threads when there are few rows. So a token's
logits depend on how many other tokens share its call: a decode step (a few rows) and the trainer's forward
(thousands) give different bits for the same token, and the rollout's log-probs drift from the trainer's.

Here every row is reduced by the same instructions whatever else is in the call:

- On the CPU, each call is cut into chunks of ``ROWS`` rows (the last one padded with zeros) and every chunk
  goes through the library with the same shape, so the library makes the same choices for each; a row's
  result does not depend on its place in a chunk (the tests check it).
- On CUDA, Triton kernels with one fixed tiling (``invariant_kernels``): a row's reduction runs in one program,
  in the same order, for any M; there is no split of K.

``exact_kernels()`` routes torch's ``mm``, ``addmm``, ``mean.dim``, ``_log_softmax`` and ``_softmax`` through
these for the process (``torch.library``), so the Hugging Face modules the trainer runs and the rollout's runner (whose ops
follow them one for one) compute the same bits for the same token. Backward passes go through the same ops:
correct, not faster. ``token_log_probs`` is the one function both sides use for a sampled token's log-prob.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator

import torch
import torch.nn.functional as F

ROWS = 16  # rows per CPU chunk: every library call of an exact op has this many rows

_library: torch.library.Library | None = None
_depth = 0
_lock = threading.Lock()


def exact_on() -> bool:
    """Whether the exact kernels are routed in (``exact_kernels``)."""
    return _library is not None


def _chunks(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x (M, ...) as (C, ROWS, ...) with zero rows appended to fill the last chunk; returns it and M."""
    m = x.shape[0]
    x = x.contiguous()  # one memory layout: the library picks its kernel by the operands' strides too
    pad = -m % ROWS
    if pad:
        x = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))])
    return x.view(-1, ROWS, *x.shape[1:]), m


def _mm_cpu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (M, K) @ b (K, N), chunk by chunk: each chunk one bmm of shape (1, ROWS, K) @ (1, K, N)."""
    chunks, m = _chunks(a)
    w = b.contiguous()[None]  # (1, K, N), row-major whatever the caller passed (a weight's transpose)
    out = [torch.bmm(c[None], w)[0] for c in chunks]  # (ROWS, N) each
    return torch.cat(out)[:m] if out else a.new_zeros((0, b.shape[1]))


def _row_sum_cpu(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim of x (M, K), chunk by chunk (M,)."""
    chunks, m = _chunks(x)
    out = [c.sum(-1) for c in chunks]
    return torch.cat(out)[:m] if out else x.new_zeros((0,))


def _log_softmax_cpu(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim of x (M, V), chunk by chunk, from ops the exact mode leaves alone."""
    chunks, m = _chunks(x)
    out = []
    for c in chunks:  # (ROWS, V)
        shifted = c - c.amax(-1, keepdim=True)
        out.append(shifted - shifted.exp().sum(-1, keepdim=True).log())
    return torch.cat(out)[:m] if out else x.clone()


def _cuda_kernels():
    from hybridflow.engine.ops import invariant_kernels

    return invariant_kernels


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a (M, K) @ b (K, N) with each row of the result independent of M."""
    if a.device.type == "cuda":
        return _cuda_kernels().matmul(a, b)
    return _mm_cpu(a, b)


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta=1, alpha=1) -> torch.Tensor:
    out = mm(a, b)
    if alpha != 1:
        out = out * alpha
    return out + (bias if beta == 1 else bias * beta)


def _mean_dim(x: torch.Tensor, dim=None, keepdim: bool = False, dtype=None) -> torch.Tensor:
    """``torch.mean`` over dims; over the last dim (RMSNorm's) each row reduces in a fixed order."""
    if dtype is not None:
        x = x.to(dtype)
    dims = list(range(x.dim())) if dim is None or len(dim) == 0 else [d % x.dim() for d in dim]
    if dims != [x.dim() - 1] or x.dim() == 0:
        return torch.sum(x, dims, keepdim=keepdim) / _count(x, dims)
    rows = x.reshape(-1, x.shape[-1])  # (M, K)
    total = _cuda_kernels().row_sum(rows) if x.is_cuda else _row_sum_cpu(rows)  # (M,)
    out = (total / x.shape[-1]).view(x.shape[:-1])
    return out.unsqueeze(-1) if keepdim else out


def _count(x: torch.Tensor, dims: list[int]) -> int:
    n = 1
    for d in dims:
        n *= x.shape[d]
    return n


def _log_softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    """``aten::_log_softmax``: over the last dim, row by row in a fixed order; other dims moved there."""
    if half_to_float:
        x = x.float()
    moved = x.movedim(dim, -1)
    rows = moved.reshape(-1, moved.shape[-1])  # (M, V)
    out = _cuda_kernels().log_softmax(rows) if x.is_cuda else _log_softmax_cpu(rows)
    return out.view(moved.shape).movedim(-1, dim)


def _softmax(x: torch.Tensor, dim: int, half_to_float: bool) -> torch.Tensor:
    """``aten::_softmax`` (a router's): the exponential of the exact log-softmax, row by row."""
    out = _log_softmax(x, dim, half_to_float).exp()
    return out if half_to_float else out.to(x.dtype)


def _padded_flat(x: torch.Tensor) -> torch.Tensor:
    """x flattened and zero-padded to a multiple of 64 elements (every CPU vector width divides it)."""
    flat = x.reshape(-1)
    pad = -flat.numel() % 64
    return torch.cat([flat, flat.new_zeros(pad)]) if pad else flat


def _sigmoid_cpu(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)) with every element in the vector body of the CPU kernels.

    A CPU elementwise kernel runs the last few elements of a tensor through a scalar loop whose ``exp`` may
    round differently from the vector one, so an element's result would depend on the tensor's size and the
    element's place (a Qwen2-MoE shared-expert gate of one row per token)."""
    flat = _padded_flat(x).float()  # float32 math, one rounding to x's dtype (as torch's kernel)
    return (1.0 / (1.0 + (-flat).exp()))[: x.numel()].view(x.shape).to(x.dtype)


def _silu_cpu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(x), as ``_sigmoid_cpu``."""
    flat = _padded_flat(x).float()
    return (flat / (1.0 + (-flat).exp()))[: x.numel()].view(x.shape).to(x.dtype)


def _register() -> torch.library.Library:
    with warnings.catch_warnings():  # torch warns that it overrides a kernel: that is the point
        warnings.simplefilter("ignore", UserWarning)
        return _overrides()


def _overrides() -> torch.library.Library:
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("sigmoid", _sigmoid_cpu, "CPU")  # on CUDA an element's result never depends on its place
    lib.impl("silu", _silu_cpu, "CPU")
    for key in ("CPU", "CUDA"):
        lib.impl("mm", mm, key)
        lib.impl("addmm", _addmm, key)
        lib.impl("mean.dim", _mean_dim, key)
        lib.impl("_log_softmax", _log_softmax, key)
        lib.impl("_softmax", _softmax, key)
    return lib


@contextlib.contextmanager
def exact_kernels() -> Iterator[None]:
    """Route torch's matmuls, row means and log-softmax through the batch-invariant kernels (nestable)."""
    global _library, _depth
    with _lock:
        if _depth == 0:
            _library = _register()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                assert _library is not None
                _library._destroy()
                _library = None


def enable_exact_kernels() -> None:
    """Route the exact kernels in for the rest of the process (``rollout.exact=true`` runs)."""
    global _library, _depth
    with _lock:
        if _depth == 0:
            _library = _register()
        _depth += 1  # never released: an ``exact_kernels()`` block inside keeps them on when it ends


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T)[token] in float32 for logits (M, V) and tokens (M,): the rollout's and the
    trainer's one formula in exact mode (the same ops in the same order on both sides)."""
    scaled = logits.float() / temperature  # (M, V)
    return F.log_softmax(scaled, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)  # (M,)


ROPE_ATTR = "_hybridflow_rope_tables"  # on the inv_freq tensor: its tables live and die with it


def rope_table(inv_freq: torch.Tensor, scaling: float, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (L >= length, D) in float32 for positions 0 .. L-1, one table per ``inv_freq``.

    HF's formula (float32 angles, ``cos * attention_scaling``; the caller casts to its dtype), computed once
    and looked up by position: the trainer and the rollout then hold the same bits for a position, where
    computing ``cos`` on tensors of different shapes can round a value differently (a CPU kernel's scalar
    tail against its vector body). Build it before any CUDA graph capture (it allocates)."""
    tables = getattr(inv_freq, ROPE_ATTR, None)
    if tables is None:
        tables = {}
        setattr(inv_freq, ROPE_ATTR, tables)
    table = tables.get(float(scaling))
    if table is None or table[0].shape[0] < length:
        size = -(-length // 1024) * 1024  # a multiple of the vector widths: no element takes a scalar tail
        at = torch.arange(size, device=inv_freq.device, dtype=torch.float32)
        freqs = at[:, None] * inv_freq.float()[None, :]  # (L, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (L, D)
        table = (emb.cos() * scaling, emb.sin() * scaling)
        tables[float(scaling)] = table
    return table
