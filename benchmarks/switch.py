"""The hybrid engine's switch between training and generation, against the baseline (GPU; not a test).

    python benchmarks/switch.py --model-size 0.5b 1.5b          # one GPU: time and memory, then the plan table
    python benchmarks/switch.py --model-size 7b --gpu-memory-gb 80      # Qwen2-7B within an 80 GiB share
    python benchmarks/switch.py --plan-only --model-size 0.5b 1.5b 7b   # the plan table alone (any machine)

The shapes are ``shapes.SHAPES`` (7b: Qwen2-7B, untied embeddings). ``--gpu-memory-gb`` caps the memory
this process may allocate on the GPU (``torch.cuda.set_per_process_memory_fraction``, before anything is
allocated), so a smaller GPU is measured on a bigger one.

On one GPU (world size 1, tp = 1) the actor is built as the trainer builds it (FSDP2, float32 masters, bf16
compute and rollout) and each switch runs ``--warmup`` times untimed, then ``--steps`` times (medians):
  hybrid: train -> generate is the rollout runner's ``refresh()`` (the bf16 cast buffers allocated again and
          filled from the masters in place), generate -> train its ``release()``;
  baseline (``actor.hybrid_engine=false``): a whole bf16 copy kept for good, refreshed by gathering the full
          state dict (on the host) and copying it over, as a rank-0 broadcast does at world size 1.
It reports milliseconds, milliseconds per GB of bf16 weights, the memory the copy holds between phases, and
the peak allocated during the switch above what training holds (a second copy of the weights would show
here). The plan table gives, for W in {2, 4, 8} and tp in {1, 2, 4, 8}, the bytes a rank receives at every
switch, from the reshard plan of the model's own shapes (row-parallel weights FSDP2-sharded on dim 1 where
the ranks divide it), and the generation weights it holds, against a whole copy; the multi-GPU timing
belongs to the multi-GPU issue. A last line names the machine as the timed switches ran on it.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

try:
    import hybridflow  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_clocks import ClockSampler, cap_gpu_memory, gpu_memory_gb, machine_line
from shapes import SHAPES, model_config

from hybridflow.engine.hybrid.plan import ParamSpec, ReshardPlan
from hybridflow.engine.parallel.layout import ShardLayout, check_tp, kind_of
from hybridflow.engine.parallel.view import GenerateView

GB = 1e9
PLAN_SHAPES = SHAPES  # (the name views.py imports)


def meta_model(size: str) -> torch.nn.Module:
    """A Qwen2ForCausalLM of the shape on the meta device (shapes only)."""
    from transformers import Qwen2ForCausalLM

    config = model_config(size)
    with torch.device("meta"):
        return Qwen2ForCausalLM(config)


def plan_rows(size: str) -> list[str]:
    """The plan table of one model shape: per (W, tp), the largest per-rank receive and the buffers held."""
    model = meta_model(size)
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    rows = []
    for world in (2, 4, 8):
        for tp in (1, 2, 4, 8):
            if tp > world:
                continue
            try:
                check_tp(model.config, tp)
            except ValueError as e:  # heads or MLP rows that tp does not split
                rows.append(
                    f"| {size} | {world} | {tp} | - | - | - | {str(e).split(': ')[1].split(';')[0]} |"
                )
                continue
            specs = []
            for name, p in model.named_parameters():
                kind = kind_of(name)
                dim = 1 if tp > 1 and kind == "row" and p.shape[1] % world == 0 else 0
                specs.append(
                    ParamSpec(name, tuple(p.shape), dim, ShardLayout(kind, tuple(p.shape), tp, head_dim))
                )
            plan = ReshardPlan(specs, GenerateView(world, tp), elem_size=2, bucket_bytes=512 * 2**20)
            received = max(plan.bytes_received(r) for r in range(world))
            rows.append(
                f"| {size} | {world} | {tp} | {received / GB:.3f} | {plan.generation_bytes() / GB:.3f} | "
                f"{plan.full_bytes() / GB:.3f} | {received / plan.full_bytes():.2f} of a copy |"
            )
    return rows


def build_actor(size: str, hybrid: bool):
    """The actor as the trainer builds it at world size 1 (FSDP2, float32 masters, bf16 rollout)."""
    from shapes import build_model

    from hybridflow.config import load_config
    from hybridflow.workers.actor import ActorWorker

    cfg = load_config(None, ["data.max_response_length=16", f"actor.hybrid_engine={str(hybrid).lower()}"])
    model = build_model(size, "sdpa", torch.device("cuda"))
    return ActorWorker(model, cfg, total_steps=1, pad_token_id=0)


def _mark() -> tuple[float, int]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return time.perf_counter(), torch.cuda.memory_allocated()


def hybrid_switch(runner, steps: int, warmup: int) -> tuple[float, float, int]:
    """(train -> generate s, generate -> train s, peak bytes above training) of the runner's cast buffers."""
    ups, downs, peaks = [], [], []
    runner.release()
    for i in range(warmup + steps):
        start, before = _mark()
        runner.refresh()  # allocate the released buffers again, cast the masters into them
        torch.cuda.synchronize()
        up, peak = time.perf_counter() - start, torch.cuda.max_memory_allocated() - before
        start, _ = _mark()
        runner.release()
        torch.cuda.synchronize()
        if i >= warmup:
            ups.append(up)
            downs.append(time.perf_counter() - start)
            peaks.append(peak)
    return statistics.median(ups), statistics.median(downs), max(peaks)


def baseline_switch(replica, sharded, steps: int, warmup: int) -> tuple[float, int]:
    """(train -> generate s, peak bytes above training) of the baseline's state-dict refresh."""
    times, peaks = [], []
    for i in range(warmup + steps):
        start, before = _mark()
        replica.sync(sharded)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
            peaks.append(torch.cuda.max_memory_allocated() - before)
    return statistics.median(times), max(peaks)


def switch_rows(size: str, steps: int, warmup: int) -> list[str]:
    """Hybrid and baseline switches of one model shape on this GPU."""
    rows = []
    for hybrid in (True, False):
        worker = build_actor(size, hybrid)
        weights = sum(p.numel() for p in worker.hf_model.parameters()) * 2  # bf16 bytes, tied counted once
        if hybrid:
            up, down, peak = hybrid_switch(worker.hybrid.rollout.runner, steps, warmup)
            kept, name = 0, "hybrid (tp=1, cast in place)"
        else:
            (up, peak), down = baseline_switch(worker.hybrid.weights, worker.hf_model, steps, warmup), 0.0
            kept, name = weights, "baseline (kept copy, state-dict refresh)"
        rows.append(
            f"| {size} | {name} | {up * 1e3:.2f} | {up * 1e3 / (weights / GB):.2f} | {down * 1e3:.2f} | "
            f"{kept / GB:.2f} | {peak / GB:.2f} | {weights / GB:.2f} |"
        )
        del worker
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-size", nargs="+", default=["0.5b", "1.5b"], choices=sorted(PLAN_SHAPES))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--plan-only", action="store_true", help="the plan table alone (no GPU needed)")
    p.add_argument(
        "--gpu-memory-gb", type=gpu_memory_gb, help="cap this process's GPU memory at this many GiB (e.g. 80)"
    )
    args = p.parse_args()
    if args.plan_only and args.gpu_memory_gb is not None:
        p.error("--gpu-memory-gb caps the GPU the timing runs on; --plan-only runs nothing on a GPU")
    if not args.plan_only:
        if not torch.cuda.is_available():
            sys.exit("error: the switch timing needs a GPU; --plan-only prints the plan table anywhere")
        cap_gpu_memory(args.gpu_memory_gb)  # before anything is allocated on the GPU
        print(
            "| model | switch | train->gen ms | ms per GB | gen->train ms | copy kept GB | peak above training GB | weights GB |"
        )
        print("|---|---|---|---|---|---|---|---|")
        with ClockSampler() as clocks:
            for size in args.model_size:
                if size in SHAPES and size != "tiny":
                    print("\n".join(switch_rows(size, args.steps, args.warmup)), flush=True)
        print(machine_line(clocks.info()))
    print(
        "\n| model | W | tp | received per rank GB | generation weights per rank GB | whole copy GB | received |"
    )
    print("|---|---|---|---|---|---|---|")
    for size in args.model_size:
        print("\n".join(plan_rows(size)))


if __name__ == "__main__":
    main()
