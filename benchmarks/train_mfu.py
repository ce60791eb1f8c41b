"""Training throughput and MFU of the FSDP2 actor engine on a Qwen2.5-shaped model, against plain HF.

One variant per process (each engine starts its own one-rank process group):

    python benchmarks/train_mfu.py --model-size 0.5b --head checkpoint --steps 5   # the old LM head
    python benchmarks/train_mfu.py --mode hf --attn sdpa            # plain HF forward/backward + AdamW

or a suite of variants, each in a subprocess, with one table at the end:

    python benchmarks/train_mfu.py --suite main,levers --out results.jsonl --profile-dir prof/

CPU smoke run: ``--model-size tiny --device cpu --num-seqs 4 --prompt-len 32 --response-len 32``.

A step is one full ``ActorEngine.update_policy`` call: forward + backward over every micro-batch of the
mini-batch, gradient clipping and the AdamW step (or the same tokens through a plain HF loop). Weights are
random. MFU = 6 * N * tokens/s / 790e12, where 790 TFLOP/s is the bf16 GEMM rate measured on the H200 (an
8192^3 product on random data) and N is stated twice: all parameters (embeddings included, the tied LM
head counted once) and the non-embedding parameters. The engine skips the LM head at prompt positions, so
6N over-counts the work it actually does; the table also reports the matmul FLOPs really executed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

try:
    import hybridflow  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shapes import PEAK_FLOPS, SHAPES, build_model, count_params

# Variants of a suite: extra command-line arguments for one subprocess each (shared ones are appended).
SUITES = {
    "main": [
        "--mode engine --rmpad --attn sdpa",
        "--mode engine --no-rmpad --attn sdpa",
        "--mode hf --attn sdpa",
    ],
    # The engine's levers one at a time against the defaults (fused head; at world size 1 deferred gradient
    # sync and kept parameters over the micro-batches); the first row is the engine before them.
    "levers": [
        "--mode engine --rmpad --attn sdpa --head checkpoint --grad-sync-inner --no-keep-params-gathered",
        "--mode engine --rmpad --attn sdpa",
        "--mode engine --rmpad --attn sdpa --head checkpoint",
        "--mode engine --rmpad --attn sdpa --grad-sync-inner --no-keep-params-gathered",
        "--mode engine --rmpad --attn sdpa --no-reshard-after-forward",
        "--mode engine --rmpad --attn sdpa --no-reshard-after-forward --compile-layers",
    ],
    # The defaults at one GPU after the flash varlen op (packed attention inside the compiled layers) and
    # the Triton LM-head kernels.
    "varlen": [
        "--mode engine --rmpad --attn sdpa --no-reshard-after-forward",
        "--mode engine --rmpad --attn sdpa --no-reshard-after-forward --compile-layers",
        "--mode engine --rmpad --attn sdpa --no-reshard-after-forward --compile-layers --ragged --dynamic-bsz",
        "--mode engine --rmpad --attn sdpa --no-reshard-after-forward --compile-layers --model-size 1.5b",
    ],
    "head": [
        "--mode engine --rmpad --attn sdpa --no-reshard-after-forward --compile-layers",
        "--mode engine --rmpad --attn sdpa --no-reshard-after-forward --compile-layers --ragged --dynamic-bsz",
        "--mode engine --rmpad --attn sdpa --no-reshard-after-forward",
    ],
    "extra": [
        "--mode hf --attn sdpa --hf-autocast",
        "--mode engine --rmpad --attn sdpa --grad-ckpt",
        "--mode engine --rmpad --attn sdpa --master-dtype bfloat16",
        "--mode engine --rmpad --attn sdpa --ragged --dynamic-bsz",
    ],
}

log = logging.getLogger("train_mfu")


def executed_matmul_flops(size: str, tokens: int, scored: int, engine: bool, grad_ckpt: bool) -> float:
    """Dense matmul FLOPs one step really runs (attention scores excluded, as in 6N).

    The decoder's linear layers run on every token (2N_layers per token forward, 4N backward; one more
    forward with gradient checkpointing). Our engine applies the tied head only at the ``scored`` response
    positions and recomputes it in backward (chunk checkpointing); plain HF applies it to every token.
    """
    s = SHAPES[size]
    h, layers, inter = s["hidden_size"], s["num_hidden_layers"], s["intermediate_size"]
    kv = h // s["num_attention_heads"] * s["num_key_value_heads"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * inter  # q, o, k, v, gate, up, down
    body = 2 * per_layer * layers * tokens * (4 if grad_ckpt else 3)
    head_params = h * s["vocab_size"]
    head = 2 * head_params * scored * 4 if engine else 2 * head_params * tokens * 3
    return float(body + head)


def make_batch(num_seqs: int, prompt_len: int, response_len: int, vocab: int, ragged: bool, seed: int):
    """A verl-layout batch: left-padded prompts, right-padded responses, random tokens and advantages."""
    from hybridflow.protocol import Batch

    g = torch.Generator().manual_seed(seed)
    T = prompt_len + response_len
    ids = torch.randint(0, vocab, (num_seqs, T), generator=g)  # (B, T)
    if ragged:  # lengths like a real rollout: prompts 1/2..1 of the budget, responses 1/4..1
        pad = torch.randint(0, prompt_len // 2 + 1, (num_seqs,), generator=g)
        resp = torch.randint(max(1, response_len // 4), response_len + 1, (num_seqs,), generator=g)
    else:
        pad = torch.zeros(num_seqs, dtype=torch.long)
        resp = torch.full((num_seqs,), response_len)
    cols = torch.arange(T)[None]  # (1, T)
    mask = ((cols >= pad[:, None]) & (cols < prompt_len + resp[:, None])).long()  # (B, T)
    ids = ids * mask
    response_mask = mask[:, -response_len:].float()  # (B, R)
    return Batch(
        {
            "input_ids": ids,
            "attention_mask": mask,
            "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, -response_len:],
            "response_mask": response_mask,
            "advantages": torch.randn(num_seqs, response_len, generator=g) * response_mask,
            "old_log_probs": torch.zeros(num_seqs, response_len),
        }
    )


def engine_step_fn(args: argparse.Namespace, model: torch.nn.Module, batch) -> Callable[[], None]:
    """Wrap the model in our FSDP2 ActorEngine; the step is one ``update_policy`` call."""
    from hybridflow.config.schema import ActorConfig
    from hybridflow.engine.roles.actor import ActorEngine

    cfg = ActorConfig()
    cfg.ppo_mini_batch_size = len(batch)  # one optimizer step per update_policy call
    cfg.ppo_micro_batch_size_per_gpu = args.micro_batch
    cfg.use_dynamic_bsz = args.dynamic_bsz
    cfg.ppo_max_token_len_per_gpu = args.max_token_len
    cfg.optim.lr = 1e-6
    cfg.fsdp.reshard_after_forward = args.reshard_after_forward
    cfg.fsdp.master_dtype = args.master_dtype
    cfg.use_torch_compile = args.compile_layers  # the engine compiles each decoder layer (default: on GPU)
    engine = ActorEngine(
        model,
        cfg,
        rollout_n=1,
        use_remove_padding=args.rmpad,
        gradient_checkpointing=args.grad_ckpt,
        total_steps=args.warmup + args.steps + 2,
        fused_head=args.head == "fused",
        defer_grad_sync=None if args.grad_sync_inner is None else not args.grad_sync_inner,
        keep_params_gathered=args.keep_params_gathered,
    )
    log.info("engine compute dtype %s", engine.engine.compute_dtype)
    return lambda: engine.update_policy(batch)


def hf_step_fn(args: argparse.Namespace, model: torch.nn.Module, batch) -> Callable[[], None]:
    """Plain HF: the same micro-batches through ``model(input_ids, labels)``, backward, then AdamW."""
    device = next(model.parameters()).device
    if not args.hf_autocast:
        model.to(torch.bfloat16)  # the common "just train in bf16" baseline: bf16 weights and Adam state
    if args.grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    micro = []
    for start in range(0, len(batch), args.micro_batch):
        mb = batch[list(range(start, min(start + args.micro_batch, len(batch))))].to(device)
        mask = mb["attention_mask"]  # (b, T)
        labels = mb["input_ids"].masked_fill(mask == 0, -100)  # (b, T)
        micro.append((mb["input_ids"], None if bool(mask.all()) else mask, labels))

    def step() -> None:
        for ids, mask, labels in micro:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.hf_autocast):
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def synchronize(device: torch.device) -> None:
    """Wait for queued device work (host timers are only meaningful after this)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(step: Callable[[], None], device: torch.device, warmup: int, steps: int) -> list[float]:
    """Wall-clock seconds of each timed step, after ``warmup`` untimed ones (compilation, Adam state)."""
    for _ in range(warmup):
        step()
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter()
        step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


KERNEL_GROUPS = (  # first match wins; names of cuBLAS/cuDNN/flash/Triton kernels on Hopper
    ("attention", ("flash", "fmha", "attention", "attn", "flex", "triton_tem", "cudnn")),
    ("gemm", ("gemm", "nvjet", "xmma", "cutlass", "sm90", "cublas", "splitk")),
    ("optimizer", ("multi_tensor", "adam", "foreach")),
    ("reduction/softmax", ("reduce", "softmax", "logsumexp", "norm", "triton_red", "triton_per")),
    ("copy/cast/comm", ("copy", "memcpy", "memset", "nccl", "cat", "chunk", "split", "fill")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "triton_poi", "index")),
)


def kernel_group(name: str) -> str:
    """Coarse class of a CUDA kernel by its name."""
    lower = name.lower()
    for group, keys in KERNEL_GROUPS:
        if any(k in lower for k in keys):
            return group
    return "other"


def profile_step(step: Callable[[], None], device: torch.device, rows: int) -> str:
    """Profile one step; return a text report: time by kernel group, then the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    synchronize(device)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        synchronize(device)
    wall_us = (time.perf_counter() - start) * 1e6
    per_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        # GPU-side user annotations (FSDP::*, Optimizer.step#...) span kernels: they are not kernels.
        if event.device_type == torch.autograd.DeviceType.CUDA and not getattr(
            event, "is_user_annotation", False
        ):
            entry = per_kernel[event.name]
            entry[0] += event.time_range.elapsed_us()
            entry[1] += 1
    busy = sum(t for t, _ in per_kernel.values())
    groups: dict[str, float] = defaultdict(float)
    for name, (t, _) in per_kernel.items():
        groups[kernel_group(name)] += t
    lines = [f"profiled step: wall {wall_us / 1e3:.1f} ms (with profiler), kernels busy {busy / 1e3:.1f} ms"]
    for group, t in sorted(groups.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {group:<20} {t / 1e3:9.1f} ms  {100 * t / max(busy, 1):5.1f}%")
    lines.append(f"top {rows} kernels (total ms, calls, share, group):")
    for name, (t, n) in sorted(per_kernel.items(), key=lambda kv: -kv[1][0])[:rows]:
        share = 100 * t / max(busy, 1)
        lines.append(f"  {t / 1e3:8.2f} {n:6d} {share:5.1f}%  {kernel_group(name):<18} {name[:110]}")
    return "\n".join(lines)


def variant_name(args: argparse.Namespace) -> str:
    """A short label of what this run measures."""
    parts = [args.mode, args.model_size, args.attn]
    if args.mode == "engine":
        parts.append("rmpad" if args.rmpad else "padded")
        parts += ["dynbsz"] * args.dynamic_bsz + ["ckpt-head"] * (args.head == "checkpoint")
        parts += [{True: "sync-inner", False: "defer-sync"}.get(args.grad_sync_inner, "")]
        parts += [{True: "keep-params", False: "reshard-bwd"}.get(args.keep_params_gathered, "")]
        parts += ["no-reshard"] * (not args.reshard_after_forward) + ["compile"] * args.compile_layers
        parts += [f"master-{args.master_dtype}"] * (args.master_dtype != "float32")
    else:
        parts.append("autocast-fp32-master" if args.hf_autocast else "bf16-weights")
    parts += ["grad-ckpt"] * args.grad_ckpt + ["ragged"] * args.ragged
    return " ".join(p for p in parts if p)


def run_variant(args: argparse.Namespace) -> dict:
    """Build, warm up, time and (optionally) profile one variant; return its result row."""
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else 0)
        torch.cuda.set_device(device)
    model = build_model(args.model_size, args.attn, device)
    n_all, n_nonemb = count_params(model)
    shape = SHAPES[args.model_size]
    batch = make_batch(
        args.num_seqs, args.prompt_len, args.response_len, shape["vocab_size"], args.ragged, args.seed
    )
    tokens = int(batch["attention_mask"].sum())
    scored = int(batch["response_mask"].sum())
    make_step = engine_step_fn if args.mode == "engine" else hf_step_fn
    step = make_step(args, model, batch)
    times = time_steps(step, device, args.warmup, args.steps)
    median = statistics.median(times)
    tok_s = tokens / median
    flops = executed_matmul_flops(args.model_size, tokens, scored, args.mode == "engine", args.grad_ckpt)
    row = {
        "variant": variant_name(args),
        "tokens_per_step": tokens,
        "micro_batch": f"{args.max_token_len} tok" if args.dynamic_bsz else f"{args.micro_batch} seq",
        "step_s_median": median,
        "step_s_min": min(times),
        "step_s_max": max(times),
        "tokens_per_s": tok_s,
        "n_params": n_all,
        "n_params_nonemb": n_nonemb,
        "mfu_6n_all": 6 * n_all * tok_s / PEAK_FLOPS,
        "mfu_6n_nonemb": 6 * n_nonemb * tok_s / PEAK_FLOPS,
        "executed_matmul_tflops_per_s": flops / median / 1e12,
        "peak_alloc_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0,
        "peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30 if device.type == "cuda" else 0.0,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
    }
    if args.profile_dir:
        report = profile_step(step, device, args.profile_rows)
        Path(args.profile_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(args.profile_dir) / "profiles.txt", "a") as f:
            f.write(f"=== {row['variant']} ===\n{report}\n\n")
        print(report, flush=True)
    return row


def format_table(rows: list[dict]) -> str:
    """The results as a fixed-width text table (one row per variant)."""
    head = (
        f"{'variant':<58} {'tok/step':>8} {'micro':>9} {'step s':>7} {'tok/s':>9} "
        f"{'MFU 6N':>7} {'MFU 6N-ne':>9} {'exec TF/s':>9} {'peak GiB':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['variant']:<58} FAILED: {r['error'][:80]}")
            continue
        lines.append(
            f"{r['variant']:<58} {r['tokens_per_step']:>8} {r['micro_batch']:>9} {r['step_s_median']:>7.3f} "
            f"{r['tokens_per_s']:>9.0f} {100 * r['mfu_6n_all']:>6.1f}% {100 * r['mfu_6n_nonemb']:>8.1f}% "
            f"{r['executed_matmul_tflops_per_s']:>9.0f} {r['peak_alloc_gib']:>8.1f}"
        )
    if rows and "n_params" in rows[0]:
        r = rows[0]
        lines.append(
            f"N = {r['n_params'] / 1e6:.1f}M parameters (embeddings incl., tied head once); "
            f"non-embedding N = {r['n_params_nonemb'] / 1e6:.1f}M; MFU = 6 N tok/s / {PEAK_FLOPS / 1e12:.0f}e12"
        )
    return "\n".join(lines)


def measure_gemm_peak(device: torch.device, n: int = 8192, reps: int = 10) -> float:
    """bf16 TFLOP/s of an n^3 matmul on random data (the ceiling MFU is quoted against)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    end.synchronize()
    return 2 * n**3 * reps / (start.elapsed_time(end) / 1e3) / 1e12


def run_suite(args: argparse.Namespace, forwarded: list[str]) -> list[dict]:
    """Run every variant of the named suites in its own subprocess and collect the rows."""
    out = Path(args.out or "train_mfu_results.jsonl")
    rows = []
    for suite in args.suite.split(","):
        for extra in SUITES[suite]:
            cmd = [sys.executable, __file__, *forwarded, *extra.split(), "--out", str(out)]
            print(f"\n>>> {' '.join(cmd[2:])}", flush=True)
            before = out.read_text().count("\n") if out.exists() else 0
            try:
                proc = subprocess.run(cmd, timeout=args.variant_timeout)
                status = f"exit {proc.returncode}"
            except subprocess.TimeoutExpired:
                status = f"timeout after {args.variant_timeout}s"
            lines = out.read_text().splitlines() if out.exists() else []
            if len(lines) > before:
                rows.append(json.loads(lines[-1]))
            else:
                rows.append({"variant": extra, "error": status})
            print("\n" + format_table(rows), flush=True)  # so far: an outer timeout still leaves a table
    return rows


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """Command-line options; also returns the options a suite forwards to its variants."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-size", default="0.5b", choices=sorted(SHAPES))
    p.add_argument("--mode", default="engine", choices=("engine", "hf"))
    p.add_argument("--attn", default="sdpa", choices=("sdpa", "flex_attention", "eager"))
    p.add_argument("--rmpad", action=argparse.BooleanOptionalAction, default=True, help="remove padding")
    p.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing")
    p.add_argument("--num-seqs", type=int, default=64, help="sequences per step (one mini-batch)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--response-len", type=int, default=512)
    p.add_argument("--ragged", action="store_true", help="random prompt/response lengths instead of full")
    p.add_argument("--micro-batch", type=int, default=16, help="sequences per forward/backward")
    p.add_argument("--dynamic-bsz", action="store_true", help="micro-batches by --max-token-len tokens")
    p.add_argument("--max-token-len", type=int, default=16384)
    p.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--master-dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--head", default="fused", choices=("fused", "checkpoint"), help="LM-head log-prob path")
    p.add_argument(
        "--grad-sync-inner",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="reduce-scatter gradients after every micro-batch (default: engine's choice, deferred at 1 GPU)",
    )
    p.add_argument(
        "--keep-params-gathered",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep gathered params between micro-batches (default: engine's choice, on at 1 GPU)",
    )
    p.add_argument("--compile-layers", action="store_true", help="torch.compile each decoder layer")
    p.add_argument("--hf-autocast", action="store_true", help="hf mode: fp32 weights + bf16 autocast")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--profile-dir", default=None, help="profile one extra step; append the report here")
    p.add_argument("--profile-rows", type=int, default=25)
    p.add_argument("--out", default=None, help="append the result row (JSON) to this file")
    p.add_argument("--suite", default=None, help=f"comma-separated suites of variants: {', '.join(SUITES)}")
    p.add_argument("--variant-timeout", type=float, default=300.0, help="seconds per suite variant")
    p.add_argument("--measure-peak", action="store_true", help="time an 8192^3 bf16 matmul first")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    forwarded = []  # everything but the suite's own options
    skip_next = False
    for a in argv:
        if skip_next:
            skip_next = False
            continue
        if a in ("--suite", "--out", "--variant-timeout"):
            skip_next = True
            continue
        if a.split("=")[0] in ("--suite", "--out", "--variant-timeout", "--measure-peak"):
            continue
        forwarded.append(a)
    return args, forwarded


def main() -> None:
    """Entry point: one variant, or a suite of variants in subprocesses."""
    args, forwarded = parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.measure_peak and torch.cuda.is_available():
        print(f"bf16 8192^3 matmul: {measure_gemm_peak(torch.device('cuda')):.0f} TFLOP/s", flush=True)
    if args.suite:
        run_suite(args, forwarded)  # prints the table after every variant
        return
    try:
        row = run_variant(args)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    if args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")
    print("\n" + format_table([row]), flush=True)


if __name__ == "__main__":
    main()
