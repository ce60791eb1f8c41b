"""GRPO steps through the real trainer (``PPOTrainer.step``) on a Qwen2.5-VL-3B shape with image prompts (GPU;
not a test). Issue 47's "3 GRPO steps of that shape".

    python benchmarks/vlm_grpo.py --out results.jsonl            # 16 prompts x 4 samples, 3 timed steps
    python benchmarks/vlm_grpo.py --prompts 8 --n 8 actor.use_torch_compile=false
    python benchmarks/vlm_grpo.py --tiny --device cpu            # CPU smoke run: the tiny Qwen2.5-VL

The model is ``vlm_rollout.build_3b``'s shape (text: hidden 2048, 36 layers; vision tower: 32 blocks of 1280;
3.75B parameters, 151,936-token vocabulary with Qwen2.5-VL's vision token ids) with random weights, built in
float32 on the GPU (the trainer's fp32 masters; bf16 compute). A temporary model directory holds its config
and processor: a char-level tokenizer padded to the whole vocabulary (every id the policy samples decodes) with
``<|vision_start|>`` / ``<|image_pad|>`` ... at Qwen's ids, and a Qwen2-VL image processor (PIL, offline). The
prompts are the built-in ``squares`` task's rows (``hybridflow.data.squares``) drawn at ``--image-size``
(448 x 448: 16 x 16 cells of 28 pixels, 256 image tokens after the 2 x 2 merge), processed once as the
dataset is built; the reward is the task's own scorer (random weights score 0: the advantages are zero, the
update's work is the same). Fixed lengths (``ignore_eos``), one PPO epoch, one mini-batch (the rollout's
log-probs are the old ones: no old-log-prob pass), no reference, the vision tower frozen (``model.freeze_vision_tower``, the default); other settings are the trainer's defaults
(per-layer ``torch.compile`` of the text layers on CUDA; ``rollout.compile_decode`` off) and
``grpo_step.trainer_config``'s token budgets. Extra ``key=value`` arguments override the trainer config.

Each step runs ``--warmup`` times untimed, then ``--steps`` times; the table holds the medians of the stage
times (``timing_s/*``), the step time, the rollout's tokens/s (prompts x n x new tokens over ``timing_s/gen``),
the update's MFU (6 N per token, N = the language model's parameters: the frozen tower's forward is left out)
and the peak memory of each phase and of the run. One JSON line goes to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_clocks import ClockSampler, machine_line
from grpo_step import print_table, run_step, trainer_config  # also puts hybridflow on the path
from shapes import PEAK_FLOPS
from vlm_rollout import IMAGE_PAD, VIDEO_PAD, VISION_END, VISION_START, build_3b

from hybridflow.data.builder import dataset_from_rows
from hybridflow.data.squares import make_squares
from hybridflow.models.vision import VISION_TOKENS, VL_CHAT_TEMPLATE, VisionProcessor
from hybridflow.trainer.builder import build_components
from hybridflow.trainer.ppo import PPOTrainer

CELL = 28  # pixels of a squares cell: one merged image token (2 x 2 patches of 14)
QWEN_VISION_IDS = dict(zip(VISION_TOKENS, (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)))


def qwen_vl_tokenizer(vocab_size: int, max_length: int) -> Any:
    """The char tokenizer (ChatML, VL chat template) padded with filler tokens to ``vocab_size`` ids, the vision
    tokens at Qwen2.5-VL's ids (151652, 151653, 151655, 151656): the 3B shape's embedding rows all decode."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    from hybridflow.models.tiny import IM_END_TOKEN, IM_START_TOKEN, build_char_tokenizer

    chars = build_char_tokenizer(model_max_length=max_length)
    state = json.loads(chars.backend_tokenizer.to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    taken = set(vocab.values()) | set(QWEN_VISION_IDS.values())
    vocab.update({f"<f{i}>": i for i in range(vocab_size) if i not in taken})  # never produced by encoding
    vocab.update(QWEN_VISION_IDS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(state)),
        pad_token=chars.pad_token,
        bos_token=chars.bos_token,
        eos_token=chars.eos_token,
        unk_token=chars.unk_token,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        chat_template=VL_CHAT_TEMPLATE,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )
    # Marked special at the ids the vocabulary already gives them (never split, skipped when decoding).
    tokenizer.add_tokens(
        [AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS], special_tokens=True
    )
    return tokenizer


def build_policy(args: argparse.Namespace, model_dir: Path) -> tuple[torch.nn.Module, VisionProcessor]:
    """The policy (float32) and its processor; the config and processor saved to ``model_dir``."""
    if args.tiny:
        from hybridflow.models.vision import build_tiny_vl_model_and_processor

        model, processor = build_tiny_vl_model_and_processor(model_dir, max_pixels=args.image_size**2)
        return model.to(args.device), processor
    from transformers import Qwen2VLImageProcessorPil

    from hybridflow.models.tiny import IM_END_TOKEN

    model = build_3b(torch.device(args.device), torch.float32)
    config = model.config
    tokenizer = qwen_vl_tokenizer(config.text_config.vocab_size, config.text_config.max_position_embeddings)
    image_processor = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=args.image_size**2)
    processor = VisionProcessor(image_processor, tokenizer)
    ids = (config.image_token_id, config.vision_start_token_id)
    assert (processor.image_token_id, processor.vision_start_id) == ids, "the tokenizer's vision ids"
    eos = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END_TOKEN)]
    config.text_config.pad_token_id, config.text_config.eos_token_id = tokenizer.pad_token_id, eos[0]
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = tokenizer.pad_token_id, eos
    config.save_pretrained(model_dir)
    processor.save_pretrained(model_dir)
    return model, processor


def workload(args: argparse.Namespace) -> dict[str, Any]:
    """``grpo_step.trainer_config``'s workload dict: one mini-batch of every sample, prompts room for the image."""
    image_tokens = (args.image_size // CELL) ** 2
    return dict(
        prompts=args.prompts,
        n=args.n,
        prompt_len=image_tokens + 96,  # the question and ChatML take < 80 char tokens
        new_tokens=args.new_tokens,
        mini_batch=args.prompts,
        # The trainer's default (grpo_step turns it on for text models): the compiled decode and prefill are
        # untested on a VLM's M-RoPE prefill; key=value arguments (later) can turn it on.
        overrides=["rollout.compile_decode=false"],
        image_tokens=image_tokens,
    )


def summarize(runs: list[dict[str, float]], w: dict[str, Any], n_text: int) -> dict[str, float]:
    """Medians over the timed steps, the rollout's tokens/s and the update's MFU."""
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0] if all(k in r for r in runs)}
    samples = w["prompts"] * w["n"]
    out["perf/rollout_tokens_per_s"] = samples * w["new_tokens"] / out["timing_s/gen"]
    tokens = out["perf/total_num_tokens"]
    out["mfu/update_actor"] = 6 * n_text * tokens / out["timing_s/update_actor"] / PEAK_FLOPS
    if torch.cuda.is_available():
        out["memory/run_peak_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
        out["memory/run_peak_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``--tiny`` shrinks the sizes left at their defaults."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="the tiny Qwen2.5-VL (a CPU smoke run)")
    p.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--prompts", type=int, default=16, help="image prompts per step")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--image-size", type=int, default=448, help="pixels of each square image (28 x cells)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", type=Path, help="append the summary as one JSON line")
    p.add_argument("overrides", nargs="*", help="trainer config overrides, key=value")
    args = p.parse_args(argv)
    if args.tiny:  # 2 prompts x 2 samples of 4 tokens, 84 x 84 boards (9 image tokens), one step
        defaults = dict(prompts=16, n=4, new_tokens=256, image_size=448, steps=3, warmup=1)
        small = dict(prompts=2, n=2, new_tokens=4, image_size=84, steps=1, warmup=0)
        for key, value in small.items():
            if getattr(args, key) == defaults[key]:
                setattr(args, key, value)
    for name, least in (("steps", 1), ("warmup", 0), ("prompts", 1), ("n", 2), ("new_tokens", 2)):
        if getattr(args, name) < least:
            p.error(f"--{name.replace('_', '-')} must be at least {least}, got {getattr(args, name)}")
    if args.image_size < 2 * CELL or args.image_size % CELL:
        p.error(
            f"--image-size must be a multiple of {CELL} from {2 * CELL} on (a token a cell), got {args.image_size}"
        )
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Build the policy, processor and image prompts, run the steps; print and return the summary."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    w = workload(args)
    total = args.warmup + args.steps
    with tempfile.TemporaryDirectory(prefix="vlm_grpo_") as model_dir:
        start = time.perf_counter()
        model, processor = build_policy(args, Path(model_dir))
        build_s = time.perf_counter() - start
        print(f"policy and processor built in {build_s:.1f} s", flush=True)
        args.overrides = [f"model.path={model_dir}", *args.overrides]  # the processor's directory
        cfg = trainer_config(args, w, total)
        grid = args.image_size // CELL
        rows = make_squares(w["prompts"] * total, seed=0, grid=grid, cell=CELL)  # 1-4 squares a board
        train = dataset_from_rows(
            cfg.data, rows, processor.tokenizer, "squares (benchmark)", processor, "images"
        )
        n_text = sum(p.numel() for p in model.model.language_model.parameters())  # (tied head counted once)
        n_all = sum(p.numel() for p in model.parameters())
        trainer = PPOTrainer(cfg, build_components(cfg, model, processor.tokenizer, train=train))
        del model  # the actor trains it in place
        for i in range(args.warmup):
            run_step(trainer, i + 1, "warm-up")
        with ClockSampler() as clocks:  # samples nvidia-smi while the timed steps run
            runs = [run_step(trainer, args.warmup + i + 1, "timed") for i in range(args.steps)]
        trainer.c.close()
    summary = summarize(runs, w, n_text)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    shape = "tiny" if args.tiny else "qwen2.5-vl-3b"
    print(f"{shape} on {gpu}, torch {torch.__version__}, N = {n_all / 1e9:.3f}B ({n_text / 1e9:.3f}B text), "
          f"{args.prompts} prompts x {args.n} samples, {args.image_size} px images ({w['image_tokens']} tokens), "
          f"{args.new_tokens} new tokens, median of {args.steps} steps after {args.warmup} warm-up")  # fmt: skip
    print_table(summary)
    info = clocks.info()
    print(machine_line(info))
    record = dict(benchmark="vlm_grpo", shape=shape, gpu=gpu, torch=torch.__version__, prompts=args.prompts)
    record.update(
        n=args.n, new_tokens=args.new_tokens, image_size=args.image_size, image_tokens=w["image_tokens"]
    )
    record.update(params=n_all, text_params=n_text, build_s=build_s, overrides=args.overrides[1:])
    record.update(summary, machine=info)
    if args.out is not None:
        with args.out.open("a") as f:
            f.write(json.dumps(record) + "\n")
    return record


if __name__ == "__main__":
    main()
