"""Decode tokens/s of the paged engine with bf16 weights, FP8 projections (``rollout.quantization=fp8``), and
FP8 projections with an FP8 KV cache (``rollout.kv_cache_dtype=fp8``).

    python benchmarks/fp8_decode.py [--shapes 0.5b 1.5b 7b] [--batches 16 64 256] [--prompt-len 128]
        [--new-tokens 256] [--repeats 3] [--compile] [--kernels scaled_mm scaled_mm_static triton_w8a8 w8a16]
        [--no-fp8-kv] [--out results.jsonl]
    python benchmarks/fp8_decode.py --device cpu --shapes tiny --batches 2 --new-tokens 4   (a smoke run)

Qwen2.5 shapes (``shapes.SHAPES``) with random weights in bf16, CUDA graphs on (compiled decode with
``--compile``), fixed
lengths (``ignore_eos``). The FP8 variant quantises the dense projections the way the switch delivers them
(e4m3, rowwise float32 scales; embeddings, LM head and norms in bf16) and runs them through
``torch._scaled_mm`` with per-token activation scales (``fp8``), with static activation scales
(``fp8_scaled_mm_static``: one float32 scale per projection input, set by the first prefill of each
``generate``; the quantisation is elementwise, fused into the RMSNorm / SiLU-mul by inductor with
``--compile``, by ``engine.ops.fp8_fused``'s Triton kernels without), or
through the weight-only Triton kernel (``fp8_w8a16``: FP8 weights upcast in registers, bf16 activations);
``--kernels`` picks which. Each FP8
variant runs again with the FP8 KV cache (``fp8_kv``, ``fp8_w8a16_kv``: ``rollout.kv_cache_dtype=fp8``, e4m3 K
and V with per-(layer, KV head) scales set by the first prefill of each ``generate``, read by the fused
Triton decode kernel). Each configuration is warmed up once and timed ``--repeats`` times; the median is
reported, with the weights' bytes, the pool's blocks (``*_pool_blocks``: a budget that binds holds twice the
blocks with the FP8 cache) and the mean |log-prob| gap of the FP8 engine's sampled tokens against the bf16
model on the same tokens (a quality check, not a timing).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
from shapes import SHAPES, build_model

from hybridflow.engine.ops import fp8_w8a8
from hybridflow.engine.ops.fp8 import FP8_KERNELS, quantise_module, use_kernel
from hybridflow.engine.ops.fp8_probe import fp8_probe
from hybridflow.engine.rollout.engine import PagedEngine
from hybridflow.engine.rollout.sampling import SamplingParams

SHAPES.setdefault(
    "tiny",
    dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
         intermediate_size=128, vocab_size=512),
)  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(
    engine: PagedEngine, prompts: list[list[int]], params: SamplingParams, repeats: int, device
) -> tuple:
    """(tokens/s median, the last run's outputs) after one warm-up run."""
    engine.generate(prompts, params)
    times, out = [], None
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        out = engine.generate(prompts, params)
        sync(device)
        times.append(time.perf_counter() - start)
    tokens = sum(len(s.token_ids) for g in out for s in g)
    return tokens / statistics.median(times), out


def logprob_gap(model: torch.nn.Module, prompts: list[list[int]], out: list, rows: int = 8) -> float:
    """Mean |FP8 engine log-prob - bf16 model log-prob| over the sampled tokens of the first ``rows``."""
    gaps = []
    for prompt, group in list(zip(prompts, out))[:rows]:
        s = group[0]
        ids = torch.tensor([prompt + s.token_ids], device=next(model.parameters()).device)
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # (R, V)
        ref = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None]).squeeze(1)
        gaps.append((ref.cpu() - torch.tensor(s.logprobs)).abs().mean().item())
    return statistics.mean(gaps)


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def run_shape(size: str, args: argparse.Namespace, device: torch.device) -> list[dict]:
    bf16 = build_model(size, "sdpa", device).to(torch.bfloat16).eval()
    fp8 = copy.deepcopy(bf16)
    quantised = quantise_module(fp8)
    cfg = bf16.config
    kv = cfg.num_key_value_heads * cfg.hidden_size // cfg.num_attention_heads
    probe = {}  # the engine's start-up figures (CUDA only)
    if device.type == "cuda":
        dims = (cfg.hidden_size, cfg.intermediate_size, device, cfg.hidden_size, kv)
        probe = fp8_probe(*dims, model_layers=cfg.num_hidden_layers)
    rows = []
    g = torch.Generator().manual_seed(0)
    for batch in args.batches:
        vocab = bf16.config.vocab_size
        prompts = torch.randint(
            min(100, vocab // 2), vocab - 1, (batch, args.prompt_len), generator=g
        ).tolist()
        params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, ignore_eos=True, seed=0)
        row = {
            "shape": size,
            "batch": batch,
            "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        }
        variants = [("bf16", bf16, None, "auto")]
        for k in args.kernels:  # FP8 weights through each kernel, with the model's KV cache and with FP8's
            name = "fp8" if k == "scaled_mm" else f"fp8_{k}"
            variants += [(name, fp8, k, "auto")] + ([(f"{name}_kv", fp8, k, "fp8")] if args.fp8_kv else [])
        for name, model, kernel, kv in variants:
            if kernel is not None:
                use_kernel(kernel)
            engine = PagedEngine(
                model, max_num_seqs=batch, gpu_memory_utilization=args.gpu_memory_utilization,
                compile_decode=args.compile, device=device, dtype=torch.bfloat16, kv_cache_dtype=kv,
            )  # fmt: skip
            tps, out = timed(engine, prompts, params, args.repeats, device)
            row[f"{name}_tok_s"] = tps
            row[f"{name}_weight_gib"] = weight_bytes(model) / 2**30
            row[f"{name}_pool_blocks"] = engine.last_pool_blocks
            if kernel is not None:
                row[f"{name}_logprob_gap"] = logprob_gap(bf16, prompts, out)
            del engine
            if device.type == "cuda":
                torch.cuda.empty_cache()
        for name, *_ in variants[1:]:
            row[f"{name}_speedup"] = row[f"{name}_tok_s"] / row["bf16_tok_s"]
        row["fp8_projections"] = len(quantised)
        row["probe_us"] = probe  # the engine's start-up choice (64 tokens)
        print(json.dumps(row), flush=True)
        rows.append(row)
    del bf16, fp8
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["0.5b", "1.5b", "7b"])
    ap.add_argument("--batches", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.6)
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--kernels",
        nargs="+",
        default=["scaled_mm", "w8a16"],
        choices=FP8_KERNELS,
        help="the FP8 kernels run",
    )
    ap.add_argument(
        "--compile", action="store_true", help="compiled decode (inductor may fuse the quantisation)"
    )
    ap.add_argument("--no-fp8-kv", dest="fp8_kv", action="store_false", help="skip the FP8 KV cache variants")
    ap.add_argument("--out", type=Path, default=None, help="append the JSON lines here")
    ap.add_argument(
        "--w8a8-table", type=Path, default=None, help="triton_w8a8's launch table (fp8_gemm.py --pick-table)"
    )
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.w8a8_table is not None:
        fp8_w8a8.use_table(json.loads(args.w8a8_table.read_text())["configs"])
        print("W8A8 table:", fp8_w8a8._CONFIGS, flush=True)
    for size in args.shapes:
        rows = run_shape(size, args, device)
        if args.out is not None:
            with args.out.open("a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
