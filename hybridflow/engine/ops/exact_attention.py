"""Attention whose every query row reduces in one fixed order, for the trainer and the rollout alike
(``rollout.exact``).

A query at position ``p`` of its sequence reads the keys ``0 .. p`` in chunks of ``CHUNK`` positions counted
from the sequence's start, whatever else the call holds and wherever the keys live (the trainer's packed
tensors, the rollout's paged cache). Softmax in two passes, all in float32: first the row's maximum over its
scores (a maximum is exact in any order), then, chunk by chunk in position order, the exponentials' sum and
their weighted sum of values. With no running rescale there is no ``exp`` of a row-sized tensor (whose CPU
kernel may take a scalar path for some rows and a vector path for others), and a chunk past the row's last
key adds exact zeros, so padding the keys to more chunks changes nothing.

The per-chunk products are batched matmuls whose items all have the shape (1, D) x (D, CHUNK) or
(1, CHUNK) x (CHUNK, D), one item per (row, head), on contiguous operands (the library picks its kernel by the
strides too): it computes each item alike, whatever the batch.
This torch version is the CPU path and the reference; ``exact_attention_kernel`` is the CUDA one.
"""

from __future__ import annotations

import itertools

import torch

CHUNK = 64  # key positions per chunk, counted from the sequence's first token


def attend_rows(
    q: torch.Tensor,  # (R, H, D) one query row per item
    keys: torch.Tensor,  # (R, L, KVH, D) each row's sequence keys from position 0
    values: torch.Tensor,  # (R, L, KVH, D)
    positions: torch.Tensor,  # (R,) each row's position: it reads keys 0 .. position
    scale: float,
) -> torch.Tensor:
    """Causal attention of each row over its own keys; (R, H, D) in q's dtype."""
    r, h, d = q.shape
    keys, values = pad_keys(keys, keys.shape[1]), pad_keys(values, values.shape[1])
    group = h // keys.shape[2]
    qf = q.float().reshape(r * h, 1, d).contiguous()  # (RH, 1, D)
    chunks = range(0, keys.shape[1], CHUNK)

    def scores(c0: int) -> torch.Tensor:
        k = keys[:, c0 : c0 + CHUNK].float().repeat_interleave(group, dim=2)  # (R, C, H, D)
        k = k.permute(0, 2, 3, 1).reshape(r * h, d, CHUNK).contiguous()  # (RH, D, C): one layout always
        s = torch.bmm(qf, k) * scale  # (RH, 1, C)
        at = torch.arange(c0, c0 + CHUNK, device=q.device)  # (C,)
        hidden = (at[None, :] > positions[:, None]).repeat_interleave(h, dim=0)  # (RH, C)
        return s.masked_fill(hidden[:, None, :], float("-inf"))

    top = torch.full((r * h, 1, 1), float("-inf"), device=q.device)
    for c0 in chunks:
        top = torch.maximum(top, scores(c0).amax(-1, keepdim=True))
    total = torch.zeros((r * h, 1, 1), device=q.device)
    acc = torch.zeros((r * h, 1, d), device=q.device)
    for c0 in chunks:
        p = (scores(c0) - top).exp()  # (RH, 1, C): exact zeros past the row's position
        total = total + p.sum(-1, keepdim=True)
        v = values[:, c0 : c0 + CHUNK].float().repeat_interleave(group, dim=2)  # (R, C, H, D)
        v = v.permute(0, 2, 1, 3).reshape(r * h, CHUNK, d).contiguous()  # (RH, C, D)
        acc = acc + torch.bmm(p.contiguous(), v)  # (RH, 1, D)
    return (acc / total).view(r, h, d).to(q.dtype)


def attend(
    q: torch.Tensor,  # (R, H, D)
    keys: torch.Tensor,  # (N, KVH, D) sequences laid end to end
    values: torch.Tensor,  # (N, KVH, D)
    starts: torch.Tensor,  # (R,) where each row's sequence begins in keys
    positions: torch.Tensor,  # (R,) each row reads keys[starts + 0 .. starts + position]
    scale: float,
) -> torch.Tensor:
    """Each row over its own sequence's keys in the fixed order: the Triton kernel on CUDA, ``attend_rows``
    elsewhere; (R, H, D) in q's dtype."""
    if q.is_cuda:
        from hybridflow.engine.ops import invariant_kernels

        return invariant_kernels.attend(q, keys, values, starts, positions, scale, CHUNK)
    length = max(-(-(int(positions.max()) + 1) // CHUNK) * CHUNK, CHUNK) if len(positions) else CHUNK
    at = starts[:, None] + torch.arange(length, device=q.device)[None, :]  # (R, L)
    at = at.clamp(max=keys.shape[0] - 1)  # past a row's position: masked, whatever it reads
    return attend_rows(q, keys[at], values[at], positions, scale)


def pad_keys(x: torch.Tensor, length: int) -> torch.Tensor:
    """x (B, L, ...) zero-padded along dim 1 to a multiple of CHUNK that is at least ``length``."""
    want = max(-(-length // CHUNK) * CHUNK, CHUNK)
    if x.shape[1] >= want:
        return x[:, :want]
    return torch.cat([x, x.new_zeros((x.shape[0], want - x.shape[1], *x.shape[2:]))], dim=1)


def packed_exact_attention(
    query: torch.Tensor,  # (1, H, S, D)
    key: torch.Tensor,  # (1, KVH, S, D)
    value: torch.Tensor,  # (1, KVH, S, D)
    bounds: list[int],
    scale: float,
) -> torch.Tensor:
    """The trainer's packed batch: each sequence's rows over its own keys; (1, S, H, D)."""
    lengths = torch.tensor([e - s for s, e in itertools.pairwise(bounds)])  # (n,)
    starts = torch.repeat_interleave(torch.tensor(bounds[:-1]), lengths)  # (S,) each token's sequence start
    positions = torch.arange(bounds[-1]) - starts  # (S,)
    device = query.device
    q = query[0].transpose(0, 1)  # (S, H, D)
    k, v = key[0].transpose(0, 1), value[0].transpose(0, 1)  # (S, KVH, D)
    return attend(q, k, v, starts.to(device), positions.to(device), scale)[None]  # (1, S, H, D)
