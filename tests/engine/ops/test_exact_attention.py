"""Exact mode's attention: causal attention's values, and each row's result the same whether it is computed in
the trainer's packed batch (every row of every sequence) or alone (a decode step), wherever its keys live."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from hybridflow.engine.ops.exact_attention import CHUNK, attend, packed_exact_attention

H, KVH, D = 4, 2, 16


def packed(lengths: list[int], dtype: torch.dtype, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    s = sum(lengths)
    q, k, v = (torch.randn(1, h, s, D, generator=g).to(device, dtype) for h in (H, KVH, KVH))
    return q, k, v, [0, *itertools.accumulate(lengths)]


def per_sequence_sdpa(q, k, v, bounds) -> torch.Tensor:
    parts = [
        F.scaled_dot_product_attention(
            q[:, :, a:b].float(), k[:, :, a:b].float(), v[:, :, a:b].float(), is_causal=True, scale=0.25,
            enable_gqa=True,
        )
        for a, b in itertools.pairwise(bounds)
    ]  # fmt: skip
    return torch.cat(parts, dim=2).transpose(1, 2)  # (1, S, H, D)


def rows_alone(q, k, v, bounds, rows: list[int]) -> torch.Tensor:
    """Each of ``rows`` (packed indices) computed alone, its sequence's keys copied out as a decode reads them."""
    out = []
    for r in rows:
        seq = max(i for i, a in enumerate(bounds[:-1]) if a <= r)
        a, b = bounds[seq], bounds[seq + 1]
        keys = torch.cat(
            [k[0, :, a:b].transpose(0, 1), torch.zeros(5, KVH, D, dtype=k.dtype, device=k.device)]
        )
        values = torch.cat(
            [v[0, :, a:b].transpose(0, 1), torch.ones(5, KVH, D, dtype=v.dtype, device=v.device)]
        )
        one = torch.tensor([r - a], device=q.device)
        out.append(attend(q[0, :, r][None], keys, values, torch.zeros_like(one), one, 0.25)[0])
    return torch.stack(out)


LENGTHS = [3, CHUNK + 7, 1, 2 * CHUNK + 30, 40]  # within a chunk, across two and three, a lone token


def test_values_are_causal_attention_per_sequence() -> None:
    q, k, v, bounds = packed(LENGTHS, torch.float32)
    got = packed_exact_attention(q, k, v, bounds, 0.25)  # (1, S, H, D)
    torch.testing.assert_close(got, per_sequence_sdpa(q, k, v, bounds), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_alone_equals_the_row_in_the_packed_batch(dtype: torch.dtype) -> None:
    q, k, v, bounds = packed(LENGTHS, dtype)
    whole = packed_exact_attention(q, k, v, bounds, 0.25)[0]  # (S, H, D)
    rows = [0, 2, 3, 3 + CHUNK - 1, 3 + CHUNK, 3 + CHUNK + 6, 3 + CHUNK + 7, bounds[4] - 1, bounds[5] - 1]
    assert torch.equal(rows_alone(q, k, v, bounds, rows), whole[rows])
    reordered = [LENGTHS[i] for i in (4, 1, 3, 0, 2)]  # the same sequences packed in another order
    q2 = torch.cat([q[:, :, a:b] for a, b in _spans(bounds, (4, 1, 3, 0, 2))], dim=2)
    k2 = torch.cat([k[:, :, a:b] for a, b in _spans(bounds, (4, 1, 3, 0, 2))], dim=2)
    v2 = torch.cat([v[:, :, a:b] for a, b in _spans(bounds, (4, 1, 3, 0, 2))], dim=2)
    again = packed_exact_attention(q2, k2, v2, [0, *itertools.accumulate(reordered)], 0.25)[0]
    first = bounds[3]  # sequence 3 (the longest) now starts at 40 + 71
    assert torch.equal(again[40 + LENGTHS[1] : 40 + LENGTHS[1] + LENGTHS[3]], whole[first : bounds[4]])


def _spans(bounds: list[int], order: tuple[int, ...]) -> list[tuple[int, int]]:
    return [(bounds[i], bounds[i + 1]) for i in order]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_cuda_kernel_keeps_both_on_the_gpu() -> None:
    q, k, v, bounds = packed(LENGTHS, torch.bfloat16, "cuda")
    whole = packed_exact_attention(q, k, v, bounds, 0.25)[0]
    torch.testing.assert_close(
        whole[None].float(), per_sequence_sdpa(q, k, v, bounds), rtol=2e-2, atol=2e-2
    )  # bf16 inputs, float32 math
    rows = [0, 3 + CHUNK, bounds[4] - 1, bounds[5] - 1]
    assert torch.equal(rows_alone(q, k, v, bounds, rows), whole[rows])
