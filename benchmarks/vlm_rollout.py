"""Rollout tokens/s of the built-in engine against HF ``generate`` on a vision-language model (GPU; not a test).

    python benchmarks/vlm_rollout.py [--batch 64] [--image-size 448] [--text-len 64] [--new-tokens 256]
        [--hf-tokens 256] [--repeats 3] [--compile] [--out results.jsonl]
    python benchmarks/vlm_rollout.py --tiny          (a CPU smoke run: the tiny Qwen2.5-VL, a few prompts)

The Qwen2.5-VL-3B shape (text: hidden 2048, 36 layers, 16 heads, 2 KV heads, intermediate 11008; vision tower:
32 blocks of 1280, 16 heads, intermediate 3420, full attention in blocks 7, 15, 23, 31, windows of 112 pixels,
merged to 2048) with random weights in bf16 on the GPU. Each prompt is a chat turn holding one generated
image (``--image-size`` square: 448 x 448 is 32 x 32 patches, 256 image tokens after the 2 x 2 merge) between
``--text-len`` random text tokens; the images differ per prompt. Both engines sample (temperature 1, no top-k)
a fixed number of tokens (``ignore_eos``), so they produce the same token counts; the time covers the whole
rollout (vision tower, prefill, decode). The built-in engine runs once to warm up (kernels, CUDA graphs,
compilation) and is then timed ``--repeats`` times; HF ``generate`` runs a short warm-up and is timed
``--repeats`` times too; medians are reported. ``vision_s`` is the vision tower alone over all images (the
engine runs it once per prompt at prefill). One JSON line per engine is printed and appended to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hybridflow.engine.rollout.engine import PagedEngine
from hybridflow.engine.rollout.multimodal import image_features, mm_prompt
from hybridflow.engine.rollout.sampling import SamplingParams

# Qwen2.5-VL's own special token ids (its 151,936-token vocabulary).
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 151652, 151653, 151655, 151656


def build_3b(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """The Qwen2.5-VL-3B shape with random weights, built in ``dtype`` (bf16 by default) directly on ``device``."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=151936,
            hidden_size=2048,
            num_hidden_layers=36,
            num_attention_heads=16,
            num_key_value_heads=2,
            intermediate_size=11008,
            max_position_embeddings=32768,
            rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
            rope_theta=1000000.0,
            tie_word_embeddings=True,
        ),
        vision_config=dict(
            depth=32,
            hidden_size=1280,
            intermediate_size=3420,
            num_heads=16,
            out_hidden_size=2048,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=112,
            fullatt_block_indexes=[7, 15, 23, 31],
        ),
        image_token_id=IMAGE_PAD,
        video_token_id=VIDEO_PAD,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=True,
    )
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(0)
        with torch.device(device):  # 3.8B parameters: never a copy on the host
            model = Qwen2_5_VLForConditionalGeneration(config)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def image_inputs(size: int, count: int, tiny: Any = None) -> list[dict[str, torch.Tensor]]:
    """One generated ``size`` x ``size`` picture per prompt (coloured squares on grey, different each), through
    the model's image processor (the tiny model's own with ``tiny``)."""
    from PIL import Image

    if tiny is not None:
        processor = tiny.image_processor
    else:
        try:
            from transformers import Qwen2VLImageProcessorPil
        except ImportError:  # an older transformers: patches of the right shape, random values
            return [synthetic_image(size, k) for k in range(count)]
        processor = Qwen2VLImageProcessorPil(min_pixels=size * size, max_pixels=size * size)
    out = []
    for k in range(count):
        rng = np.random.default_rng(k)
        pixels = np.full((size, size, 3), 128, dtype=np.uint8)
        for _ in range(4):
            x, y, w = *rng.integers(0, size // 2, 2), size // 4
            pixels[y : y + w, x : x + w] = rng.integers(0, 255, 3)
        got = processor(images=[Image.fromarray(pixels)], return_tensors="pt")
        out.append(
            {"pixel_values": got["pixel_values"].float(), "image_grid_thw": got["image_grid_thw"].long()}
        )
    return out


def synthetic_image(size: int, seed: int) -> dict[str, torch.Tensor]:
    """A ``size`` x ``size`` image's processor output without the processor: (P, 3 * 2 * 14 * 14) patches."""
    side = size // 14
    g = torch.Generator().manual_seed(seed)
    return {
        "pixel_values": torch.randn(side * side, 3 * 2 * 14 * 14, generator=g),
        "image_grid_thw": torch.tensor([[1, side, side]]),
    }


def build_prompts(
    mms: list[dict[str, torch.Tensor]], text_len: int, vocab: int, ids: tuple[int, int, int], merge: int
) -> list[list[int]]:
    """Per image: random text, the image's slot (start, its merged-patch count of pads, end), random text."""
    start, pad, end = ids
    g = torch.Generator().manual_seed(0)
    prompts = []
    for mm in mms:
        pads = int(mm["image_grid_thw"].prod(-1).sum()) // merge**2
        top = min(vocab - 100, 151000)  # below the special tokens (Qwen: 151643 on; the tiny model: its last)
        head, tail = torch.randint(3, top, (2, text_len // 2), generator=g).tolist()
        prompts.append([*head, start, *[pad] * pads, end, *tail])
    return prompts


def sync() -> None:
    """Wait for the GPU (nothing on a CPU smoke run)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int) -> tuple[float, list[float]]:
    """The median wall time of ``repeats`` calls of ``fn`` (the device synchronised around each)."""
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def hf_kwargs(model: torch.nn.Module, prompts: list[list[int]], mms: list[dict[str, torch.Tensor]]) -> dict:
    """HF generate's inputs: the (equal-length) prompts and every image, on the model's device."""
    dev = next(model.parameters()).device
    ids = torch.tensor(prompts, device=dev)  # (B, T): every prompt has the same length
    return dict(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        pixel_values=torch.cat([mm["pixel_values"] for mm in mms]).to(dev),
        image_grid_thw=torch.cat([mm["image_grid_thw"] for mm in mms]).to(dev),
        mm_token_type_ids=(ids == model.config.image_token_id).int(),
    )


def time_engine(
    model: torch.nn.Module,
    prompts: list[list[int]],
    mms: list[dict[str, torch.Tensor]],
    params: SamplingParams,
    args: argparse.Namespace,
    compiled: bool,
) -> dict[str, Any]:
    """The paged engine's rollout of every prompt (after a warm-up run): its figures."""
    kw: dict[str, Any] = dict(
        block_size=args.block_size,
        max_num_seqs=args.batch,
        compile_decode=compiled,
        max_model_len=len(prompts[0]) + params.max_new_tokens,
    )
    if args.device == "cuda":
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
    engine = PagedEngine(model, **kw)
    out = []

    def run() -> None:
        out[:] = engine.generate(prompts, params, mm_inputs=mms)

    run()  # warm-up: graphs, compilation, allocator
    median, times = timed(run, args.repeats)
    tokens = sum(len(s.token_ids) for g in out for s in g)
    stats = engine.last_stats
    return {
        "engine": "paged+compile" if compiled else "paged",
        "new_tokens": params.max_new_tokens,
        "tokens": tokens,
        "tokens_per_s": tokens / median,
        "median_s": median,
        "times_s": times,
        "prefill_s": stats.prefill_s,
        "decode_s": stats.decode_s,
        "image_prefills": stats.image_prefills,
    }


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Time the engine (and its compiled variant) and HF generate; one record each."""
    device = torch.device(args.device)
    tiny = None
    if args.tiny:
        from hybridflow.models.vision import build_tiny_vl_model_and_processor

        model, tiny = build_tiny_vl_model_and_processor()
    else:
        model = build_3b(device)
    config = model.config
    merge = config.vision_config.spatial_merge_size
    mms = image_inputs(args.image_size, args.batch, tiny)
    ids = (config.vision_start_token_id, config.image_token_id, config.vision_end_token_id)
    prompts = build_prompts(mms, args.text_len, config.text_config.vocab_size, ids, merge)
    new = args.new_tokens
    params = SamplingParams(max_new_tokens=new, temperature=1.0, ignore_eos=True, seed=0)
    base = {
        "benchmark": "vlm_rollout",
        "shape": "tiny" if args.tiny else "qwen2.5-vl-3b",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "batch": args.batch,
        "image_size": args.image_size,
        "image_tokens": len(prompts[0]) - args.text_len - 2,
        "prompt_len": len(prompts[0]),
    }
    visual, dtype = model.model.visual, next(model.parameters()).dtype
    checked = [mm_prompt(p, mm, config.image_token_id, merge) for p, mm in zip(prompts, mms)]
    with torch.no_grad():
        image_features(visual, checked, device, dtype)  # warm-up
        vision_s, _ = timed(lambda: image_features(visual, checked, device, dtype), args.repeats)
    records = [
        {**base, **time_engine(model, prompts, mms, params, args, compiled), "vision_s": vision_s}
        for compiled in ([False, True] if args.compile else [False])
    ]
    if args.hf_tokens:
        kw = dict(max_new_tokens=args.hf_tokens, min_new_tokens=args.hf_tokens, do_sample=True)
        kw.update(temperature=1.0, top_k=0, pad_token_id=0)
        inputs = hf_kwargs(model, prompts, mms)
        with torch.no_grad():
            model.generate(
                **hf_kwargs(model, prompts[:2], mms[:2]), max_new_tokens=4, do_sample=True, pad_token_id=0
            )
            median, times = timed(lambda: model.generate(**inputs, **kw), args.repeats)
        tokens = args.batch * args.hf_tokens
        hf = {**base, "engine": "hf", "new_tokens": args.hf_tokens, "tokens": tokens}
        records.append({**hf, "tokens_per_s": tokens / median, "median_s": median, "times_s": times})
        for r in records[:-1]:
            r["over_hf"] = r["tokens_per_s"] / records[-1]["tokens_per_s"]
    return records


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``--tiny`` shrinks the sizes left at their defaults."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: the tiny Qwen2.5-VL, a few prompts")
    p.add_argument("--batch", type=int, default=64, help="prompts (one image each)")
    p.add_argument("--image-size", type=int, default=448, help="pixels of each square image")
    p.add_argument("--text-len", type=int, default=64, help="text tokens around each image")
    p.add_argument("--new-tokens", type=int, default=256, help="tokens the engine samples per prompt")
    p.add_argument(
        "--hf-tokens", type=int, default=256, help="tokens HF generate samples per prompt (0: skip)"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="also time the compiled decode step")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--out", type=Path, default=None, help="append the JSON lines here")
    args = p.parse_args(argv)
    args.device = "cpu" if args.tiny else "cuda"
    if args.tiny:  # a few small prompts, unless sizes were given
        defaults = dict(batch=64, image_size=448, text_len=64, new_tokens=256, hf_tokens=256, repeats=3)
        small = dict(batch=3, image_size=56, text_len=8, new_tokens=6, hf_tokens=6, repeats=1)
        for key, value in small.items():
            if getattr(args, key) == defaults[key]:
                setattr(args, key, value)
        args.block_size = min(args.block_size, 16)
    return args


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Run, print the JSON lines and a table, append them to ``--out``."""
    args = parse_args(argv)
    records = measure(args)
    for r in records:
        print(json.dumps(r), flush=True)
    print(f"{'engine':>14} {'tokens':>8} {'tok/s':>10} {'median s':>9} {'x HF':>6}")
    for r in records:
        ratio = f"{r['over_hf']:.2f}" if "over_hf" in r else ""
        print(
            f"{r['engine']:>14} {r['tokens']:>8} {r['tokens_per_s']:>10,.0f} {r['median_s']:>9.2f} {ratio:>6}"
        )
    print(f"vision tower alone over {args.batch} images: {records[0]['vision_s']:.3f} s")
    if args.out is not None:
        with args.out.open("a") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
    return records


if __name__ == "__main__":
    main()
