"""Generated tokens/s of the built-in rollout engine against HF ``generate`` (GPU; not a timed test).

    python benchmarks/rollout.py --batches 64 256 --prompt-len 128 --new-tokens 512 [--compile] [--sdpa]
        [--prefill-tokens 8192 32768] [--k-splits "" "o=2,down=4"] [--hf-tokens 64] [--block-size 128]
    python benchmarks/rollout.py --long-tail [--shapes 0.5b 1.5b] [--compile]     (benchmarks/long_tail.py)
    python benchmarks/rollout.py --model qwen3moe-small [--batches 8 64 256]   (a mixture of experts)
    python benchmarks/rollout.py --model qwen3moe-small-dense                     (its dense twin)

Qwen2.5-0.5B shape unless ``--model`` names one of ``shapes.MOE_SHAPES`` (Qwen3-30B-A3B's layer in 4 layers,
its dense twin of the same active size, tiny ones for a CPU smoke run with ``--device cpu``), random weights,
bf16, fixed lengths (``ignore_eos``). Each configuration runs once to
warm up (kernels, CUDA graphs, compilation) and is then timed ``--repeats`` times; the median is reported.
The HBM roofline of a decode step is (weight bytes + KV bytes in context) / 4.3 TB/s (RESULTS.md, measured anchors);
for a mixture of experts the weight bytes count the experts a batch is expected to touch (uniform routing).
HF ``generate`` is timed with ``--hf-tokens`` new tokens (its speed per token barely depends on the count);
0 skips it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from hybridflow.engine.rollout.blocks import KSplits
from hybridflow.engine.rollout.engine import PagedEngine
from hybridflow.engine.rollout.sampling import SamplingParams

HBM_BYTES_PER_S = 4.3e12  # measured device-to-device copy bandwidth of the H200


def build_model() -> Qwen2ForCausalLM:
    """Qwen2.5-0.5B-shaped model with random weights in bf16 on the GPU."""
    cfg = Qwen2Config(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    return Qwen2ForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16).eval()


def build_named(name: str, device: torch.device, hf_blocks: bool = False) -> torch.nn.Module:
    """A shape of ``shapes.MOE_SHAPES`` in bf16 on ``device``, with the trainer's ``MoEBlock`` swapped in as at
    load (``hf_blocks``: HF's own sparse blocks, which HF generate then runs as a loop over experts)."""
    from shapes import build_moe_shape

    from hybridflow.models.moe import install_moe

    model = build_moe_shape(name, device).to(torch.bfloat16).eval()
    if not hf_blocks:
        install_moe(model)
    return model


def roofline_tokens_per_s(model: torch.nn.Module, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Decode tokens/s if every step only streamed weights and the KV cache in context at HBM speed."""
    cfg = model.config
    experts = getattr(cfg, "num_experts", 0) or 0
    # A mixture of experts reads the experts its batch chose: E * (1 - (1 - k/E)^B) of them, routing uniform.
    touched = 1 - (1 - cfg.num_experts_per_tok / experts) ** batch if experts else 1.0  # share of experts
    weight_bytes = (
        sum(
            p.numel() * (touched if ".experts." in n else 1.0)
            for n, p in model.named_parameters()
            if "embed_tokens" not in n
        )
        * 2
    )
    if cfg.tie_word_embeddings:
        weight_bytes += cfg.vocab_size * cfg.hidden_size * 2  # the tied LM head is read every step
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2
    mean_context = prompt_len + new_tokens / 2
    step_s = (weight_bytes + batch * mean_context * kv_per_token) / HBM_BYTES_PER_S
    return batch / step_s


def sync() -> None:
    """Wait for the GPU (nothing on a CPU smoke run)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_engine(engine, prompts: list[list[int]], params: SamplingParams, repeats: int) -> float:
    engine.generate(prompts, params)  # warm-up: graphs, compilation, allocator
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        out = engine.generate(prompts, params)
        sync()
        times.append(time.perf_counter() - start)
    tokens = sum(len(s.token_ids) for g in out for s in g)
    return tokens / statistics.median(times)


def time_hf(model, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts, device=model.device)
    kw = dict(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        pad_token_id=0,
    )
    model.generate(ids[:, :8], max_new_tokens=4, do_sample=True, pad_token_id=0)  # warm-up
    sync()
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    sync()
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / (time.perf_counter() - start)


def main() -> None:
    """Run the benchmark and print one row per configuration."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile'd decode")
    ap.add_argument(
        "--sdpa", action="store_true", help="also time decode attention as masked SDPA (no Triton kernel)"
    )
    ap.add_argument(
        "--prefill-tokens",
        type=int,
        nargs="+",
        default=[],
        help="also time the fastest variant with these prefill token budgets (default: the engine's)",
    )
    ap.add_argument(
        "--k-splits",
        nargs="+",
        default=[],
        help="also time the fastest variant with decode's projections split over K like this, e.g. 'o=2,down=4' "
        "('' for cuBLAS alone; compile_decode on CUDA uses the engine's DECODE_K_SPLITS)",
    )
    ap.add_argument("--hf-tokens", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=128, help="the KV cache's positions per block")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument(
        "--long-tail", action="store_true", help="the long-tailed workload (benchmarks/long_tail.py)"
    )
    ap.add_argument("--shapes", nargs="+", default=["0.5b", "1.5b"], help="--long-tail: model shapes")
    ap.add_argument("--prompts", type=int, default=512, help="--long-tail: prompts")
    ap.add_argument("--n", type=int, default=8, help="--long-tail: samples per prompt")
    ap.add_argument("--median", type=int, default=600, help="--long-tail: median response length")
    ap.add_argument(
        "--max-new", type=int, default=8192, help="--long-tail: the length limit (the 99th percentile)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--model", default="0.5b", help="0.5b, or a shape of shapes.MOE_SHAPES (qwen3moe-small, ...)"
    )
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of a tiny --model")
    ap.add_argument("--hf-blocks", action="store_true", help="keep HF's sparse MoE blocks (not MoEBlock)")
    args = ap.parse_args()
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    print(f"GPU: {gpu}  torch {torch.__version__}  model {args.model}")
    if args.long_tail:
        from long_tail import main_long_tail
        from shapes import build_model as build_shape

        args.repeats = min(args.repeats, 1) if args.repeats == 3 else args.repeats  # one timed run by default
        main_long_tail(
            args, lambda size: build_shape(size, "sdpa", torch.device("cuda")).to(torch.bfloat16).eval()
        )
        return
    model = (
        build_model()
        if args.model == "0.5b"
        else build_named(args.model, torch.device(args.device), args.hf_blocks)
    )
    print(f"{'batch':>6} {'engine':>44} {'tok/s':>10} {'roofline':>9} {'of roofline':>12}")
    # (name, engine kwargs, runner settings)
    paged = "graphs" if args.device == "cuda" else "eager"  # CUDA graphs capture on a GPU only
    variants = [(paged, dict(compile_decode=False), {})]
    if args.compile:
        variants.append((f"{paged}+compile", dict(compile_decode=True), {}))
    base = list(variants)
    if args.sdpa:
        variants += [(f"{name}, sdpa", kw, dict(decode_attention="sdpa")) for name, kw, _ in base]
    for budget in args.prefill_tokens:  # on the fastest variant only
        name, kw, _ = base[-1]
        variants.append((f"{name}, prefill {budget}", {**kw, "max_num_batched_tokens": budget}, {}))
    for spec in args.k_splits:  # on the fastest variant only
        name, kw, _ = base[-1]
        variants.append((f"{name}, K splits [{spec}]", kw, dict(k_splits=KSplits.parse(spec))))
    g = torch.Generator().manual_seed(0)
    for batch in args.batches:
        vocab = model.config.vocab_size
        prompts = torch.randint(
            min(100, vocab // 2), vocab - 1, (batch, args.prompt_len), generator=g
        ).tolist()
        params = SamplingParams(max_new_tokens=args.new_tokens, temperature=1.0, ignore_eos=True, seed=0)
        roof = roofline_tokens_per_s(model, batch, args.prompt_len, args.new_tokens)
        for name, kw, settings in variants:
            mem = dict(max_num_seqs=batch, gpu_memory_utilization=args.gpu_memory_utilization)
            engine = PagedEngine(model, block_size=args.block_size, **mem, **kw)
            for key, value in settings.items():
                setattr(engine.runner, key, value)
            tps = time_engine(engine, prompts, params, args.repeats)
            print(f"{batch:>6} {name:>44} {tps:>10,.0f} {roof:>9,.0f} {tps / roof:>11.1%}", flush=True)
        if args.hf_tokens:
            tps = time_hf(model, prompts, args.hf_tokens)
            print(
                f"{batch:>6} {'HF generate (' + str(args.hf_tokens) + ' tok)':>44} {tps:>10,.0f} {roof:>9,.0f} "
                f"{tps / roof:>11.1%}",
                flush=True,
            )


if __name__ == "__main__":
    main()
