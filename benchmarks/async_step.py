"""Synchronous against colocated asynchronous GRPO steps on long-tailed response lengths (GPU; not a test).

    python benchmarks/async_step.py --mode sync --model-size 1.5b
    python benchmarks/async_step.py --mode colocate --model-size 1.5b
    python benchmarks/async_step.py --mode colocate --model-size tiny --device cpu --prompts 2 --new-tokens 16 \
        --steps 2 --warmup 1   (CPU smoke run)

The workload: ``--prompts`` random 128-token prompts x ``--n`` samples per step, responses up to
``--new-tokens`` that stop where the policy samples one of a fixed random set of token ids (the generation
config's EOS list: ``--mean-length`` sets its size to vocabulary / mean length, so on a random-weights model
a response's length is close to geometric with that mean, with a long tail up to the limit). Same seed,
prompts and stop set in both modes; random weights, bf16 compute with fp32 masters, the real trainer
(``PPOTrainer`` or ``ColocatePPOTrainer``) through ``build_components``.

``sync`` waits every step for its longest response; ``colocate`` keeps twice the batch in flight and
trains as soon as a batch's worth of groups is done, carrying the rest (``trainer.async_mode=colocate``,
``trainer.max_staleness`` 1). A colocate step that finds a batch already done does not generate, so step
times alternate: the figures are totals over the timed steps (mean seconds per step, trained response
tokens per second), after ``--warmup`` steps (compilation, CUDA graphs). Extra ``key=value`` arguments
override the trainer config.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

try:
    import hybridflow  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_clocks import ClockSampler, machine_line
from grpo_step import hash_reward, prompt_rows, trainer_config, word_tokenizer
from shapes import SHAPES, build_model

from hybridflow.data import RLDataset
from hybridflow.trainer.async_ppo import ColocatePPOTrainer
from hybridflow.trainer.builder import build_components
from hybridflow.trainer.ppo import PPOTrainer


def stop_ids(vocab: int, mean_length: int, seed: int = 0) -> list[int]:
    """``vocab / mean_length`` random token ids (never the pad, EOS or unknown ids 0-2) plus EOS (1)."""
    g = torch.Generator().manual_seed(seed)
    count = max(1, vocab // mean_length)
    return [1, *(3 + torch.randperm(vocab - 3, generator=g)[:count]).tolist()]


def step(trainer: PPOTrainer) -> tuple[float, dict[str, float]]:
    """One trainer step, synchronised: (seconds, metrics)."""
    trainer.global_step += 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    metrics = trainer.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, metrics


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=["sync", "colocate"], default="sync")
    p.add_argument("--model-size", choices=sorted(SHAPES), default="1.5b")
    p.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=2048, help="the response limit")
    p.add_argument("--mean-length", type=int, default=300, help="the stop set's expected response length")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", type=Path, help="append the summary as one JSON line")
    p.add_argument("overrides", nargs="*", help="trainer config overrides, key=value")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    w = dict(prompts=args.prompts, n=args.n, prompt_len=128, new_tokens=args.new_tokens, overrides=[])
    w["mini_batch"] = args.prompts
    args.overrides = ["rollout.ignore_eos=false", f"trainer.async_mode={args.mode}", *args.overrides]
    total = args.warmup + args.steps
    cfg = trainer_config(args, w, total)
    model = build_model(args.model_size, "sdpa", torch.device(args.device))
    vocab = model.config.vocab_size
    model.config.pad_token_id, model.config.eos_token_id = 0, 1
    model.generation_config.eos_token_id = stop_ids(vocab, args.mean_length)
    tokenizer = word_tokenizer(vocab)
    rows = prompt_rows(args.prompts * (total + 2), 128, vocab)  # colocate draws a batch ahead
    train = RLDataset(rows, tokenizer, max_prompt_length=128, source="benchmark prompts")
    cls = ColocatePPOTrainer if args.mode == "colocate" else PPOTrainer
    trainer = cls(cfg, build_components(cfg, model, tokenizer, reward_fn=hash_reward, train=train))
    del model
    for i in range(args.warmup):
        seconds, _ = step(trainer)
        print(f"warm-up step {i + 1}: {seconds:.2f} s", flush=True)
    runs = []
    with ClockSampler() as clocks:
        for i in range(args.steps):
            seconds, m = step(trainer)
            tokens = m["response_length/mean"] * args.prompts * args.n
            runs.append((seconds, tokens, m))
            lag = m.get("async/staleness_mean", 0.0)
            print(
                f"step {i + 1}: {seconds:.2f} s, gen {m.get('timing_s/gen', 0):.2f} s, {tokens:.0f} response "
                f"tokens (max {m['response_length/max']:.0f}), staleness {lag:.2f}, "
                f"reward {m['critic/score/mean']:.3f}",
                flush=True,
            )
    seconds = sum(r[0] for r in runs)
    tokens = sum(r[1] for r in runs)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    summary = {
        "mode": args.mode,
        "model_size": args.model_size,
        "gpu": gpu,
        "steps": args.steps,
        "seconds_per_step": seconds / args.steps,
        "response_tokens_per_s": tokens / seconds,
        "response_length_mean": tokens / args.steps / (args.prompts * args.n),
        "gen_s_per_step": sum(r[2].get("timing_s/gen", 0.0) for r in runs) / args.steps,
        "update_s_per_step": sum(r[2].get("timing_s/update_actor", 0.0) for r in runs) / args.steps,
        "staleness_mean": sum(r[2].get("async/staleness_mean", 0.0) for r in runs) / args.steps,
        "dropped": sum(r[2].get("async/dropped", 0.0) for r in runs),
    }
    print(json.dumps(summary))
    print(machine_line(clocks.info()))
    if args.out is not None:
        with args.out.open("a") as f:
            f.write(json.dumps(summary | {"machine": clocks.info()}) + "\n")
    trainer.c.close()


if __name__ == "__main__":
    main()
