"""The automatic layout's memory estimate against what the GPU allocates, phase by phase (GPU; not a test).

    python benchmarks/plan_check.py --workload W1 --model-size 0.5b
    python benchmarks/plan_check.py --workload W2 --model-size 1.5b --steps 2

Runs ``--steps`` GRPO steps of a ``grpo_step.py`` workload through the trainer on one GPU (random weights of the
Qwen2.5 shape) in the layout the planner picks (``plan.search.plan_layout``, printed first), and compares
each phase's ``torch.cuda.max_memory_allocated`` (the workers' ``memory/<role>.<method>_peak_gib``, the highest
over the steps) with the plan's estimate of that phase: generate (``actor.generate``), log_prob
(``actor.compute_log_prob`` and ``ref.compute_ref_log_prob``) and update_actor (``actor.update_actor``). A
phase within ``--tolerance`` (15%) of the plan passes; the exit status is 1 when one does not.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

try:
    import hybridflow  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from grpo_step import WORKLOADS, hash_reward, prompt_rows, trainer_config, word_tokenizer
from shapes import build_model

from hybridflow.data import RLDataset
from hybridflow.plan.memory import gpu_memory_bytes
from hybridflow.plan.report import GB
from hybridflow.plan.search import apply_layout, plan_layout
from hybridflow.trainer.builder import build_components
from hybridflow.trainer.ppo import PPOTrainer

GIB = 2**30
PHASES = {  # the workers' peak metric -> the plan's phase
    "memory/actor.generate_peak_gib": "generate",
    "memory/actor.compute_log_prob_peak_gib": "log_prob",
    "memory/ref.compute_ref_log_prob_peak_gib": "log_prob",
    "memory/actor.update_actor_peak_gib": "update_actor",
}


def measured_peaks(trainer: PPOTrainer, steps: int) -> dict[str, float]:
    """The highest peak (bytes) of each worker phase over ``steps`` steps."""
    peaks: dict[str, float] = {}
    for _ in range(steps):
        trainer.global_step += 1
        metrics = trainer.step()
        for key in PHASES:
            if key in metrics:
                peaks[key] = max(peaks.get(key, 0.0), metrics[key] * GIB)
    return peaks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="W1")
    p.add_argument("--model-size", choices=["0.5b", "1.5b"], default="0.5b")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--tolerance", type=float, default=0.15)
    p.add_argument("overrides", nargs="*", help="trainer config overrides, key=value")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: plan_check compares against the GPU's allocations; run it on a GPU")
    logging.basicConfig(level=logging.WARNING)
    args.device = "cuda"
    w = dict(WORKLOADS[args.workload])
    cfg = trainer_config(args, w, args.steps)
    model = build_model(args.model_size, "sdpa", torch.device("cuda"))
    model.config.pad_token_id, model.config.eos_token_id = 0, 1
    layout = plan_layout(cfg, model.config, gpu_memory_bytes())
    print(layout.line())
    cfg = apply_layout(cfg, layout)
    tokenizer = word_tokenizer(model.config.vocab_size)
    rows = prompt_rows(w["prompts"] * args.steps, w["prompt_len"], model.config.vocab_size)
    train = RLDataset(rows, tokenizer, max_prompt_length=w["prompt_len"], source="benchmark prompts")
    trainer = PPOTrainer(cfg, build_components(cfg, model, tokenizer, reward_fn=hash_reward, train=train))
    del model
    peaks = measured_peaks(trainer, args.steps)
    trainer.c.close()
    print(f"\n{args.workload} {args.model_size} on {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| phase | worker call | plan GB | measured GB | measured / plan | within |")
    print("|---|---|---|---|---|---|")
    failed = False
    for key, measured in peaks.items():
        phase = PHASES[key]
        planned = layout.phases[phase]
        ok = abs(measured - planned) <= args.tolerance * measured
        failed |= not ok
        call = key.removeprefix("memory/").removesuffix("_peak_gib")
        print(
            f"| {phase} | {call} | {planned / GB:.2f} | {measured / GB:.2f} | {measured / planned:.2f} | "
            f"{'yes' if ok else 'NO'} |"
        )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
