"""The torch references of the decode-attention kernels (``decode_attention``): their semantics in float32, what
the kernel tests compare against, and the fused kernel's new-token record (``NewToken``)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class NewToken(NamedTuple):
    """The decode step's new token for the fused kernel: k and v (B, KVH, 1, D) before RoPE, cos/sin (B, D)."""

    k: torch.Tensor
    v: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


def decode_attention_reference(
    q: torch.Tensor,  # (B, H, 1, D)
    k_cache: torch.Tensor,  # (S >= B, KVH, L, D)
    v_cache: torch.Tensor,  # (S >= B, KVH, L, D)
    positions: torch.Tensor,  # (B,) int
    scale: float,
) -> torch.Tensor:
    """Pure-torch decode attention with the kernel's semantics, in float32; returns (B, H, 1, D) in q's dtype."""
    batch, heads, _, _ = q.shape
    kv_heads, length = k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    # Query head h reads KV head h // G (SDPA's enable_gqa convention).
    keys = k_cache[:batch].float().repeat_interleave(group, dim=1)  # (B, H, L, D)
    values = v_cache[:batch].float().repeat_interleave(group, dim=1)
    scores = (q.float() @ keys.transpose(-1, -2)) * scale  # (B, H, 1, L)
    visible = torch.arange(length, device=q.device) <= positions.to(q.device)[:, None]  # (B, L)
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    return (torch.softmax(scores, dim=-1) @ values).to(q.dtype)  # (B, H, 1, D)


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in float32, rounded once to x's dtype: x (B, h, 1, D), cos/sin (B, D)."""
    xf, half = x.float(), x.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos[:, None, None].float() + rotated * sin[:, None, None].float()).to(x.dtype)


def decode_attention_rope_reference(
    q: torch.Tensor,  # (B, H, 1, D) before RoPE
    new: NewToken,
    k_cache: torch.Tensor,  # (S >= B, KVH, L, D), written at positions
    v_cache: torch.Tensor,
    positions: torch.Tensor,  # (B,) int
    scale: float,
) -> torch.Tensor:
    """The fused kernel's semantics in torch: RoPE on q and k, write k and v at ``positions``, attend."""
    rows = torch.arange(q.shape[0], device=q.device)
    k_cache[rows, :, positions] = rope_reference(new.k, new.cos, new.sin)[:, :, 0]
    v_cache[rows, :, positions] = new.v[:, :, 0]
    return decode_attention_reference(rope_reference(q, new.cos, new.sin), k_cache, v_cache, positions, scale)
