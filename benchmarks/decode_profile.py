"""Where a decode step's time goes: each kernel's share, the idle gaps between kernels, and the step against its
HBM roofline (GPU; not a test).

    python benchmarks/decode_profile.py [--shapes 0.5b 1.5b 7b] [--batches 64 256] [--prompt-len 128]
        [--eager] [--no-compile] [--fp8 triton_w8a8] [--rows 12] [--out FILE.jsonl]

Random weights of a Qwen2.5 shape (``shapes.SHAPES``), bf16, fixed lengths, the engine as the trainer runs it
(CUDA graphs and the compiled decode; ``--no-compile`` leaves the compile out, ``--eager`` the graphs too).

One decode step is isolated without touching the engine: two generate calls of ``A`` and ``A + S`` new tokens
run under the profiler, and each kernel's time per decode step is the difference of the two runs' totals over
``S`` (the prefill and the first tokens cancel). The step's wall time comes the same way from unprofiled runs.
The sum of the kernels is the GPU's busy time; the rest of the wall time is idle (launch gaps, host work).

Bytes a step must read: the weights (every linear layer and the LM head, in the model's dtype) and the KV
cache in context; the roofline is those bytes over the card's copy bandwidth, measured at start (a large
device-to-device copy: read + write bytes over its time). Kernels are grouped into classes by name (GEMMs,
decode attention, sampling, the rest) and each class's bandwidth is its bytes over its time: the GEMMs move the
weights, attention the KV cache. ``--out`` appends one JSON line per (shape, batch) for RESULTS.md.
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import statistics
import time

import torch
from shapes import SHAPES, build_model
from torch.profiler import ProfilerActivity, profile

from hybridflow.engine.rollout.engine import PagedEngine
from hybridflow.engine.rollout.sampling import SamplingParams

# Kernel classes by name. cuBLAS / CUTLASS GEMMs are "gemm", "nvjet", "xmma" or "cutlass"; Inductor's Triton
# matmul templates are "triton_tem_"; the project's FP8 GEMMs "_w8a8" / "_w8a16".
# The first class that matches wins: the sampler's kernels before attention's ("_sample_split_kernel").
CLASSES = {
    "sampling": ("_sample_split_kernel", "_sample_merge_kernel"),
    "gemm": ("gemm", "nvjet", "xmma", "cutlass", "triton_tem_", "_w8a8_kernel", "_w8a16_kernel", "splitk"),
    "attention": ("_split_kernel", "_combine_kernel", "flash", "attention"),
}


def kernel_class(name: str) -> str:
    """The class of a kernel name (``CLASSES``), "other" for norms, RoPE, element-wise and copies."""
    low = name.lower()
    return next((cls for cls, keys in CLASSES.items() if any(k.lower() in low for k in keys)), "other")


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write), median of five: the card's usable HBM speed."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * src.numel() / statistics.median(times)


def step_bytes(model: torch.nn.Module, batch: int, context: float) -> tuple[float, float]:
    """(weight bytes, KV bytes) one decode step reads at a mean ``context`` (positions per row)."""
    cfg = model.config
    weights = sum(
        m.weight.numel() * m.weight.element_size()
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and hasattr(m, "weight")
    )  # the tied LM head is a Linear over the embedding: counted once, as it is read once per step
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2  # K and V in bf16
    return float(weights), batch * context * kv_per_token


def kernel_totals(engine: PagedEngine, prompts: list[list[int]], params: SamplingParams) -> dict:
    """{kernel name: (total us, calls)} of one generate call under the profiler."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, params)
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA:  # a kernel, memcpy or memset on the GPU
            totals[evt.name][0] += evt.time_range.elapsed_us()
            totals[evt.name][1] += 1
    return totals


def wall(engine: PagedEngine, prompts: list[list[int]], params: SamplingParams, repeats: int = 3) -> float:
    """Median seconds of a generate call."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.generate(prompts, params)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def profile_step(engine: PagedEngine, prompts: list[list[int]], first: int, span: int) -> tuple[dict, float]:
    """({kernel: (us per decode step, calls per step)}, wall us per decode step) by differencing two calls."""

    def params(n: int) -> SamplingParams:
        return SamplingParams(max_new_tokens=n, temperature=1.0, ignore_eos=True, seed=0)

    for n in (first, first + span):  # warm-up: graphs, compilation, the allocator
        engine.generate(prompts, params(n))
        engine.generate(prompts, params(n))
    short, long = (
        kernel_totals(engine, prompts, params(first)),
        kernel_totals(engine, prompts, params(first + span)),
    )
    per_step = {}
    for name, (us, calls) in long.items():
        us0, calls0 = short.get(name, (0.0, 0))
        if calls > calls0:  # a kernel of the decode steps (the prefill's cancel)
            per_step[name] = ((us - us0) / span, (calls - calls0) / span)
    step_wall = (wall(engine, prompts, params(first + span)) - wall(engine, prompts, params(first))) / span
    return per_step, step_wall * 1e6


def report(
    label: str, per_step: dict, step_us: float, weight_b: float, kv_b: float, bw: float, rows: int
) -> dict:
    """Print one configuration's table; return its summary for ``--out``."""
    busy = sum(us for us, _ in per_step.values())
    floor_us = (weight_b + kv_b) / bw * 1e6
    classes: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for name, (us, calls) in per_step.items():
        classes[kernel_class(name)][0] += us
        classes[kernel_class(name)][1] += calls
    moved = {"gemm": weight_b, "attention": kv_b}
    print(f"=== {label}")
    print(
        f"step {step_us:.1f} us wall, kernels {busy:.1f} us busy ({busy / step_us:.0%}), idle {step_us - busy:.1f} us;"
        f" roofline {floor_us:.1f} us (weights {weight_b / 1e9:.3f} GB + KV {kv_b / 1e9:.3f} GB at "
        f"{bw / 1e12:.2f} TB/s): {floor_us / step_us:.1%} of it, {floor_us / busy:.1%} if the gaps closed"
    )
    print(f"{'class':<10} {'us/step':>9} {'launches':>9} {'share':>7} {'GB/step':>8} {'TB/s':>6}")
    for cls, (us, calls) in sorted(classes.items(), key=lambda kv: -kv[1][0]):
        gb = moved.get(cls)
        tbs = f"{gb / (us * 1e-6) / 1e12:6.2f}" if gb and us else f"{'':>6}"
        print(f"{cls:<10} {us:9.1f} {calls:9.0f} {us / step_us:7.1%} {(gb or 0) / 1e9:8.3f} {tbs}")
    print(f"{'kernel':<72} {'class':>9} {'calls':>6} {'us/step':>8} {'share':>6}")
    for name, (us, calls) in sorted(per_step.items(), key=lambda kv: -kv[1][0])[:rows]:
        print(f"{name[:72]:<72} {kernel_class(name):>9} {calls:6.0f} {us:8.1f} {us / step_us:6.1%}")
    return {
        "config": label,
        "step_us": round(step_us, 1),
        "busy_us": round(busy, 1),
        "launches": round(sum(c for _, c in per_step.values())),
        "roofline_us": round(floor_us, 1),
        "roofline_fraction": round(floor_us / step_us, 4),
        "classes_us": {c: round(v[0], 1) for c, v in classes.items()},
        "copy_tb_s": round(bw / 1e12, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["0.5b", "1.5b", "7b"], choices=sorted(SHAPES))
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--first", type=int, default=8, help="new tokens of the shorter call")
    ap.add_argument("--span", type=int, default=32, help="decode steps the longer call adds")
    ap.add_argument("--no-compile", action="store_true", help="CUDA graphs without the compiled decode")
    ap.add_argument("--eager", action="store_true", help="neither graphs nor compile")
    ap.add_argument("--fp8", default=None, help="also profile FP8 projections with this kernel (ops.fp8)")
    ap.add_argument("--rows", type=int, default=12, help="kernels listed per configuration")
    ap.add_argument("--out", default=None, help="append one JSON line per configuration here")
    args = ap.parse_args()
    device = torch.device("cuda")
    bw = copy_bandwidth(device)
    mode = "eager" if args.eager else "graphs" if args.no_compile else "graphs + compile"
    print(f"{torch.cuda.get_device_name(0)}: copy bandwidth {bw / 1e12:.2f} TB/s; decode as {mode}")
    g = torch.Generator().manual_seed(0)
    for shape in args.shapes:
        bf16 = build_model(shape, "sdpa", device).to(torch.bfloat16).eval()
        variants = [("bf16", bf16)]
        if args.fp8:
            from hybridflow.engine.ops.fp8 import quantise_module, use_kernel

            fp8 = copy.deepcopy(bf16)
            quantise_module(fp8)
            use_kernel(args.fp8)
            variants.append((f"fp8 {args.fp8}", fp8))
        vocab = bf16.config.vocab_size
        for batch in args.batches:
            prompts = torch.randint(100, vocab - 1, (batch, args.prompt_len), generator=g).tolist()
            context = args.prompt_len + args.first + args.span / 2
            for name, model in variants:
                engine = PagedEngine(
                    model,
                    max_num_seqs=batch,
                    dtype=torch.bfloat16,
                    enforce_eager=args.eager,
                    compile_decode=not (args.eager or args.no_compile),
                )
                per_step, step_us = profile_step(engine, prompts, args.first, args.span)
                weight_b, kv_b = step_bytes(bf16, batch, context)
                if name != "bf16":
                    weight_b /= 2  # one byte per FP8 weight
                label = f"{shape} {name} batch {batch} context {context:.0f} ({mode})"
                row = report(label, per_step, step_us, weight_b, kv_b, bw, args.rows)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps({**row, "gpu": torch.cuda.get_device_name(0)}) + "\n")
                del engine
                torch.cuda.empty_cache()
        del bf16, variants
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
