"""verl-named metrics of one training step, computed from the step's batch."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from hybridflow.protocol import Batch
from hybridflow.utils.device import cuda_in_use
from hybridflow.utils.logging import rank as env_rank

logger = logging.getLogger(__name__)

CLIP_KEY = "response_length/clip_ratio"


def _stats(name: str, values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {}
    values = values.float()
    return {
        f"{name}/mean": float(values.mean()),
        f"{name}/max": float(values.max()),
        f"{name}/min": float(values.min()),
    }


def compute_data_metrics(batch: Batch, max_response_length: int) -> dict[str, float]:
    """Scores, rewards, advantages, returns, values, and prompt/response lengths under verl's names."""
    mask = batch["response_mask"].bool()  # (B, R)
    response_len = mask.sum(-1).float()  # (B,)
    prompt_len = batch["attention_mask"][:, :-max_response_length].sum(-1).float()  # (B,)
    metrics = {}
    metrics.update(_stats("critic/score", batch["token_level_scores"].sum(-1)))
    metrics.update(_stats("critic/rewards", batch["token_level_rewards"].sum(-1)))
    valid = mask.any(-1)
    for key, name in (
        ("advantages", "critic/advantages"),
        ("returns", "critic/returns"),
        ("values", "critic/values"),
    ):
        if key in batch:
            metrics.update(_stats(name, batch[key][mask]))
    metrics.update(_stats("response_length", response_len))
    metrics["response_length/clip_ratio"] = float((response_len == max_response_length).float().mean())
    metrics.update(_stats("prompt_length", prompt_len))
    if "acc" in batch:
        metrics["critic/acc/mean"] = float(torch.as_tensor(list(batch["acc"]), dtype=torch.float32).mean())
    metrics["response_length/empty_ratio"] = float((~valid).float().mean())
    return metrics


class ClipWatch:
    """Says once, when most responses of the run so far stopped at ``data.max_response_length``, that the
    answers are cut off (the mean of ``response_length/clip_ratio`` over the steps above one half)."""

    def __init__(self, max_response_length: int) -> None:
        self.max_response_length = max_response_length
        self.total = 0.0
        self.steps = 0
        self.said = False

    def update(self, metrics: dict[str, float]) -> None:
        """Count one step's clip ratio; warn the first time the run's mean is above one half."""
        if CLIP_KEY not in metrics:
            return
        self.total += metrics[CLIP_KEY]
        self.steps += 1
        mean = self.total / self.steps
        if mean > 0.5 and not self.said:
            self.said = True
            logger.warning(
                "%.0f%% of the responses of %d step(s) so far stopped at data.max_response_length=%d tokens "
                "(response_length/clip_ratio): most answers are cut off; raise data.max_response_length "
                "(max_completion_length= in the Python API)",
                100 * mean,
                self.steps,
                self.max_response_length,
            )


ZERO_STD_KEY = "critic/score/zero_std_frac"  # TRL logs the same fraction as frac_reward_zero_std


class SignalWatch:
    """Says once, after the run's first ``steps`` steps, when they gave the policy nothing to learn from.

    Two cases, each a warning naming who scores (``Scorer.describe``) and the fixes: every sample got the
    same reward in all of those steps (a constant reward: every advantage is zero, whatever the estimator);
    or, with a group-relative estimator, every group's samples tied in each of them
    (``critic/score/zero_std_frac`` = 1: GRPO's advantages are all zero). Runs shorter than ``steps`` are
    judged at their last step. Only rank 0 speaks.
    """

    def __init__(self, cfg: Any, total_steps: int | None, steps: int = 3) -> None:
        self.steps = steps if total_steps is None else max(1, min(steps, total_steps))
        self.n = cfg.rollout.n
        self.temperature = cfg.rollout.temperature
        self.seen: list[tuple[float, float, float | None]] = []  # (score min, max, zero_std_frac) per step
        self.said = env_rank() != 0

    def update(self, metrics: dict[str, float], who: Callable[[], str]) -> None:
        """Count one step's scores; at the last of the first steps, warn if none of them had a signal.
        ``who()`` names who scored (asked only for a warning)."""
        if self.said or "critic/score/min" not in metrics:
            return
        self.seen.append(
            (metrics["critic/score/min"], metrics["critic/score/max"], metrics.get(ZERO_STD_KEY))
        )
        if len(self.seen) < self.steps:
            return
        self.said = True
        lows, highs, tied = zip(*self.seen)
        steps = f"the first {self.steps} step{'s' if self.steps != 1 else ''}"
        if len(set(lows) | set(highs)) == 1:
            logger.warning(
                "the reward was %g for every sample of %s (%s): a constant reward teaches nothing, every "
                "advantage is 0. Check that it gives different values to better and worse responses (the "
                "responses may never show what it looks for: see trainer.rollout_data_dir's samples)",
                lows[0],
                steps,
                who(),
            )
        elif all(t is not None and t >= 1.0 for t in tied):
            logger.warning(
                "in each of %s every prompt's %d samples got the same reward (%s = 1; TRL's "
                "frac_reward_zero_std): group-relative advantages are all 0 and the policy learns nothing. "
                "Fix: a reward that tells the samples of one prompt apart (partial credit; check %s), more "
                "varied samples (rollout.temperature, now %g; rollout.n), or "
                "algorithm.filter_groups.enable=true (DAPO's dynamic sampling: trains only on groups whose "
                "rewards differ)",
                steps,
                self.n,
                ZERO_STD_KEY,
                who(),
                self.temperature,
            )


def throughput_metrics(batch: Batch, step_time: float, num_devices: int) -> dict[str, float]:
    """``perf/throughput`` (tokens per second per device over the step) and its companions."""
    tokens = float(batch["attention_mask"].sum())
    out = {
        "perf/total_num_tokens": tokens,
        "perf/time_per_step": step_time,
        "perf/throughput": tokens / max(step_time, 1e-9) / max(num_devices, 1),
    }
    if cuda_in_use():
        out["perf/max_memory_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
    return out


def step_peak_memory(memory: dict[str, float]) -> dict[str, float]:
    """``perf/max_memory_allocated_gb``: the highest of the phases' peaks (``memory/*_peak_gib``, rank 0).

    Each worker call resets the device's peak counter to measure its own phase, so the counter read at the
    end of a step holds only the last phase's peak; the step's peak is the largest phase peak.
    """
    peaks = [v for k, v in memory.items() if k.endswith("_peak_gib")]
    return {"perf/max_memory_allocated_gb": max(peaks)} if peaks else {}


# Where each GenerationStats field goes: device times under timing_s/ and the rate under perf/ (they vary
# from run to run, like every figure under those prefixes); counts under rollout/.
ROLLOUT_STAT_KEYS = {
    "prefill_tokens": "rollout/prefill_tokens",
    "decode_steps": "rollout/decode_steps",
    "decode_tokens": "rollout/decode_tokens",
    "prefill_s": "timing_s/gen_prefill",
    "decode_s": "timing_s/gen_decode",
}


def add_rollout_stats(metrics: dict[str, float], stats: dict[str, float] | None) -> None:
    """Add a generate call's stats (``GenerationStats`` fields) to the step's metrics, summing over calls.

    ``perf/rollout_decode_tokens_per_s`` is the tokens decoded per second of decode device time;
    ``rollout/kv_slots`` is the largest slot count of the calls, not a sum; so are the paged engine's
    ``rollout/kv_blocks_used`` (peak fraction of the pool), ``rollout/concurrent_seqs_mean|peak`` and
    ``rollout/prefix_cache_hit_rate``; ``rollout/preemptions`` is summed.
    """
    if stats is None:
        return
    for field, key in ROLLOUT_STAT_KEYS.items():
        metrics[key] = metrics.get(key, 0.0) + float(stats[field])
    # The most sequences any call could decode at once (the engine's seats).
    metrics["rollout/kv_slots"] = max(metrics.get("rollout/kv_slots", 0.0), float(stats.get("slots", 0)))
    # The paged engine's scheduler: the largest figures over the step's calls, preemptions summed.
    for field in ("kv_blocks_used", "concurrent_seqs_mean", "concurrent_seqs_peak", "prefix_cache_hit_rate"):
        key = f"rollout/{field}"
        metrics[key] = max(metrics.get(key, 0.0), float(stats.get(field, 0.0)))
    metrics["rollout/preemptions"] = metrics.get("rollout/preemptions", 0.0) + float(
        stats.get("preemptions", 0)
    )
    seconds = metrics["timing_s/gen_decode"]
    rate = metrics["rollout/decode_tokens"] / seconds if seconds > 0 else 0.0
    metrics["perf/rollout_decode_tokens_per_s"] = rate


def add_reshard_stats(metrics: dict[str, float], per_rank: list[dict[str, float]] | None) -> None:
    """The train -> generate switch of each rank (``ActorWorker`` figures), summed over the step's calls.

    ``timing_s/reshard``: the slowest rank's switch; ``reshard/rank{r}_received_mib``: what each rank
    received; ``memory/reshard_peak_gib``: the largest peak allocated during a switch (CUDA only);
    ``reshard/frozen_skipped_mib``: what a frozen vision tower saved the most-skipping rank (not resent).
    """
    if not per_rank:
        return
    metrics["timing_s/reshard"] = metrics.get("timing_s/reshard", 0.0) + max(r["seconds"] for r in per_rank)
    for rank, r in enumerate(per_rank):
        key = f"reshard/rank{rank}_received_mib"
        metrics[key] = metrics.get(key, 0.0) + r["bytes"] / 2**20
    skipped = [r["skipped_bytes"] for r in per_rank if "skipped_bytes" in r]
    if skipped:
        key = "reshard/frozen_skipped_mib"
        metrics[key] = metrics.get(key, 0.0) + max(skipped) / 2**20
    peaks = [r["peak_gib"] for r in per_rank if "peak_gib" in r]
    if peaks:
        metrics["memory/reshard_peak_gib"] = max(metrics.get("memory/reshard_peak_gib", 0.0), *peaks)
