"""What the rollout engines' decode loops share: the sampler of a call and the per-bucket compilation."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from hybridflow.engine.rollout.blocks import KSplits
from hybridflow.engine.rollout.sampling import SamplingParams, make_generator, sample

# The K splits of the compiled bf16/fp16 decode step on CUDA (blocks.split_linear): the down projection as 4
# batched GEMMs whose partials the next fused norm sums, instead of cuBLAS's split-K plus its own reduce
# kernel: 147k -> 156k tokens/s at batch 256 and 57k -> 60k at batch 64 on an H200 (benchmarks/RESULTS.md).
DECODE_K_SPLITS = KSplits(down=4)

# Picks the next tokens from (B, V) logits: (tokens (B,) int64, logprobs (B,) float32).
Sampler = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def fused_sampler_available(device: torch.device) -> bool:
    """Whether the fused Triton sampler can run here: CUDA and triton imports (the module loads lazily)."""
    if device.type != "cuda":
        return False
    from hybridflow.engine.rollout import sample_kernel

    return sample_kernel.available()


def compiled_per_bucket(fn: Callable, num_buckets: int, backend: str | Callable = "inductor") -> Callable:
    """``torch.compile`` of ``fn`` with static shapes, allowed one graph per batch bucket.

    dynamo's recompile limit (8 by default) is below the bucket count of a large batch (12 at 256): the
    buckets past it would silently run uncompiled. The limit is raised only around these calls. Inductor's
    combo kernels put independent small kernels into one launch (q's RoPE with k's RoPE and the cache
    write): ~55 us of a 1.6 ms step at batch 256 on the H200, where each launch costs a few microseconds.
    """
    compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)
    limit = max(torch._dynamo.config.recompile_limit, num_buckets + 2)

    def call(*args, **kwargs):
        with (
            torch._dynamo.config.patch(recompile_limit=limit),
            torch._inductor.config.patch(combo_kernels=True),
        ):
            return compiled(*args, **kwargs)

    return call


def make_sampler(
    params: SamplingParams, device: torch.device, fused: bool
) -> tuple[Sampler, torch.Generator | None]:
    """A call's sampler and the torch generator it draws from (None: the fused kernel or global RNG).

    The fused kernel (``fused``: CUDA with triton) keeps its seed and step in a device tensor made here, once
    per call: the same seed gives the same tokens, eager or graphed (its draws do not depend on the batch
    bucket).
    """
    if fused:
        from hybridflow.engine.rollout import sample_kernel

        if sample_kernel.applies(params):
            rng = sample_kernel.make_rng_state(params.seed, device)
            return functools.partial(sample_kernel.fused_sample, params=params, rng=rng), None
    generator = make_generator(params.seed, device)
    return functools.partial(sample, params=params, generator=generator), generator


def check_lengths(
    lengths: list[list[int]] | None, prompts: int, params: SamplingParams
) -> list[list[int]] | None:
    """Per-sample response limits of a generate call, checked: one per sample, each in [1, max_new_tokens]."""
    if lengths is None:
        return None
    ok = len(lengths) == prompts and all(len(row) == params.n for row in lengths)
    if not ok or not all(1 <= x <= params.max_new_tokens for row in lengths for x in row):
        raise ValueError(
            f"lengths must give each of the {prompts} prompts' {params.n} samples a limit in "
            f"[1, max_new_tokens={params.max_new_tokens}]"
        )
    return lengths
