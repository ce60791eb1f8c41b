"""verl-named metrics of one training step, computed from the step's batch."""

from __future__ import annotations

import logging

import torch

from hybridflow.protocol import Batch
from hybridflow.utils.device import cuda_in_use

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
