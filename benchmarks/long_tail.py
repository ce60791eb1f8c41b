"""The rollout engine on a reasoning-RL-shaped workload: long-tailed response lengths (GPU; not a timed test).

    python benchmarks/rollout.py --long-tail [--shapes 0.5b 1.5b] [--prompts 512] [--n 8] [--max-new 8192]

512 prompts of 128 tokens x 8 samples (4,096 sequences); each sample's length is drawn from a log-normal
distribution with median ``--median`` (600) whose 99th percentile is ``--max-new`` (8,192), clipped there, so
about 1% of the samples run to the limit; seeded. Each sample ends at its drawn length (``lengths=`` of
``generate``, with ``ignore_eos``: the EOS forced there), so every run generates exactly the same tokens' worth
of work. The engine runs with CUDA graphs at ``--gpu-memory-utilization``; it is warmed up on a small slice of
the workload first (kernels, graphs), then timed ``--repeats`` times; the median is reported, with what the
scheduler did. (The slot engine it was compared with here is gone; its figures are in benchmarks/RESULTS.md.)
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from hybridflow.engine.rollout.engine import PagedEngine
from hybridflow.engine.rollout.sampling import SamplingParams

Z99 = 2.3263  # the standard normal's 99th percentile


def draw_lengths(prompts: int, n: int, median: int, limit: int, seed: int = 0) -> list[list[int]]:
    """Per prompt and sample, a response length: log-normal with this median and its 99th percentile at
    ``limit``, clipped to [1, limit]."""
    sigma = math.log(limit / median) / Z99
    g = torch.Generator().manual_seed(seed)
    x = torch.exp(math.log(median) + sigma * torch.randn(prompts, n, generator=g))
    return x.round().clamp(1, limit).long().tolist()


def make_engine(model: torch.nn.Module, seqs: int, args) -> PagedEngine:
    """The engine with the benchmark's memory share and batch bound."""
    kw = dict(
        max_num_seqs=seqs, gpu_memory_utilization=args.gpu_memory_utilization, compile_decode=args.compile
    )
    return PagedEngine(model, block_size=args.block_size, **kw)


def run(
    engine, prompts: list[list[int]], params: SamplingParams, lengths: list[list[int]]
) -> tuple[float, int]:
    """Seconds and tokens of one generate call (synchronised)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = engine.generate(prompts, params, lengths=lengths)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    got = [[len(s.token_ids) for s in g] for g in out]
    assert got == lengths, "a sample did not end at its drawn length"
    return seconds, sum(map(sum, got))


def main_long_tail(args, build) -> None:
    """Time the engine on the long-tail workload for each shape; one row per shape."""
    lengths = draw_lengths(args.prompts, args.n, args.median, args.max_new, args.seed)
    flat = sorted(x for row in lengths for x in row)
    print(
        f"long tail: {args.prompts} prompts x {args.n}, lengths median {flat[len(flat) // 2]}, mean "
        f"{statistics.mean(flat):.0f}, p99 {flat[int(0.99 * len(flat))]}, at the limit "
        f"{sum(x == args.max_new for x in flat) / len(flat):.1%}, {sum(flat):,} tokens"
    )
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(100, 150000, (args.prompts, args.prompt_len), generator=g).tolist()
    params = SamplingParams(n=args.n, max_new_tokens=args.max_new, temperature=1.0, ignore_eos=True, seed=0)
    warm = [[min(x, 64) for x in row] for row in lengths[:16]]
    print(f"{'shape':>6} {'tok/s':>10} {'s':>8} {'seqs at once':>13} {'kv used':>8} {'preempt':>8}")
    for shape in args.shapes:
        model = build(shape)
        engine = make_engine(model, args.prompts * args.n, args)
        run(engine, prompts[:16], params, warm)  # warm-up: kernels, graphs, allocator
        times = [run(engine, prompts, params, lengths) for _ in range(args.repeats)]
        seconds = statistics.median(t for t, _ in times)
        st = engine.last_stats
        at_once = f"{st.concurrent_seqs_mean:.0f}/{st.concurrent_seqs_peak:.0f}"
        print(
            f"{shape:>6} {times[0][1] / seconds:>10,.0f} {seconds:>8.1f} {at_once:>13} "
            f"{st.kv_blocks_used:>8.0%} {st.preemptions:>8.0f}   (decode {st.decode_s:.1f} s in "
            f"{st.decode_steps} steps, prefill {st.prefill_s:.1f} s)",
            flush=True,
        )
        del engine, model
        torch.cuda.empty_cache()
