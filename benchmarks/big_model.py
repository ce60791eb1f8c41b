"""GRPO on a big model through ``hybridflow train`` as a user runs it, the layout planned (GPU; not a test).

    python benchmarks/big_model.py --model-size 7b --work /tmp/big --out $OUT
    python benchmarks/big_model.py --model-size 7b --work /tmp/big --out $OUT --gpu-memory-gb 80

What it does, in order:
1. ``--work``/model: a randomly initialised Qwen2 model of the shape (``shapes.SHAPES``; 7b is Qwen2-7B)
   saved as a Hugging Face directory in bf16 with a word-level tokenizer covering its vocabulary (made once
   in a child process, reused while its shape marker matches); the prompts (``--prompts x --steps`` rows of
   ``--prompt-len`` random words, train.jsonl), a reward function (a hash of the response, so that GRPO's
   groups differ) and a config that sets the workload only (GRPO, ``--n`` samples, the lengths, the KL loss
   and no layout key: the planner chooses those).
2. ``hybridflow train CONFIG [trainer.gpu_memory_gb=N]`` in a child process, its log in ``--out``; the host
   memory in use (MemTotal - MemAvailable) is sampled every 0.5 s meanwhile.
3. From the run's metrics.jsonl: each step's stage times (``timing_s/*``), the median of the steps after the
   first (which compiles and captures), each phase's peak GPU memory (the highest over the steps) against the
   plan's estimate for that phase (the plan is computed again here, after the run, exactly as the run did),
   and the host memory's peak against the plan's host estimate. A table to stdout, JSON to ``--out``.

CPU smoke run: ``--model-size tiny --device cpu --prompts 2 --n 2 --prompt-len 12 --new-tokens 6 --steps 2``.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

try:
    import hybridflow  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from grpo_step import prompt_rows, word_tokenizer
from plan_check import PHASES
from shapes import SHAPES, model_config

GIB = 2**30
REWARD = '''"""The benchmark's reward: a deterministic hash of the response in [0, 1), so GRPO's groups differ."""
import zlib


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return (zlib.crc32(solution_str.encode()) % 1000) / 1000
'''


def workload_keys(args: argparse.Namespace, work: Path) -> dict:
    """The config: the workload and the files, no layout key (the planner sets those)."""
    return {
        "model": {"path": str(work / "model")},
        "data": {
            "train_files": [str(work / "train.jsonl")],
            "train_batch_size": args.prompts,
            "max_prompt_length": args.prompt_len,
            "max_response_length": args.new_tokens,
        },
        "algorithm": {"adv_estimator": "grpo"},
        "actor": {"ppo_mini_batch_size": args.prompts,  # one optimizer step per GRPO step
                  "use_kl_loss": True, "kl_loss_type": "low_var_kl", "kl_loss_coef": 0.001,
                  "optim": {"lr": 1e-6}},
        "rollout": {"n": args.n, "ignore_eos": True},  # fixed lengths: every step the same work
        "reward": {"custom_function": {"path": str(work / "reward.py")}},
        "trainer": {"device": args.device, "total_training_steps": args.steps, "logger": ["console"],
                    "default_local_dir": str(work / "run"), "val_before_train": False,
                    "save_freq": 0},  # no checkpoint: a 7B one with the CPU step is 91 GB (the disk is 64)
    }  # fmt: skip


def make_model(size: str, layers: int | None, device: str, out: Path) -> None:
    """A random Qwen2 model of ``size`` (``layers`` decoder layers, None: the shape's) in bf16 with a covering
    tokenizer, saved to ``out`` (child process)."""
    import torch
    from transformers import Qwen2ForCausalLM

    config = model_config(size)
    if layers is not None:
        config.layer_types = [config.layer_types[0]] * layers  # the shape's own kind (full attention)
        config.num_hidden_layers = layers
    config.pad_token_id, config.eos_token_id, config.bos_token_id = 0, 1, None
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU: on the host a 7B init takes minutes
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, 1
    model.save_pretrained(out)
    word_tokenizer(config.vocab_size).save_pretrained(out)


def prepare(args: argparse.Namespace, work: Path) -> Path:
    """The model directory (reused when its shape matches), the prompts, the reward and the config file."""
    import yaml

    work.mkdir(parents=True, exist_ok=True)
    model_dir, marker = work / "model", work / "model" / "shape.json"
    shape = json.dumps({**SHAPES[args.model_size], "layers": args.layers}, sort_keys=True)
    if not (marker.exists() and marker.read_text() == shape):
        started = time.perf_counter()
        child = [sys.executable, __file__, "--make-model", args.model_size, "--device", args.device]
        child += [] if args.layers is None else ["--layers", str(args.layers)]
        subprocess.run([*child, "--work", str(work)], check=True)  # its CUDA memory ends with it
        marker.write_text(shape)
        print(f"model: {args.model_size} saved to {model_dir} in {time.perf_counter() - started:.0f} s")
    vocab = model_config(args.model_size).vocab_size
    rows = prompt_rows(args.prompts * args.steps, args.prompt_len, vocab)
    (work / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (work / "reward.py").write_text(REWARD)
    config = work / "config.yaml"
    config.write_text(yaml.safe_dump(workload_keys(args, work), sort_keys=False))
    return config


class HostMemory(threading.Thread):
    """Samples the host memory in use (MemTotal - MemAvailable) while the run goes on; ``peak`` in bytes."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = self.start_bytes = used_host_bytes()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            self.peak = max(self.peak, used_host_bytes())


def used_host_bytes() -> int:
    """MemTotal - MemAvailable of /proc/meminfo (0 where there is none)."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    except OSError:
        return 0
    kib = {k: int(v.split()[0]) for k, v in fields.items() if k in ("MemTotal", "MemAvailable")}
    return (kib["MemTotal"] - kib["MemAvailable"]) * 1024


def train(config: Path, overrides: list[str], log: Path) -> tuple[float, int, int]:
    """``hybridflow train`` in a child process: (wall seconds, host bytes before, host peak bytes)."""
    cmd = [sys.executable, "-m", "hybridflow.cli.main", "train", str(config), *overrides]
    print("$ " + " ".join(cmd[1:]), flush=True)
    sampler = HostMemory()
    sampler.start()
    started = time.perf_counter()
    with log.open("w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - started
    sampler.done.set()
    sampler.join()
    if done.returncode != 0:
        sys.exit(f"hybridflow train failed (exit {done.returncode}); the last lines of {log}:\n"
                 + "\n".join(log.read_text().splitlines()[-30:]))  # fmt: skip
    return wall, sampler.start_bytes, sampler.peak


def the_plan(config: Path, overrides: list[str]):
    """The layout the run planned, computed again as ``hybridflow train`` (``train_cmd.planned_config``) did."""
    from hybridflow.config import load_config
    from hybridflow.config.loader import _read_yaml
    from hybridflow.config.user_keys import user_keys
    from hybridflow.plan.auto_layout import plan_run

    cfg = load_config(str(config), overrides)
    return plan_run(cfg, user_keys(_read_yaml(str(config)), overrides))[1]


def summarize(metrics: list[dict], plan, wall: float, host: tuple[int, int]) -> dict:
    """Stage medians over the steps after the first, phase peaks against the plan, host memory."""
    timed = metrics[1:] or metrics
    stages = [*sorted({k for m in metrics for k in m if k.startswith("timing_s/")}), "perf/time_per_step"]
    out: dict = {"wall_s": wall, "steps": [{k: m[k] for k in stages if k in m} for m in metrics]}
    out["median"] = {k: statistics.median(m[k] for m in timed if k in m) for k in stages}
    peaks: dict[str, float] = {}
    for key, phase in PHASES.items():
        for m in metrics:
            if key in m:
                peaks[phase] = max(peaks.get(phase, 0.0), m[key] * GIB)
    out["phases"] = {
        phase: {"measured_gb": peaks.get(phase, 0) / 1e9, "plan_gb": (plan.phases.get(phase, 0) / 1e9 if plan else None)}
        for phase in sorted(set(peaks) | set(plan.phases if plan else {}))
    }  # fmt: skip
    # Each worker call's peak and what it found allocated when it began, per step (the breakdown's data)
    calls = sorted(
        {k for m in metrics for k in m if k.startswith("memory/") and k.endswith(("_peak_gib", "_start_gib"))}
    )
    out["calls_gb"] = {
        k.removeprefix("memory/"): [round(m.get(k, 0) * GIB / 1e9, 3) for m in metrics] for k in calls
    }
    out["host"] = {
        "before_gb": host[0] / 1e9,
        "peak_gb": host[1] / 1e9,
        "plan_gb": plan.host / 1e9 if plan else None,
    }
    out["plan"] = plan.line() if plan else "not planned"
    return out


def print_summary(s: dict) -> None:
    """The step times, the phases' peaks against the plan and the host memory, as markdown tables."""
    print(f"plan: {s['plan']}\nwall: {s['wall_s']:.0f} s for the whole run (load, steps, final export)")
    keys = sorted(s["median"])
    print("| step | " + " | ".join(k.split("/")[1] for k in keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for i, step in enumerate(s["steps"], 1):
        print(f"| {i} | " + " | ".join(f"{step.get(k, float('nan')):.2f}" for k in keys) + " |")
    print("| median 2.. | " + " | ".join(f"{s['median'][k]:.2f}" for k in keys) + " |")
    print("\n| phase | measured peak GB | plan GB | measured / plan |\n|---|---|---|---|")
    for phase, v in s["phases"].items():
        ratio = f"{v['measured_gb'] / v['plan_gb']:.2f}" if v["plan_gb"] else "-"
        print(f"| {phase} | {v['measured_gb']:.1f} | {v['plan_gb'] or 0:.1f} | {ratio} |")
    for call, values in s["calls_gb"].items():
        print(f"{call}: " + " ".join(f"{v:.2f}" for v in values) + " GB (steps 1..)")
    h = s["host"]
    print(
        f"host memory in use: {h['before_gb']:.1f} GB before, peak {h['peak_gb']:.1f} GB; plan {h['plan_gb'] or 0:.1f} GB"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-size", choices=sorted(SHAPES), default="7b")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--work", type=Path, required=True, help="where the model, data and run go (reused)")
    p.add_argument("--out", type=Path, help="the run's log and the summary JSON go here")
    p.add_argument(
        "--gpu-memory-gb", type=float, help="run as on a GPU of this many GB (trainer.gpu_memory_gb)"
    )
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--tag", help="a name for this run's files (besides the shape and the cap)")
    p.add_argument(
        "--layers", type=int, help="decoder layers (default: the shape's), e.g. 4 for a quick probe"
    )
    p.add_argument("--make-model", choices=sorted(SHAPES), help=argparse.SUPPRESS)  # the child's job
    p.add_argument("overrides", nargs="*", help="more config overrides, key=value")
    args = p.parse_args()
    if args.make_model:
        make_model(args.make_model, args.layers, args.device, args.work / "model")
        return
    logging.basicConfig(level=logging.WARNING)
    out = args.out or args.work
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{args.model_size}{'' if args.layers is None else f'_{args.layers}l'}_"
    tag += "whole" if args.gpu_memory_gb is None else f"{args.gpu_memory_gb:g}gb"
    tag += f"_{args.tag}" if args.tag else ""
    config = prepare(args, args.work)
    overrides = list(args.overrides)
    if args.gpu_memory_gb is not None:
        overrides.append(f"trainer.gpu_memory_gb={args.gpu_memory_gb:g}")
    run_dir = args.work / "run"
    shutil.rmtree(run_dir, ignore_errors=True)  # this run's files only (no resume from an earlier one)
    wall, *host = train(config, overrides, out / f"train_{tag}.log")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    exported = sum(f.stat().st_size for f in (run_dir / "final_model").glob("*.safetensors"))
    shutil.rmtree(run_dir / "final_model")  # a 7B export is 30 GB of the GPU machine's 64 GB disk
    summary = summarize(metrics, the_plan(config, overrides), wall, tuple(host))
    summary["run"] = {
        "model_size": args.model_size,
        "gpu_memory_gb": args.gpu_memory_gb,
        "overrides": overrides,
    }
    summary["exported_gb"] = exported / 1e9
    print_summary(summary)
    print(f"final_model: {exported / 1e9:.1f} GB of safetensors written (then removed)")
    (out / f"big_model_{tag}.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
