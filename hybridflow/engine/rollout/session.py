"""One session of the paged engine: from the first request after idle to the last one finished. It holds what
is sized for the work: the block pool and its device cache, the seats, the sampler, the CUDA graphs, and the
session's figures; ``close`` hands the cache (and the cast weights) back to training.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed._functional_collectives as funcol

from hybridflow.engine.rollout.block_pool import BlockPool
from hybridflow.engine.rollout.decode_loop import make_sampler
from hybridflow.engine.rollout.graphs import DecodeGraphs
from hybridflow.engine.rollout.kv_cache import KV_DTYPES, PagedKVCache
from hybridflow.engine.rollout.model import LlamaRunner
from hybridflow.engine.rollout.multimodal import chunk_inputs, image_features
from hybridflow.engine.rollout.sampling import SamplingParams
from hybridflow.engine.rollout.seats import Seats
from hybridflow.engine.rollout.stats import GenerationStats, PhaseTimer
from hybridflow.engine.rollout.tp import RolloutTP
from hybridflow.utils.device import gpu_memory_limit
from hybridflow.utils.errors import UserError
from hybridflow.utils.logging import rank

if TYPE_CHECKING:
    from hybridflow.engine.rollout.sequence import Sequence

logger = logging.getLogger(__name__)

# A memory-bound pool is a multiple of this many blocks: the compiled decode step is specialised on the
# cache's shape, so a pool that moved with a few MB of other allocations between calls would recompile
# every batch bucket (~80 s in the second step of W2 at 1.5B on an H200, seen when the old slot cache's
# count moved from 962 to 960).
BLOCK_GRANULE = 256


@dataclasses.dataclass
class SessionConfig:
    """The engine's settings: the pool's, the batch bounds, the memory share, and how decode runs."""

    num_blocks: int | None = None
    block_size: int = 128  # a multiple of the decode kernel's tile (64 or 128): one block id per tile
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    gpu_memory_utilization: float = 0.5
    sync_interval: int = 16
    enforce_eager: bool = False
    compile_decode: bool = False
    free_cache_engine: bool = True
    device: torch.device | None = None
    record_routing: bool = False  # a mixture of experts: each token's experts with its output (router replay)
    kv_cache_dtype: str = "auto"  # auto: the compute dtype; fp8: e4m3 with per-(layer, KV head) scales

    def __post_init__(self) -> None:
        if (
            self.block_size < 1
            or (self.num_blocks is not None and self.num_blocks < 1)
            or self.sync_interval < 1
        ):
            raise UserError(
                f"block_size, num_blocks and sync_interval must be >= 1; got {self.block_size}, "
                f"{self.num_blocks}, {self.sync_interval}"
            )
        if self.kv_cache_dtype not in KV_DTYPES:
            raise UserError(
                f"rollout.kv_cache_dtype={self.kv_cache_dtype!r} is not a KV-cache dtype here; set it to one of "
                f"{', '.join(KV_DTYPES)} (auto: the rollout's compute dtype; fp8: e4m3 with per-head scales)"
            )

    @property
    def fp8(self) -> bool:
        """Whether the KV cache is FP8."""
        return self.kv_cache_dtype == "fp8"


def check_params(running: SamplingParams, new: SamplingParams) -> None:
    """Requests in flight together share their sampling settings (one sampler and one stop list per
    session); only n and a max_new_tokens up to the session's may differ."""
    same = dataclasses.replace(new, n=running.n, max_new_tokens=running.max_new_tokens) == running
    if not same or new.max_new_tokens > running.max_new_tokens:
        raise UserError(
            "a request's sampling settings must equal those of the requests in flight (n may differ, and "
            f"max_new_tokens up to {running.max_new_tokens}); got {new}, running {running}. Add it once "
            "the engine is idle"
        )


def blocks_that_fit(free_bytes: float, block_bytes: int) -> int:
    """Blocks of ``block_bytes`` in ``free_bytes``, less the device's scratch block 0."""
    return int(free_bytes // block_bytes) - 1


class SessionOwner(Protocol):
    """What a session reads of its engine (``PagedEngine``), and the two fields it leaves for the next one."""

    runner: LlamaRunner
    cfg: SessionConfig
    tp: RolloutTP | None
    fused_sampler: bool
    use_graphs: bool
    warm: dict[tuple, set[int]]  # batch buckets run once, per graph signature
    decode_fn: Callable
    record_fn: Callable
    kept_cache: PagedKVCache | None  # the last session's cache (free_cache_engine off)
    last_pool_blocks: int | None
    fp8_logged: bool  # the FP8 KV cache's line was logged


class Session:
    """The pool, cache, seats, sampler and graphs of one stretch of work, and its figures."""

    def __init__(
        self, engine: SessionOwner, params: SamplingParams, num_seats: int, num_seqs: int, max_len: int
    ):
        self.engine, self.params, self.runner = engine, params, engine.runner
        cfg, r = engine.cfg, engine.runner
        if r.refresh():  # the trainer may have stepped: re-cast in place; rebound tensors need new graphs
            engine.warm.clear()
        bs = cfg.block_size
        width = -(-max_len // bs)  # table width: blocks of the longest sequence
        # Every sequence at full length, and a block per seat of the admission headroom (PagedEngine._admit).
        blocks = cfg.num_blocks or self._blocks_for_memory(num_seqs * width + num_seats, num_seats)
        self.pool = BlockPool(blocks, bs)
        self.cache = self._cache(blocks + 1)  # block 0 of the device is scratch (see seats.py)
        self.cache.calibrate = self.cache.fp8  # new weights may have come with this session (refresh above)
        r.calibrate_activations()  # and the FP8 projections' static activation scales, likewise
        if self.cache.fp8 and not engine.fp8_logged:
            engine.fp8_logged = True
            self._log_fp8(blocks)
        eos = [] if params.ignore_eos else list(params.eos_token_ids)
        self.seats = Seats(
            num_seats,
            width,
            params.max_new_tokens,
            list(params.stop_token_ids),
            eos,
            r.device,
            mrope=r.visual is not None,
        )
        self.params_never_stop = params.ignore_eos or not (params.eos_token_ids or params.stop_token_ids)
        self.pick, generator = make_sampler(params, r.device, engine.fused_sampler)
        self.graphs = None
        if engine.use_graphs:
            key = (num_seats, width, blocks, repr(dataclasses.replace(params, seed=None)), r.k_splits)
            self.graphs = DecodeGraphs(self._step, num_seats, generator, engine.warm.setdefault(key, set()))
        self.timer = PhaseTimer(r.device)
        self.counts = GenerationStats(slots=num_seats)
        logger.debug("paged session: %d blocks of %d, %d seats, width %d", blocks, bs, num_seats, width)

    # ---- sizing -------------------------------------------------------------------------------------------

    @staticmethod
    def block_bytes(runner: LlamaRunner, block_size: int, fp8: bool = False) -> int:
        """Device bytes of one block over all layers (FP8: one byte per element)."""
        dtype = torch.float8_e4m3fn if fp8 else runner.dtype
        return PagedKVCache.bytes_per_block(
            runner.num_layers, block_size, runner.num_kv_heads, runner.head_dim, dtype
        )

    def _log_fp8(self, blocks: int) -> None:
        """The engine's first FP8 session: what the pool holds (global rank 0 only)."""
        if rank() != 0:
            return
        bs, r = self.engine.cfg.block_size, self.runner
        logger.info(
            "rollout.kv_cache_dtype=fp8: the KV cache is FP8 (e4m3, a scale per layer and KV head for K and for "
            "V, calibrated on the first prefill after each weight refresh): %d blocks of %d positions, %s bytes "
            "per block against %s in %s",
            blocks, bs, self.block_bytes(r, bs, True), self.block_bytes(r, bs), r.dtype,
        )  # fmt: skip

    @staticmethod
    def budget(runner: LlamaRunner, cfg: SessionConfig, kept: int = 0, pending: int = 0) -> float:
        """Device bytes the pool may take: the utilization's share of the GPU less what is allocated (a kept
        cache counts as free, weight buffers about to be filled as taken)."""
        total = gpu_memory_limit(runner.device)  # the whole GPU, or trainer.gpu_memory_gb's share
        return cfg.gpu_memory_utilization * total - (
            torch.cuda.memory_allocated(runner.device) - kept + pending
        )

    @staticmethod
    def workspace(runner: LlamaRunner, num_seats: int) -> int:
        """Device bytes a decode step needs beside the pool at ``num_seats`` rows."""
        # A step's logits in the compute dtype, their float32 copy in filtered sampling, a float32 row of
        # the sampler's, and the hidden and MLP activations: at 4,096 rows of a 152k vocabulary ~5 GB, which
        # a budget of 0.9 of an H200 left no room for.
        return num_seats * (runner.vocab_size * 10 + 32 * runner.config.intermediate_size)

    @staticmethod
    def pool_block_bytes(runner: LlamaRunner, cfg: SessionConfig) -> int:
        """Device bytes of one block of the pool: its K and V, and its routing records when kept."""
        per = Session.block_bytes(runner, cfg.block_size, cfg.fp8)
        if cfg.record_routing:  # each position's expert ids (uint8) beside its K and V
            per += cfg.block_size * math.prod(runner.routing_shape)
        return per

    @classmethod
    def shortfall(cls, runner: LlamaRunner, cfg: SessionConfig, count: int, max_len: int) -> int:
        """Bytes the pool lacks to hold ``count`` sequences of ``max_len`` positions at once: what
        ``_blocks_for_memory`` sizes it by (every sequence at full length, a block of headroom per seat, the
        scratch block and the decode step's workspace), so that with this much more room it holds them all."""
        seats = min(count, cfg.max_num_seqs)
        demand = count * -(-max_len // cfg.block_size) + seats
        need = (demand + 1) * cls.pool_block_bytes(runner, cfg) + cls.workspace(runner, seats)
        return max(0, math.ceil(need - cls.budget(runner, cfg, pending=runner.pending_bytes())))

    def _blocks_for_memory(self, demand: int, num_seats: int) -> int:
        """Blocks for the work (``demand``: every sequence at full length, and a block per seat), within the
        memory budget on GPU, less the decode step's workspace at ``num_seats`` rows."""
        r, cfg = self.runner, self.engine.cfg
        if r.device.type != "cuda":
            return demand
        kept = self.engine.kept_cache.storage.nbytes if self.engine.kept_cache is not None else 0
        per = self.pool_block_bytes(r, cfg)
        fit = blocks_that_fit(self.budget(r, cfg, kept) - self.workspace(r, num_seats), per)
        if self.engine.tp is not None:  # the ranks of a group must schedule alike: the smallest pool rules
            fit = int(funcol.all_reduce(torch.tensor([fit], device=r.device), "min", self.engine.tp.group))
        if fit < 1:
            raise UserError(
                f"no KV-cache block fits in rollout.gpu_memory_utilization={cfg.gpu_memory_utilization} of the "
                "GPU; raise it"
            )
        if fit >= demand:
            return demand
        blocks = fit - fit % BLOCK_GRANULE if fit >= 2 * BLOCK_GRANULE else fit
        # Not waves: sequences hold what they use, and only if they all grow long at once are the youngest
        # preempted (rollout/preemptions counts them).
        logger.info(
            "KV pool: %d blocks of %d positions (%.1f GiB) at rollout.gpu_memory_utilization=%s, %.0f%% of what "
            "every sequence at full length would take",
            blocks, cfg.block_size, blocks * per / 2**30, cfg.gpu_memory_utilization, 100 * blocks / demand,
        )  # fmt: skip
        return blocks

    def _cache(self, blocks: int) -> PagedKVCache:
        """The device cache: the one kept from the last session if it has the shape, else a new one."""
        r, kept = self.runner, self.engine.kept_cache
        self.engine.kept_cache = None
        routing = r.routing_shape if self.engine.cfg.record_routing else None
        fp8 = self.engine.cfg.fp8
        if (
            kept is not None
            and kept.num_blocks == blocks
            and (kept.routing is None) == (routing is None)
            and kept.fp8 == fp8
        ):
            return kept
        del kept
        # The last session's freed pool stays cached in the allocator: a pool of another size could not use
        # it and the GPU would hold both (the warm-up's small pool then a 120 GB one: out of memory). Only on a
        # change of size, since cudaMalloc'ing training's cached blocks again every step costs time.
        if r.device.type == "cuda" and self.engine.last_pool_blocks not in (None, blocks):
            torch.cuda.empty_cache()
        self.engine.last_pool_blocks = blocks
        sizes = (r.num_layers, blocks, self.pool.block_size, r.num_kv_heads, r.head_dim)
        return PagedKVCache(*sizes, r.dtype, r.device, routing, fp8)

    # ---- the work -----------------------------------------------------------------------------------------

    def prefill(self, rows: list[tuple[Sequence, int]]) -> None:
        """Prefill each sequence's tokens from its start (at least its last token), in calls within the token
        budget (a row longer than the budget in chunks); keeps the logits after each row's last token."""
        budget, call, out = self.engine.cfg.max_num_batched_tokens, [], []
        with self.timer.span("prefill"):
            self.features = self._image_features(rows)
            for s, start in rows:
                start = min(start, len(s.tokens) - 1)
                self.counts.prefill_tokens += len(s.tokens) - start
                while len(s.tokens) - start > budget:  # a long row: its own calls, chunk by chunk
                    self._prefill_call([(s, start, start + budget)])
                    start += budget
                if (
                    call
                    and (len(call) + 1) * max(e - b for _, b, e in [*call, (s, start, len(s.tokens))])
                    > budget
                ):
                    out.append(self._prefill_call(call))
                    call = []
                call.append((s, start, len(s.tokens)))
            if call:
                out.append(self._prefill_call(call))
        self.features = {}
        self.logits = torch.cat(out)  # (rows, V)

    def _image_features(self, rows: list[tuple[Sequence, int]]) -> dict[int, torch.Tensor]:
        """The vision tower's features of every row whose prefill still holds image tokens, by sequence id."""
        r = self.runner
        todo = [
            s for s, at in rows if s.mm is not None and r.image_token_id in s.tokens[at : s.mm.prompt_len]
        ]
        if not todo:
            return {}
        self.counts.image_prefills += len(todo)
        feats = image_features(r.visual, [s.mm for s in todo], r.device, r.dtype)
        return {s.id: f for s, f in zip(todo, feats)}

    def _prefill_call(self, call: list[tuple[Sequence, int, int]]) -> torch.Tensor:
        """One right-padded prefill call of (sequence, start, end) rows; the logits after each row (b, V)."""
        from hybridflow.engine.ops.packing import to_device

        dev, width = self.runner.device, max(e - b for _, b, e in call)
        ids = torch.tensor([s.tokens[b:e] + [0] * (width - e + b) for s, b, e in call])  # (b, t)
        lengths = torch.tensor([e - b for _, b, e in call])
        starts = torch.tensor([b for _, b, _ in call])
        blocks = max(len(s.table.blocks) for s, _, _ in call)
        tables = torch.tensor(
            [[x + 1 for x in s.table.blocks] + [0] * (blocks - len(s.table.blocks)) for s, _, _ in call]
        )
        images = None
        if self.runner.visual is not None:
            images = chunk_inputs(call, self.features, self.runner.image_token_id, width)
        return self.runner.prefill_paged(to_device(ids, dev), lengths, starts, self.cache, tables, images)

    def first_tokens(self, jobs: list[Sequence], groups: list[list[Sequence]]) -> None:
        """Sample each prefilled row's first token (once per sample of a group) and start their seats."""
        from hybridflow.engine.ops.packing import to_device

        seqs = jobs + [s for g in groups for s in g]
        repeat = list(range(len(jobs))) + [len(jobs) + k for k, g in enumerate(groups) for _ in g]
        rows = self.logits[to_device(torch.tensor(repeat), self.runner.device)]  # (len(seqs), V)
        seats = [s.seat for s in seqs]
        for s in seqs:
            s.pending = 1  # the token sampled here, on the device until its sequence is fetched
        deltas = [0 if s.mm is None else s.mm.delta for s in seqs] if self.seats.mrope else None
        self.seats.begin(
            seats, [len(s.tokens) for s in seqs], [s.budget_end - len(s.tokens) for s in seqs], deltas
        )
        tokens, logprobs = self.pick(rows)
        idx = to_device(torch.tensor(seats), self.runner.device)
        self.seats.state.record(idx, tokens, logprobs, advance=False)
        self.counts.decode_tokens -= len(seqs)  # counted as sampled at the sync, but prefill's
        if self.graphs is not None and self.seats.num_used:
            self.graphs.prepare(self.seats.num_used)  # captures while the GPU runs the prefill just queued
        del self.logits

    def decode(self, steps: int) -> None:
        """``steps`` decode steps for every seat, queued without a host sync."""
        b = self.seats.num_used
        self.seats.upload()
        with self.timer.span("decode"):
            for _ in range(steps):
                if self.graphs is not None:
                    self.graphs.run(b)
                else:
                    self._step(b)
        self.counts.decode_steps += steps

    def _step(self, b: int) -> None:
        self.seats.decode_step(b, self.engine.decode_fn, self.cache, self.pick, self.engine.record_fn)

    def refresh_weights(self) -> None:
        """After an in-place weight update: re-cast into the runner's buffers (new graphs if rebound); an FP8
        cache, and FP8 projections' static activation scales, recalibrate (in place) on the next prefill."""
        self.cache.calibrate = self.cache.fp8
        if self.runner.refresh():
            self.engine.warm.clear()
            if self.graphs is not None:
                self.graphs.graphs.clear()
        self.runner.calibrate_activations()

    def stats(self, concurrent: list[int], preemptions: int) -> GenerationStats:
        """The session's figures so far (device times read when it closes)."""
        steps = concurrent or [0]
        return dataclasses.replace(
            self.counts,
            kv_blocks_used=self.pool.stats.peak_used / len(self.pool.blocks),
            concurrent_seqs_mean=sum(steps) / len(steps),
            concurrent_seqs_peak=float(max(steps)),
            prefix_cache_hit_rate=self.pool.stats.hit_rate,
            preemptions=float(preemptions),
        )

    def close(self) -> None:
        """Read the device times; free the cache and the cast weights, or keep the cache for the next session."""
        seconds = self.timer.close()
        self.counts.prefill_s, self.counts.decode_s = seconds.get("prefill", 0.0), seconds.get("decode", 0.0)
        self.graphs = None  # graphs hold the cache and weight tensors: drop them before freeing those
        if self.engine.cfg.free_cache_engine:
            self.runner.release()  # re-allocated and re-filled by the next session's refresh()
        else:
            self.engine.kept_cache = self.cache
        self.cache = None
