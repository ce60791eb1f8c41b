"""A GRPO step through the real trainer (``PPOTrainer.step``) on a Qwen2.5- or Qwen2-7B-shaped model (GPU;
not a test).

    python benchmarks/grpo_step.py --workload W1 --model-size 0.5b
    python benchmarks/grpo_step.py --workload W2 --model-size 0.5b --profile-dir $OUT/prof
    python benchmarks/grpo_step.py --workload W2 --model-size 1.5b --steps 2 --warmup 1
    python benchmarks/grpo_step.py --workload W2 --model-size 7b --gpu-memory-gb 80   # an 80 GiB GPU's share

``--model-size`` takes the shapes of ``shapes.SHAPES`` (7b: Qwen2-7B, untied embeddings) and the mixtures of experts
of ``shapes.MOE_SHAPES`` (e.g. ``qwen3moe-small``: Qwen3-30B-A3B's layer in 4 layers; add
``actor.router_replay=r3`` to replay the rollout's experts). ``--gpu-memory-gb``
caps the memory this process may allocate on the GPU (``torch.cuda.set_per_process_memory_fraction``, set
before anything is allocated), so a smaller GPU is measured on a bigger one.

Workloads (issue 7; random weights, bf16 compute with fp32 masters, fixed lengths with ``ignore_eos``):
  W1: 8 prompts x 8 samples, 128-token prompts, 512 new tokens, one PPO epoch, one mini-batch, no reference.
  W2: 128 prompts x 8 samples, 256-token prompts, 1024 new tokens, reference model and KL loss (low_var_kl),
      mini-batches of 256 samples (4 optimizer steps per GRPO step).
Extra ``key=value`` arguments override the trainer config (e.g. ``actor.ppo_max_token_len_per_gpu=32768``).

Each step runs ``--warmup`` times untimed (compilation, CUDA graphs, allocator), then ``--steps`` times; the
table holds the medians. It prints the stage times (``timing_s/*``), the step time, ``perf/throughput``,
the MFU of the update and log-prob passes (6N and 2N FLOPs per token over 790 TFLOP/s, N counting the tied
embedding once), the rollout's decode tokens/s and its fraction of the HBM roofline (every decode step
streams the bf16 weights and the KV cache in context at 4.3 TB/s), the peak memory of each phase and of
the step, and the bytes the dataflow freed. ``--profile-dir`` profiles one more step (kernel tables).
A last line names the machine as the timed steps ran on it (the GPU's SM and memory clocks, power,
temperature and clock-event reasons, sampled from ``nvidia-smi`` every 200 ms during those steps, and the
host CPU), since step times differ between machine starts.

CPU smoke run: ``--model-size tiny --device cpu --prompts 2 --prompt-len 16 --new-tokens 8 --steps 1 --warmup 1``.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import zlib
from pathlib import Path

import torch

try:
    import hybridflow  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_clocks import ClockSampler, cap_gpu_memory, gpu_memory_gb, machine_line
from shapes import MOE_SHAPES, PEAK_FLOPS, SHAPES, build_model, build_moe_shape, count_params

from hybridflow.config import load_config
from hybridflow.data import RLDataset
from hybridflow.trainer.builder import build_components
from hybridflow.trainer.ppo import PPOTrainer

HBM_BYTES_PER_S = 4.3e12  # measured device-to-device copy bandwidth of the H200 (RESULTS.md, measured anchors)

WORKLOADS = {
    "W1": dict(prompts=8, n=8, prompt_len=128, new_tokens=512, mini_batch=8, overrides=[]),
    "W2": dict(
        prompts=128,
        n=8,
        prompt_len=256,
        new_tokens=1024,
        mini_batch=32,  # prompts: 32 x 8 = 256 samples per optimizer step
        overrides=["actor.use_kl_loss=true", "actor.kl_loss_type=low_var_kl", "actor.kl_loss_coef=0.001"],
    ),
}


def word_tokenizer(vocab_size: int):
    """A word-level tokenizer covering every id of the model ('<pad>', '<eos>', '<unk>', then 'w3', ...)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2} | {f"w{i}": i for i in range(3, vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def prompt_rows(count: int, length: int, vocab_size: int, seed: int = 0) -> list[dict]:
    """Raw-text prompts of exactly ``length`` random words each."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size, (count, length), generator=g)  # (count, length)
    return [
        {
            "data_source": "bench",
            "prompt": " ".join(f"w{i}" for i in row.tolist()),
            "reward_model": {"ground_truth": "-"},
        }
        for row in ids
    ]


def hash_reward(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """A deterministic score in [0, 1) that differs between responses, so GRPO's advantages are not zero."""
    return (zlib.crc32(solution_str.encode()) % 1000) / 1000


def trainer_config(args: argparse.Namespace, w: dict, total_steps: int):
    """The trainer config of the workload (verl-style keys); command-line overrides come last."""
    cuda = args.device == "cuda"
    overrides = [
        f"trainer.device={args.device}",
        f"trainer.total_training_steps={total_steps}",
        "trainer.logger=[]",
        f"data.train_batch_size={w['prompts']}",
        f"data.max_prompt_length={w['prompt_len']}",
        f"data.max_response_length={w['new_tokens']}",
        "algorithm.adv_estimator=grpo",
        f"rollout.n={w['n']}",
        "rollout.ignore_eos=true",
        f"rollout.compile_decode={str(cuda).lower()}",
        "rollout.log_prob_use_dynamic_bsz=true",
        "rollout.log_prob_max_token_len_per_gpu=32768",
        "ref.log_prob_use_dynamic_bsz=true",
        "ref.log_prob_max_token_len_per_gpu=32768",
        "model.use_remove_padding=true",
        f"actor.ppo_mini_batch_size={w['mini_batch']}",
        "actor.ppo_epochs=1",
        "actor.use_dynamic_bsz=true",
        "actor.ppo_max_token_len_per_gpu=16384",
        "actor.optim.lr=1e-6",
        *w["overrides"],
        *args.overrides,
    ]
    return load_config(None, overrides)


def decode_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bf16 weight bytes one decode step streams, bf16 KV-cache bytes per token in context)."""
    cfg = model.config
    weights = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n) * 2
    if cfg.tie_word_embeddings:  # the tied LM head is read every step (an untied one is counted above)
        weights += cfg.vocab_size * cfg.hidden_size * 2
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return weights, 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2  # K and V


def roofline_decode_s(
    bytes_: tuple[int, int], samples: int, prompt_len: int, new_tokens: int, steps: int
) -> float:
    """Seconds the decode phase would take if it only streamed the weights (once per step) and the KV cache
    in context (once per sequence and step) at HBM speed. The first token of each sample comes from
    prefill, so a sample decodes new_tokens - 1 tokens at contexts prompt_len + 1 ... prompt_len + new - 1."""
    weights, kv_per_token = bytes_
    r = new_tokens - 1
    context_tokens = samples * (r * prompt_len + r * (r + 1) / 2)  # summed over every sequence-step
    return (steps * weights + context_tokens * kv_per_token) / HBM_BYTES_PER_S


def summarize(
    runs: list[dict[str, float]], bytes_: tuple[int, int], w: dict, n_params: int
) -> dict[str, float]:
    """Medians over the timed steps plus the derived figures (MFU, roofline fraction)."""
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if all(k in r for r in runs)}
    tokens = med["perf/total_num_tokens"]
    out = dict(med)
    out["mfu/update_actor"] = 6 * n_params * tokens / med["timing_s/update_actor"] / PEAK_FLOPS
    for stage in ("old_log_prob", "ref"):
        if f"timing_s/{stage}" in med:
            out[f"mfu/{stage}"] = 2 * n_params * tokens / med[f"timing_s/{stage}"] / PEAK_FLOPS
    samples = w["prompts"] * w["n"]
    ideal = roofline_decode_s(
        bytes_, samples, w["prompt_len"], w["new_tokens"], int(med["rollout/decode_steps"])
    )
    out["perf/rollout_decode_roofline_fraction"] = ideal / med["timing_s/gen_decode"]
    return out


def print_table(summary: dict[str, float]) -> None:
    """Rank-0 console output: one metric per line, grouped by prefix."""
    for key in sorted(summary):
        if key.split("/")[0] in (
            "timing_s",
            "perf",
            "mfu",
            "rollout",
            "rollout_corr",
            "moe",
            "memory",
            "actor",
            "training",
        ):
            print(f"{key:45s} {summary[key]:>16,.4f}")


def profile_step(trainer: PPOTrainer, out_dir: Path) -> None:
    """One more step under torch.profiler; writes the stage and kernel tables (device time), prints them, and
    writes the ops by host time (``grpo_step_host.txt``)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    trainer.global_step += 1
    with profile(activities=activities) as prof:
        trainer.step()
    events = prof.key_averages()
    # Total device time puts the dataflow's stage ranges (stage/<name>) on top; self device time is kernels.
    total, self_ = (
        ("cuda_time_total", "self_cuda_time_total") if cuda else ("cpu_time_total", "self_cpu_time_total")
    )
    stages = events.table(sort_by=total, row_limit=25, max_name_column_width=60)
    kernels = events.table(sort_by=self_, row_limit=60, max_name_column_width=100)
    host = events.table(sort_by="cpu_time_total", row_limit=60, max_name_column_width=80)  # launch-bound?
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "grpo_step_stages.txt").write_text(stages)
    (out_dir / "grpo_step_kernels.txt").write_text(kernels)
    (out_dir / "grpo_step_host.txt").write_text(host)
    print(stages)
    print(kernels[:12000])


def run_step(trainer: PPOTrainer, number: int, label: str) -> dict[str, float]:
    """One trainer step; prints its stage times and returns its metrics."""
    trainer.global_step += 1
    metrics = trainer.step()
    stages = "  ".join(
        f"{k.removeprefix('timing_s/')} {v:.3f}" for k, v in metrics.items() if k.startswith("timing_s/")
    )
    slots = f"  kv slots {metrics['rollout/kv_slots']:.0f}" if "rollout/kv_slots" in metrics else ""
    print(f"step {number} ({label}): {metrics['perf/time_per_step']:.3f} s  [{stages}]{slots}", flush=True)
    return metrics


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="W1")
    p.add_argument("--model-size", choices=sorted(SHAPES) + sorted(MOE_SHAPES), default="0.5b")
    p.add_argument(
        "--gpu-memory-gb", type=gpu_memory_gb, help="cap this process's GPU memory at this many GiB (e.g. 80)"
    )
    p.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu"
    )
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--prompts", type=int, help="override the workload's prompts per step")
    p.add_argument("--prompt-len", type=int, help="override the workload's prompt length")
    p.add_argument("--new-tokens", type=int, help="override the workload's response length")
    p.add_argument("--out", type=Path, help="append the summary as one JSON line")
    p.add_argument("--profile-dir", type=Path, help="profile one extra step and write its kernel table here")
    p.add_argument("overrides", nargs="*", help="trainer config overrides, key=value")
    args = p.parse_args()
    for name, least in (("steps", 1), ("warmup", 0), ("prompts", 1), ("prompt_len", 1), ("new_tokens", 2)):
        value = getattr(args, name)
        if value is not None and value < least:
            p.error(f"--{name.replace('_', '-')} must be at least {least}, got {value}")
    logging.basicConfig(level=logging.WARNING)
    cap_gpu_memory(args.gpu_memory_gb)  # before anything is allocated on the GPU
    w = dict(WORKLOADS[args.workload])
    for key in ("prompts", "prompt_len", "new_tokens"):
        if getattr(args, key) is not None:
            w[key] = getattr(args, key)
    w["mini_batch"] = min(w["mini_batch"], w["prompts"])

    total = args.warmup + args.steps + (1 if args.profile_dir else 0)
    cfg = trainer_config(args, w, total)
    if args.model_size in MOE_SHAPES:  # a Qwen3-MoE of Qwen3-30B-A3B's layer shape (or its dense twin)
        model = build_moe_shape(args.model_size, torch.device(args.device))
    else:
        model = build_model(args.model_size, "sdpa", torch.device(args.device))
    vocab = model.config.vocab_size
    model.config.pad_token_id, model.config.eos_token_id = 0, 1
    tokenizer = word_tokenizer(vocab)
    rows = prompt_rows(w["prompts"] * total, w["prompt_len"], vocab)
    train = RLDataset(rows, tokenizer, max_prompt_length=w["prompt_len"], source="benchmark prompts")
    n_params, _ = count_params(model)
    bytes_ = decode_bytes(model)
    trainer = PPOTrainer(cfg, build_components(cfg, model, tokenizer, reward_fn=hash_reward, train=train))
    del model  # the actor trains it in place; the reference made its own copy before the actor took it

    for i in range(args.warmup):
        run_step(trainer, i + 1, "warm-up")
    with ClockSampler() as clocks:  # samples nvidia-smi while the timed steps run
        runs = [run_step(trainer, args.warmup + i + 1, "timed") for i in range(args.steps)]
    summary = summarize(runs, bytes_, w, n_params)
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    if args.gpu_memory_gb is not None:
        gpu += f" capped at {args.gpu_memory_gb:g} GiB"
    print(f"{args.workload} {args.model_size} on {gpu}, torch {torch.__version__}, N = {n_params / 1e9:.3f}B, "
          f"median of {args.steps} steps after {args.warmup} warm-up")  # fmt: skip
    print_table(summary)
    info = clocks.info()
    print(machine_line(info))
    if args.out is not None:
        record = {"workload": args.workload, "model_size": args.model_size, "gpu": gpu, **summary}
        record["machine"] = info
        with args.out.open("a") as f:
            f.write(json.dumps(record) + "\n")
    if args.profile_dir is not None:
        profile_step(trainer, args.profile_dir)
    trainer.c.close()


if __name__ == "__main__":
    main()
