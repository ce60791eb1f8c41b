"""The built-in rollout engine: continuous batching over a slot KV cache, on the trainer's own weights."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn

from hybridflow.engine.ops.packing import to_device
from hybridflow.engine.rollout.decode_loop import (
    DECODE_K_SPLITS,
    Sampler,
    check_lengths,
    compiled_per_bucket,
    fused_sampler_available,
    make_sampler,
)
from hybridflow.engine.rollout.graphs import DecodeGraphs, buckets
from hybridflow.engine.rollout.kv_cache import KVCache
from hybridflow.engine.rollout.model import LlamaRunner
from hybridflow.engine.rollout.sampling import SamplingParams
from hybridflow.engine.rollout.scheduler import PrefillChunk, PromptGroup, SlotScheduler
from hybridflow.engine.rollout.state import REASONS, DecodeState
from hybridflow.engine.rollout.stats import GenerationStats, PhaseTimer
from hybridflow.engine.rollout.support import fallback_reason, graphs_fit, traceable
from hybridflow.engine.rollout.tp import RolloutTP
from hybridflow.engine.rollout.types import GenerationOutput
from hybridflow.models.families import fallback_notice
from hybridflow.utils.device import gpu_memory_limit
from hybridflow.utils.errors import UserError

if TYPE_CHECKING:
    from hybridflow.engine.rollout.paged_engine import PagedEngine

logger = logging.getLogger(__name__)

SLOT_GRANULE = 64  # a memory-bound slot count is a multiple of this (see slots_within_budget)


def slots_within_budget(wanted: int, fit: int) -> int:
    """KV-cache slots for a call that wants ``wanted`` when memory fits ``fit``: a multiple of SLOT_GRANULE
    when memory is the bound (and at least two granules fit).

    The compiled decode step is specialised on the cache's shape, so a slot count that moves with a few MB
    of other allocations between calls recompiles every batch bucket (~80 s in the second step of W2 at 1.5B
    on an H200, when 962 slots became 960). Rounding down keeps the count, and the compiled graphs, stable.
    """
    if fit >= wanted:
        return wanted
    if fit >= 2 * SLOT_GRANULE:
        return fit - fit % SLOT_GRANULE
    return fit


def one_wave_notice(wanted: int, slots: int, per_slot: int, used: int, total: int, utilization: float) -> str:
    """The advice when memory holds only ``slots`` of the ``wanted`` sequences: the utilization for one wave.

    ``used`` is what the KV cache cannot have (memory allocated at the call, less a kept cache).
    """
    need = math.ceil((used + wanted * per_slot) / total * 100) / 100
    fix = (
        f"rollout.gpu_memory_utilization={need:.2f} would hold all of them"
        if need <= 1
        else "they do not fit in one wave on this GPU even at rollout.gpu_memory_utilization=1; lower "
        "data.max_response_length or rollout.n, or offload (actor.fsdp.optimizer_offload=auto, in PPO "
        "critic.fsdp.optimizer_offload=auto too, or actor.fsdp.param_offload=true)"
    )
    return (
        f"the KV cache holds {slots} of {wanted} sequences at rollout.gpu_memory_utilization={utilization}, "
        f"so the rollout runs in waves (each wave decodes to the full length again); {fix}"
    )


class RolloutEngine:
    """Generates from token-id prompts with a model it does not own: it reads the HF module's parameters.

    ``generate`` allocates the KV cache, runs the prompts through continuous batching (waves when they do
    not all fit), and then, with ``free_cache_engine`` (the default), frees the cache and the runner's
    cast weight buffers so training gets the memory back; without it both stay for the next call.
    """

    def __init__(
        self,
        model: nn.Module,
        dtype: torch.dtype | None = None,
        max_num_seqs: int = 1024,
        max_num_batched_tokens: int = 8192,
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.5,
        sync_interval: int = 16,
        enforce_eager: bool = False,
        compile_decode: bool = False,
        free_cache_engine: bool = True,
        device: torch.device | None = None,
        tp: RolloutTP | None = None,
    ) -> None:
        """``tp``: ``model`` is this rank's tensor-parallel shard; every rank of the group must then call
        ``generate`` with the same prompts and seed (they sample the same tokens from the same logits)."""
        self.runner = LlamaRunner(model, dtype, max_model_len, device, tp)
        if self.runner.visual is not None:
            raise ValueError(
                "the slot engine runs text models; a vision-language model needs the paged engine"
            )
        self.tp = tp
        self.device = self.runner.device
        # torch.compile fuses the decode step's elementwise work (norms, RoPE, SiLU*mul); it compiles once
        # per batch bucket (tens of seconds each), so it pays off for long runs and benchmarks. Prefill's
        # layer math is compiled too (automatic dynamic shapes).
        # The step's bookkeeping (DecodeState.record: ~30 small eager kernels) is compiled too, into a few.
        self._decode, self._record = self.runner.decode, DecodeState.record
        if compile_decode and traceable(self.runner):
            self._decode = compiled_per_bucket(self.runner.decode, len(buckets(max_num_seqs)))
            self._record = compiled_per_bucket(DecodeState.record, len(buckets(max_num_seqs)))
            self.runner.compile_prefill()
            if self.device.type == "cuda" and self.runner.dtype in (torch.bfloat16, torch.float16):
                self.runner.k_splits = DECODE_K_SPLITS
        # Batch buckets whose decode step has run once (kernels compiled, cuBLAS warm), per call signature:
        # a later call with the same shapes and sampling captures its graphs without an eager warm-up step
        # (~10 ms at batch 256 on an H200). Anything that could recompile is in the key, so no compilation
        # ever runs under stream capture.
        self._warm_buckets: dict[tuple, set[int]] = {}
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.gpu_memory_utilization = gpu_memory_utilization
        self.sync_interval = sync_interval
        self.free_cache_engine = free_cache_engine
        self._kept_cache: KVCache | None = None  # the last call's cache, when free_cache_engine is off
        self._wave_notices: set[tuple[int, int]] = set()  # (wanted, slots) already reported as waves
        self.use_graphs = not enforce_eager and self.device.type == "cuda" and graphs_fit(self.runner)
        # Greedy and unfiltered sampling go through the fused Triton sampler on CUDA (one pass over the
        # logits, no float32 copy); settable, so tests can run it in Triton's CPU interpreter. It reads the LM
        # head's own dtype, so the runner hands over bf16 logits; sample() (filtered sampling) upcasts as it
        # reads, and bf16 -> float32 is exact, so it sees the same values as before.
        self.fused_sampler = fused_sampler_available(self.device)
        self.runner.float_logits = not self.fused_sampler
        self.last_stats = GenerationStats()  # of the last generate call
        self._lengths: list[list[int]] | None = None  # the call's per-sample response limits

    def _check_prompts(self, prompts: list[list[int]], params: SamplingParams) -> int:
        """Validate the prompts; return the cache length each slot needs."""
        if not prompts:
            raise ValueError("no prompts to generate from")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        longest = max(len(p) for p in prompts)
        max_len = self.max_model_len or longest + params.max_new_tokens
        limit = self.runner.max_position_embeddings
        if longest >= max_len or longest >= limit:
            raise UserError(
                f"a prompt of {longest} tokens leaves no room to generate within the context of "
                f"{min(max_len, limit)} tokens; shorten it or raise max_model_len (data.max_prompt_length)"
            )
        return min(max_len, limit)

    def _kv_budget(self, max_len: int, pending: int = 0) -> tuple[int, int, int, float]:
        """(bytes per slot of ``max_len`` tokens, bytes the cache cannot have, device bytes, cache budget).

        ``pending``: bytes about to be allocated before the cache (weight buffers the next refresh fills).
        """
        runner = self.runner
        per_slot = KVCache.bytes_per_token(
            runner.num_layers, runner.num_kv_heads, runner.head_dim, runner.dtype
        )
        total = gpu_memory_limit(self.device)  # the whole GPU, or trainer.gpu_memory_gb's share
        # What the cache cannot have: memory allocated now, less a cache kept from the last call (reused).
        kept = self._kept_cache.nbytes() if self._kept_cache is not None else 0
        used = torch.cuda.memory_allocated(self.device) - kept + pending
        return per_slot * max_len, used, total, self.gpu_memory_utilization * total - used

    def memory_shortfall(self, prompts: list[list[int]], params: SamplingParams) -> int:
        """Device bytes the KV cache lacks to decode all of this call's sequences at once (0: it fits).

        0 on CPU, where nothing is sized from memory. Counts the weight buffers the call fills first.
        """
        if self.device.type != "cuda":
            return 0
        max_len = self._check_prompts(prompts, params)
        wanted = min(self.max_num_seqs, len(prompts) * params.n)
        per_slot, _, _, budget = self._kv_budget(max_len, self.runner.pending_bytes())
        return max(0, math.ceil(wanted * per_slot - budget))

    def _num_slots(self, sequences: int, max_len: int) -> int:
        """Slots for this call: bounded by max_num_seqs, the work, and the memory budget on GPU."""
        slots = min(self.max_num_seqs, sequences)
        if self.device.type == "cuda":
            per_slot, used, total, budget = self._kv_budget(max_len)
            if budget < per_slot:
                raise ValueError(
                    f"no KV-cache slot of {max_len} tokens fits in rollout.gpu_memory_utilization="
                    f"{self.gpu_memory_utilization} of the GPU; raise it or lower max_model_len"
                )
            fit = int(budget // per_slot)
            if self.tp is not None:  # the ranks of a group must schedule alike: the smallest budget rules
                fit = int(funcol.all_reduce(torch.tensor([fit], device=self.device), "min", self.tp.group))
            wanted, slots = slots, slots_within_budget(slots, fit)
            if slots < wanted and (wanted, slots) not in self._wave_notices:  # once per shape, not every step
                self._wave_notices.add((wanted, slots))
                logger.warning(
                    one_wave_notice(wanted, slots, per_slot, used, total, self.gpu_memory_utilization)
                )
        return slots

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        progress: Callable[[int], None] | None = None,
        lengths: list[list[int]] | None = None,
    ) -> list[list[GenerationOutput]]:
        """``params.n`` responses for each prompt, in prompt order (greedy when ``params.greedy``).

        ``progress`` is called with the number of sequences that just finished, at each host sync.
        ``lengths``: per prompt and sample, a response limit below ``params.max_new_tokens`` (benchmarks
        draw long-tailed lengths with it).
        """
        max_len = self._check_prompts(prompts, params)
        self._lengths = check_lengths(lengths, len(prompts), params)
        if self.runner.refresh():  # the trainer may have stepped since the last call: re-cast in place
            self._warm_buckets.clear()  # new weight tensors: each bucket warms up eagerly again first
        groups = [PromptGroup(i, list(p), params.n) for i, p in enumerate(prompts)]
        slots = self._num_slots(len(prompts) * params.n, max_len)
        sched = SlotScheduler(slots, self.max_num_batched_tokens, groups)
        cache = self._cache(slots, max_len)
        eos = [] if params.ignore_eos else list(params.eos_token_ids)
        state = DecodeState(slots, params.max_new_tokens, list(params.stop_token_ids), eos, self.device)
        pick, generator = make_sampler(params, self.device, self.fused_sampler)
        results: list[list[GenerationOutput | None]] = [[None] * params.n for _ in prompts]
        graphs = self._graphs(slots, max_len, params, cache, state, pick, generator)
        timer, stats = PhaseTimer(self.device), GenerationStats(slots=slots)
        try:
            while not sched.done:
                calls = sched.admit()
                if calls:  # most syncs admit nothing: no events for an empty span
                    with timer.span("prefill"):
                        for call in calls:
                            self._prefill(call, cache, state, pick, max_len)
                            stats.prefill_tokens += sum(c.length for c in call)
                if graphs is not None and sched.num_running and params.max_new_tokens > 1:
                    graphs.prepare(sched.num_running)  # captures while the GPU runs the prefill just queued
                steps = self._steps_before_sync(state, sched.num_running, params)
                with timer.span("decode"):
                    for _ in range(steps):
                        if graphs is not None:
                            graphs.run(sched.num_running)
                        else:
                            self._decode_step(sched.num_running, cache, state, pick)
                stats.decode_steps += steps
                finished = self._retire(sched, cache, state, results)
                if progress is not None and finished:
                    progress(finished)
        finally:
            del graphs  # graphs hold the cache and weight tensors: drop them before freeing those
            self._park(cache)
        seconds = timer.close()
        stats.prefill_s, stats.decode_s = seconds.get("prefill", 0.0), seconds.get("decode", 0.0)
        # Tokens kept, not sequence-steps run: a sequence that stopped early rides along until the next sync.
        stats.decode_tokens = sum(len(s.token_ids) - 1 for group in results for s in group)
        self.last_stats = stats
        return results  # type: ignore[return-value]

    def _cache(self, slots: int, max_len: int) -> KVCache:
        """The KV cache for this call: the one kept from the last call if it has the shape, else a new one."""
        kept, self._kept_cache = self._kept_cache, None
        if kept is not None and (kept.num_slots, kept.max_len) == (slots, max_len):
            kept.storage.zero_()  # as if new: masked reads of unfilled positions see zeros, not stale K/V
            return kept
        if kept is not None:
            kept.free()
        r = self.runner
        return KVCache(r.num_layers, slots, max_len, r.num_kv_heads, r.head_dim, r.dtype, self.device)

    def _park(self, cache: KVCache) -> None:
        """After a call: free the cache and the cast weights (``free_cache_engine``), or keep the cache."""
        if self.free_cache_engine:
            cache.free()
            self.runner.release()  # re-allocated and re-filled by the next call's refresh()
        else:
            self._kept_cache = cache

    def _graphs(
        self,
        slots: int,
        max_len: int,
        params: SamplingParams,
        cache: KVCache,
        state: DecodeState,
        pick: Sampler,
        generator: torch.Generator | None,
    ) -> DecodeGraphs | None:
        """This call's CUDA graphs of the decode step, or None when graphs are off (CPU, enforce_eager)."""
        if not self.use_graphs:
            return None
        # Everything that could recompile the step is in the key of the warm buckets.
        signature = (slots, max_len, repr(dataclasses.replace(params, seed=None)), self.runner.k_splits)
        return DecodeGraphs(
            lambda b: self._decode_step(b, cache, state, pick),
            slots,
            generator,
            self._warm_buckets.setdefault(signature, set()),
        )

    def _prefill(
        self, call: list[PrefillChunk], cache: KVCache, state: DecodeState, pick: Sampler, max_len: int
    ) -> None:
        # Everything the host needs is built on the host and goes up through pinned memory (to_device): no
        # call here waits for the GPU, so the next chunk is queued while this one runs. A plain .to("cuda")
        # of a CPU tensor synchronises the stream: with nine of them per chunk the GPU idled ~4 ms per
        # 64 x 128-token chunk on an H200 while the host launched the next one.
        width = max(c.length for c in call)
        ids = torch.tensor(
            [c.group.token_ids[c.start : c.start + c.length] + [0] * (width - c.length) for c in call]
        )  # (b, t) right-padded
        dev = self.device
        lengths = torch.tensor([c.length for c in call])
        slot_ids = torch.tensor([c.group.first_slot for c in call])
        starts = torch.tensor([c.start for c in call])
        logits = self.runner.prefill(ids, lengths, slot_ids, starts, cache)  # (b, V)
        finished = [row for row, c in enumerate(call) if c.last]
        if not finished:
            return
        groups = [call[row].group for row in finished]
        for g in groups:  # prefix sharing: the n samples reuse the prompt's cache entries
            cache.copy_slot(g.first_slot, list(range(g.first_slot + 1, g.first_slot + g.n)), len(g.token_ids))
        repeat = to_device(torch.tensor([row for row, g in zip(finished, groups) for _ in range(g.n)]), dev)
        rows = logits[repeat]  # (sum n, V): each prompt's logits once per sample
        slots = to_device(torch.tensor([g.first_slot + s for g in groups for s in range(g.n)]), dev)
        prompt_len = to_device(torch.tensor([len(g.token_ids) for g in groups for _ in range(g.n)]), dev)
        state.start(slots, prompt_len, max_len)
        if self._lengths is not None:
            wanted = [self._lengths[g.index][k] for g in groups for k in range(g.n)]
            state.limit[slots] = torch.minimum(state.limit[slots], to_device(torch.tensor(wanted), dev))
        tokens, logprobs = pick(rows)
        state.record(slots, tokens, logprobs, advance=False)

    def _decode_step(self, num_running: int, cache: KVCache, state: DecodeState, pick: Sampler) -> None:
        live = slice(0, num_running)
        logits = self._decode(state.last_token[live], state.position[live], cache)  # (B, V)
        tokens, logprobs = pick(logits)
        self._record(state, live, tokens, logprobs, True)

    def _steps_before_sync(self, state: DecodeState, num_running: int, params: SamplingParams) -> int:
        """Decode steps to run before looking at the host again (one sync per call, never per token)."""
        if num_running == 0:
            return 0
        live = slice(0, num_running)
        left = torch.where(state.done[live], 0, state.limit[live] - state.gen_len[live])
        soonest = int(left[~state.done[live]].min()) if bool((~state.done[live]).any()) else 0
        if params.ignore_eos or (not params.eos_token_ids and not params.stop_token_ids):
            return soonest  # no early stops: the first length-finish is known exactly
        return min(self.sync_interval, soonest)

    def _retire(
        self,
        sched: SlotScheduler,
        cache: KVCache,
        state: DecodeState,
        results: list[list[GenerationOutput | None]],
    ) -> int:
        """Collect finished sequences, free and compact their slots; returns how many finished."""
        live = slice(0, sched.num_running)
        finished = state.done[live].nonzero().flatten().tolist()
        if not finished:
            return 0
        idx = torch.tensor(finished, device=self.device)
        lens = state.gen_len[idx].tolist()
        reasons = state.reason[idx].tolist()
        # One copy each to the host, then numpy's tolist per row: torch's tolist on a (256, 513) tensor cost
        # ~10 ms at batch 256, and only the generated prefix of each row is converted.
        tokens = state.tokens[idx].cpu().numpy()  # (F, W + 1)
        logprobs = state.logprobs[idx].cpu().numpy()
        for k, slot in enumerate(finished):
            prompt, sample_idx = sched.owner[slot]
            n = lens[k]
            results[prompt][sample_idx] = GenerationOutput(
                tokens[k, :n].tolist(), logprobs[k, :n].tolist(), REASONS[reasons[k]]
            )
        for src, dst in sched.release(finished):
            cache.move_slot(src, dst)
            state.move(src, dst)
        state.park(sched.num_running)
        return len(finished)


class HFRollout:
    """The same ``generate`` interface over transformers' ``generate`` (``rollout.engine=hf``, or a fallback).

    ``max_model_len`` caps prompt + response as the built-in engine does (each response stops at the model's
    position limit, or at this length when smaller).
    """

    def __init__(self, model: nn.Module, pad_token_id: int = 0, max_model_len: int | None = None) -> None:
        self.model = model
        self.pad_token_id = pad_token_id
        self.max_model_len = max_model_len

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        progress: Callable[[int], None] | None = None,
        mm_inputs: list[dict[str, torch.Tensor] | None] | None = None,
    ) -> list[list[GenerationOutput]]:
        """``params.n`` responses for each prompt through HF ``generate`` (``mm_inputs``: each one's images)."""
        from hybridflow.engine.rollout.hf_fallback import hf_generate

        out = hf_generate(self.model, prompts, params, self.pad_token_id, self.max_model_len, mm_inputs)
        if progress is not None:
            progress(len(prompts) * params.n)
        return out


def make_rollout(
    model: nn.Module, engine: str = "native", pad_token_id: int = 0, **kwargs
) -> PagedEngine | HFRollout:
    """The built-in engine (the paged one) when the architecture is supported, else HF ``generate`` with one
    warning (refused with ``kv_cache_dtype="fp8"``: HF generate keeps its own cache in the model's dtype)."""
    from hybridflow.engine.rollout.paged_engine import PagedEngine

    if engine not in ("native", "hf"):
        raise ValueError(f"unknown rollout engine {engine!r}; use native or hf")
    if engine == "native":
        reason = fallback_reason(model, kwargs.get("max_model_len"))
        if reason is None:
            return PagedEngine(model, **kwargs)
        logger.warning(fallback_notice(model.config, reason))
    if kwargs.get("kv_cache_dtype", "auto") != "auto":
        why = f"the built-in engine does not run this model ({reason})" if engine == "native" else "engine=hf"
        raise UserError(
            f"rollout.kv_cache_dtype={kwargs['kv_cache_dtype']} is the built-in paged engine's KV cache, and "
            f"{why}; set rollout.kv_cache_dtype=auto"
        )
    return HFRollout(model, pad_token_id, kwargs.get("max_model_len"))
