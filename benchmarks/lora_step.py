"""GRPO with LoRA against full fine-tuning through ``hybridflow train``: peak memory by phase and step time
(GPU; not a test). Issue 46's figures: the 7B shape with LoRA rank 64 on every linear under a 24 GB cap,
and the 1.5B shape with and without LoRA.

    python benchmarks/lora_step.py --work /tmp/lora --out $OUT
    python benchmarks/lora_step.py --work /tmp/lora --out $OUT --cases 7b-lora64-24gb

Each case is ``benchmarks/big_model.py``'s run (a random Qwen2 model of the shape saved once under
``--work/<shape>``, the prompts, a hashed reward, ``hybridflow train`` in a child process with the layout
planned, the phases' peaks from the workers' memory metrics against the plan's estimates); the cases differ
in their overrides only. The reference pass (the KL loss is on) is the actor's base with its adapters off:
no reference copy. A table of the cases to stdout, ``lora_step.json`` (every case's summary) to ``--out``.

CPU smoke run: ``--tiny`` (the tiny shape, two steps of 2 prompts x 4 samples, every case on the CPU).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from big_model import prepare, summarize, the_plan, train  # also puts hybridflow on the path

LORA64 = ["model.lora_rank=64", "model.lora_alpha=128", "model.target_modules=all-linear"]
# name -> (shape, GPU cap in GB or None, overrides)
CASES: dict[str, tuple[str, float | None, list[str]]] = {
    # one rank: the merge written into the base's own storage (no merge buffers), checkpointing on
    "7b-lora64-24gb": (
        "7b",
        24.0,
        [
            *LORA64,
            "rollout.lora_merge=in_place",
            "model.enable_gradient_checkpointing=true",
            "rollout.gpu_memory_utilization=0.9",  # of the 24 GB cap: the KV cache beside a 15 GB base
        ],
    ),
    "1.5b-full": ("1.5b", None, []),
    "1.5b-lora64": ("1.5b", None, LORA64),  # merge buffers (the default)
    "1.5b-lora64-in-place": ("1.5b", None, [*LORA64, "rollout.lora_merge=in_place"]),
}
TINY = {
    name: ("tiny", None, [o for o in extra if "checkpointing" not in o])
    for name, (_, _, extra) in CASES.items()
}


def run_case(name: str, args: argparse.Namespace) -> dict:
    """One case through ``hybridflow train``: its summary (steps, medians, phases against the plan)."""
    shape, cap, extra = (TINY if args.tiny else CASES)[name]
    work = args.work / shape
    run = argparse.Namespace(
        model_size=shape,
        layers=None,
        device="cpu" if args.tiny else "cuda",
        prompts=args.prompts,
        n=args.n,
        prompt_len=args.prompt_len,
        new_tokens=args.new_tokens,
        steps=args.steps,
    )
    config = prepare(run, work)
    overrides = [*extra, *args.overrides]
    if cap is not None and not args.tiny:
        overrides.append(f"trainer.gpu_memory_gb={cap:g}")
    shutil.rmtree(work / "run", ignore_errors=True)
    wall, *host = train(config, overrides, args.out / f"lora_step_{name}.log")
    metrics = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    shutil.rmtree(work / "run" / "final_model", ignore_errors=True)  # a merged 7B export is 15 GB
    summary = summarize(metrics, the_plan(config, overrides), wall, tuple(host))
    summary["run"] = {"case": name, "shape": shape, "gpu_memory_gb": cap, "overrides": overrides}
    return summary


def print_table(results: dict[str, dict]) -> None:
    """One row per case: the step time and stage medians, each phase's peak (and the plan's)."""
    print(
        "\n| case | step s | gen s | ref s | update s | generate GB | log_prob GB | update GB | plan peak GB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, s in results.items():
        med, ph = s["median"], s["phases"]
        gb = [f"{ph.get(p, {}).get('measured_gb', 0):.1f}" for p in ("generate", "log_prob", "update_actor")]
        plan = max((v["plan_gb"] or 0 for v in ph.values()), default=0)
        times = [med.get(k, float("nan")) for k in ("perf/time_per_step", "timing_s/gen", "timing_s/ref")]
        times.append(med.get("timing_s/update_actor", float("nan")))
        print(f"| {name} | " + " | ".join(f"{t:.2f}" for t in times) + f" | {' | '.join(gb)} | {plan:.1f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", type=Path, required=True, help="models, data and runs (models are reused)")
    p.add_argument("--out", type=Path, help="logs and lora_step.json (default: --work)")
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    p.add_argument(
        "--tiny", action="store_true", help="CPU smoke run: the tiny shape, 2 x 4 samples, 2 steps"
    )
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("overrides", nargs="*", help="more config overrides for every case, key=value")
    args = p.parse_args()
    if args.tiny:
        args.prompts, args.n, args.prompt_len, args.new_tokens, args.steps = 2, 4, 12, 6, 2
    logging.basicConfig(level=logging.WARNING)
    args.out = args.out or args.work
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    failed = {}
    for name in args.cases:
        try:
            results[name] = run_case(name, args)
        except SystemExit as exc:  # the run failed (e.g. out of memory: its one error line is in the log)
            failed[name] = str(exc)
            print(f"\n## {name}: FAILED\n{exc}")
            continue
        print(f"\n## {name}: {results[name]['plan']}")
        print(json.dumps(results[name]["median"], indent=1))
    print_table(results)
    for name, why in failed.items():
        print(f"| {name} | failed: {why.splitlines()[-1] if why else '?'} |")
    results.update({name: {"failed": why} for name, why in failed.items()})
    (args.out / "lora_step.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
