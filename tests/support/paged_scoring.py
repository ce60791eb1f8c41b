"""Shared by the FP8 rollout tests: fixed responses of different lengths scored teacher-forced through the paged
rollout path (one paged prefill of the prompts, then one decode step per response token)."""

from __future__ import annotations

import torch

PROMPTS = [[3, 4, 5, 9, 11, 2, 7, 30, 31, 12, 40], [8, 9, 10], [21, 22, 23, 24, 25, 26], [50]]
# Different lengths: a row past its response is fed a filler token and its later columns read 0.
RESPONSES = [[12, 14, 60, 2, 5, 9], [33, 34, 35], [1, 2, 3, 4, 5, 6, 7, 8], [44, 45, 46, 47]]
BLOCK = 4
FILLER = 0


def response_mask() -> torch.Tensor:
    """(B, R) bool: which columns of ``score`` are response tokens."""
    longest = max(map(len, RESPONSES))
    return torch.tensor([[j < len(r) for j in range(longest)] for r in RESPONSES])


def score(runner, fp8_cache: bool = False) -> torch.Tensor:
    """Teacher-forced log-probs (B, R) of RESPONSES after PROMPTS through ``runner``'s paged prefill and decode
    (a ``LlamaRunner``); 0 past a row's response (``response_mask``)."""
    from hybridflow.engine.rollout.kv_cache import PagedKVCache

    longest = max(map(len, RESPONSES))
    width = -(-(max(map(len, PROMPTS)) + longest) // BLOCK)  # table width: blocks of the longest row
    tables = torch.stack([torch.arange(width) + 1 + b * width for b in range(len(PROMPTS))])  # (B, width)
    sizes = (runner.num_layers, len(PROMPTS) * width + 1, BLOCK, runner.num_kv_heads, runner.head_dim)
    cache = PagedKVCache(*sizes, runner.dtype, fp8=fp8_cache)
    t = max(map(len, PROMPTS))
    ids = torch.tensor([p + [0] * (t - len(p)) for p in PROMPTS])  # (B, t) right-padded
    lengths = torch.tensor([len(p) for p in PROMPTS])
    logits = runner.prefill_paged(ids, lengths, torch.zeros_like(lengths), cache, tables)  # (B, V)
    out = []
    for step in range(longest):
        fed = torch.tensor([r[step] if step < len(r) else FILLER for r in RESPONSES])  # (B,)
        out.append(logits.float().log_softmax(-1).gather(-1, fed[:, None])[:, 0])
        logits = runner.decode_paged(fed, lengths + step, cache, tables)
    return torch.stack(out, dim=1) * response_mask()  # (B, R)
