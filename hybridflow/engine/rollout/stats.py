"""What one ``generate`` call did: prefill and decode time and token counts, timed without host syncs."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass
class GenerationStats:
    """Counts and device time of one ``generate`` call (times in seconds)."""

    prefill_tokens: int = 0  # prompt tokens run through prefill (once per prompt: samples share it)
    image_prefills: int = 0  # sequences whose images went through the vision tower (once per prompt group)
    decode_steps: int = 0
    decode_tokens: int = 0  # tokens the decode steps produced and kept (each sample's first is prefill's)
    slots: int = 0  # seats: the most sequences that may decode at once (rollout.max_num_seqs, or the work)
    prefill_s: float = 0.0
    decode_s: float = 0.0
    # The scheduler's: the pool's peak fraction in use, sequences decoding per round, full prompt blocks found
    # cached, sequences preempted for want of blocks.
    kv_blocks_used: float = 0.0
    concurrent_seqs_mean: float = 0.0
    concurrent_seqs_peak: float = 0.0
    prefix_cache_hit_rate: float = 0.0
    preemptions: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens generated per second of decode time."""
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0


@dataclass
class PhaseTimer:
    """Sums the time of phases on the device's stream: CUDA events on GPU (read once, at ``close``),
    the host clock elsewhere. Recording an event does not wait for the GPU, so timing costs no sync."""

    device: torch.device
    spans: dict[str, list] = field(default_factory=dict)

    @contextmanager
    def span(self, phase: str) -> Iterator[None]:
        """Time the work queued inside the block as part of ``phase``."""
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.spans.setdefault(phase, []).append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.spans.setdefault(phase, []).append(time.perf_counter() - t0)

    def close(self) -> dict[str, float]:
        """Seconds per phase (waits for the GPU to reach the last event)."""
        out = {}
        for phase, spans in self.spans.items():
            if self.device.type == "cuda":
                spans[-1][1].synchronize()
                out[phase] = sum(s.elapsed_time(e) for s, e in spans) / 1e3
            else:
                out[phase] = sum(spans)
        return out
