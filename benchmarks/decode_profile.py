"""Kernel table of the paged engine's decode with bf16 and with FP8 projections (GPU; not a test).

    python benchmarks/decode_profile.py [--shape 0.5b] [--batch 64] [--new-tokens 64] [--compile]
        [--kernel triton_w8a8] [--rows 25]

Random weights of a Qwen2.5 shape (``shapes.SHAPES``), CUDA graphs on (compiled decode with ``--compile``),
fixed lengths. Each variant is warmed up with two generate calls, then one more runs under torch.profiler;
prints tokens/s of that call and the top ``--rows`` kernels by GPU time.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from shapes import build_model
from torch.profiler import ProfilerActivity, profile

from hybridflow.engine.ops.fp8 import FP8_KERNELS, quantise_module, use_kernel
from hybridflow.engine.rollout.engine import PagedEngine
from hybridflow.engine.rollout.sampling import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="0.5b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--kernel", default="triton_w8a8", choices=FP8_KERNELS)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--rows", type=int, default=25)
    args = ap.parse_args()
    bf16 = build_model(args.shape, "sdpa", torch.device("cuda")).to(torch.bfloat16).eval()
    fp8 = copy.deepcopy(bf16)
    quantise_module(fp8)
    vocab = bf16.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, vocab - 1, (args.batch, args.prompt_len), generator=g).tolist()
    params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, ignore_eos=True, seed=0)
    use_kernel(args.kernel)
    for name, model in (("bf16", bf16), (f"fp8 {args.kernel}", fp8)):
        engine = PagedEngine(
            model, max_num_seqs=args.batch, compile_decode=args.compile, dtype=torch.bfloat16
        )
        for _ in range(2):  # the second call recompiles the prefill once calibrated (a guard on it)
            engine.generate(prompts, params)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            start = time.perf_counter()
            engine.generate(prompts, params)
            torch.cuda.synchronize()
            wall = time.perf_counter() - start
        print(f"=== {name}: {args.batch * args.new_tokens / wall:.0f} tok/s", flush=True)
        print(
            prof.key_averages().table(
                sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=90
            )
        )
        del engine
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
