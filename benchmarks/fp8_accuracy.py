"""The built-in task trained with bf16 rollout and with FP8 rollout, same seed and steps (issue 45's accuracy check).

    python benchmarks/fp8_accuracy.py --out-dir $OUT/fp8_acc [--kernels w8a16 scaled_mm] [key=value ...]

Runs ``hybridflow train``'s demo (the tiny model's SFT warm-up, then GRPO on held-out-scored arithmetic) once per
rollout precision: bf16, then FP8 projections with each kernel (forced: on a tiny model the probe keeps bf16).
Everything but the rollout precision is the same (seed, data, steps); the SFT warm-up is recomputed each time
from the same seed. Prints one JSON line per run: held-out greedy accuracy after SFT and after GRPO, the
mean over the steps of the rollout-vs-trainer mismatch (``rollout_corr/kl``, ``log_prob_abs_diff_mean``)
and of the mean reward, and the wall time. Extra ``key=value`` arguments go to every run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from hybridflow.demos.text import run_demo
from hybridflow.engine.ops.fp8 import FP8_KERNELS
from hybridflow.trainer.plotting import read_metrics
from hybridflow.trainer.tracking import METRICS_FILE

MISMATCH = ("rollout_corr/kl", "rollout_corr/log_prob_abs_diff_mean", "critic/score/mean")


def one_run(name: str, extra: list[str], out_dir: Path, device: str) -> dict:
    overrides = [f"trainer.default_local_dir={out_dir / name}", f"trainer.device={device}", *extra]
    start = time.perf_counter()
    result = run_demo(overrides)
    records = read_metrics(Path(result["run_dir"]) / METRICS_FILE)
    row = {
        "rollout": name,
        "accuracy_after_sft": result["before"],
        "accuracy_after_grpo": result["after"],
        "num_val": result["num_val"],
        "wall_s": time.perf_counter() - start,
    }
    for key in MISMATCH:
        values = [r[key] for r in records if key in r]
        row[key] = statistics.mean(values) if values else None
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--kernels", nargs="+", default=["w8a16"], choices=FP8_KERNELS)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("overrides", nargs="*", help="trainer config overrides for every run, key=value")
    args = ap.parse_args()
    runs = [("bf16", [])] + [
        (
            f"fp8_{k}",
            [
                "rollout.quantization=fp8",
                "rollout.quantization_force=true",
                f"rollout.quantization_kernel={k}",
            ],
        )
        for k in args.kernels
    ]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name, extra in runs:
        row = one_run(name, [*args.overrides, *extra], args.out_dir, args.device)
        print(json.dumps(row), flush=True)
        with (args.out_dir / "fp8_accuracy.jsonl").open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
