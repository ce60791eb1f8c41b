"""The paged rollout engine: a KV cache of fixed-size blocks shared through reference counts, and a step API
(``add``, ``step``, ``extend``, ``pause`` / ``resume``, ``abort``) with ``generate`` as the loop over it.

A step is one scheduling round, as nano-vllm's ``step()``: prefill what is new (admitted prompts, tokens
appended by ``extend``, sequences preempted or re-prefilled under new weights), reserve the blocks the next
decode steps write, preempting the youngest sequences when the pool runs short, run the decode steps on the
device with no host sync between them (CUDA graphs on GPU), then sync once and hand back what each sequence
sampled. The n samples of a prompt share its prefill and its full blocks; a block full of cached positions is
found again by its prefix hash (another request with the same prompt, a multi-turn continuation).

A running sequence holds a seat (``seats.Seats``) while it decodes. Its K and V are written for every token
but the last, which the next decode step feeds. Every token after the prompt records its log-prob and the
weight version that sampled it (-1: appended by ``extend``, never trained on).

``record_routing=True`` (a mixture of experts; off by default, and then free) keeps every fed token's experts
beside its K and V in the pool's blocks (``PagedKVCache.routing``, written inside prefill and the decode step)
and hands them out with each sample (``GenerationOutput.routed_experts``) as its blocks go back.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable

import torch
from torch import nn

from hybridflow.engine.ops.invariant import exact_on
from hybridflow.engine.rollout.block_pool import BlockPool, PoolExhausted
from hybridflow.engine.rollout.decode_loop import (
    DECODE_K_SPLITS,
    check_lengths,
    compiled_per_bucket,
    fused_sampler_available,
)
from hybridflow.engine.rollout.expert_exchange import ExpertExchange
from hybridflow.engine.rollout.graphs import buckets
from hybridflow.engine.rollout.kv_cache import PagedKVCache
from hybridflow.engine.rollout.model import LlamaRunner
from hybridflow.engine.rollout.multimodal import hash_keys, mm_prompt
from hybridflow.engine.rollout.sampling import SamplingParams
from hybridflow.engine.rollout.sequence import Sequence, positions_for, to_output
from hybridflow.engine.rollout.session import Session, SessionConfig, check_params
from hybridflow.engine.rollout.state import DecodeState
from hybridflow.engine.rollout.stats import GenerationStats
from hybridflow.engine.rollout.support import check_routing, graphs_fit, traceable
from hybridflow.engine.rollout.tp import RolloutTP
from hybridflow.engine.rollout.types import GenerationOutput
from hybridflow.utils.errors import UserError

logger = logging.getLogger(__name__)


class PagedEngine:
    """Generation over a paged KV cache; the keyword arguments are ``SessionConfig``'s.

    ``num_blocks``: the pool's blocks; None sizes it from ``gpu_memory_utilization`` on GPU and, on CPU, from
    the work (every sequence of a ``generate`` call at full length). ``block_size``: positions per block.
    ``kv_cache_dtype="fp8"``: K and V in e4m3 (half the bytes of bf16: twice the blocks in the same memory),
    their per-head scales set by the first prefill after each weight refresh (a session's start, ``resume``);
    so are FP8 projections' static activation scales (kernel ``scaled_mm_static``, ``ops.fp8``).
    """

    def __init__(
        self,
        model: nn.Module,
        num_blocks: int | None = None,
        block_size: int = 128,
        max_num_seqs: int = 256,
        dtype: torch.dtype | None = None,
        tp: RolloutTP | None = None,
        ep: ExpertExchange | None = None,
        **kwargs,
    ) -> None:
        """``tp``: ``model`` is this rank's tensor-parallel shard; every rank of the group makes the same calls
        (its cache holds its own KV heads; the ranks sample the same tokens from the same logits). ``ep``: its
        experts serve several rollout groups (ep > tp): ``generate`` settles with them before returning."""
        cfg = SessionConfig(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs, **kwargs)
        self.runner = LlamaRunner(model, dtype, cfg.max_model_len, kwargs.get("device"), tp, ep)
        self.tp = tp
        self.device = self.runner.device
        self.cfg = cfg
        self.max_num_seqs = max_num_seqs
        self.session: Session | None = None
        self.waiting: list[list[Sequence]] = []  # prompt groups not yet prefilled, first come first served
        self.running: list[Sequence] = []  # in admission order: the youngest last (preempted first)
        self.version = 0  # the weights' version: +1 at every resume after a refresh
        self.paused = False
        self.preemptions = 0
        self._concurrent: list[int] = []  # running sequences in each decode round
        self.stalled = False  # the last step could neither prefill nor decode anything
        self._by_id: dict[int, Sequence] = {}  # every sequence waiting or running
        self._pool: BlockPool | None = None  # the current (or last) session's
        self._ids = itertools.count()
        self.last_stats = GenerationStats()  # of the last session
        # The fused Triton sampler on CUDA (reads the compute-dtype logits), CUDA graphs of the decode step
        # unless enforce_eager, and with compile_decode the step compiled per batch bucket.
        # rollout.exact samples through the trainer's log-prob formula (``invariant.token_log_probs``).
        self.fused_sampler = fused_sampler_available(self.device) and not exact_on()
        self.runner.float_logits = not self.fused_sampler
        self.use_graphs = not cfg.enforce_eager and self.device.type == "cuda" and graphs_fit(self.runner)
        if cfg.record_routing:
            check_routing(self.runner.router)
        self.warm: dict[tuple, set[int]] = {}  # batch buckets run once, per session signature (see graphs)
        self.kept_cache: PagedKVCache | None = None  # the last session's, when free_cache_engine is off
        self.last_pool_blocks: int | None = None  # the last session's pool size
        self.fp8_logged = False  # rollout.kv_cache_dtype=fp8: the pool's line, at the first session
        self.decode_fn, self.record_fn = self.runner.decode_paged, DecodeState.record
        if cfg.compile_decode and not traceable(self.runner):
            cfg.compile_decode = False
        if cfg.compile_decode:
            self.decode_fn = compiled_per_bucket(self.runner.decode_paged, len(buckets(max_num_seqs)))
            self.record_fn = compiled_per_bucket(DecodeState.record, len(buckets(max_num_seqs)))
            self.runner.compile_prefill()
            if self.device.type == "cuda" and self.runner.dtype in (torch.bfloat16, torch.float16):
                self.runner.k_splits = DECODE_K_SPLITS

    # ---- the step API ----------------------------------------------------------------------------------

    def add(
        self,
        prompt: list[int],
        params: SamplingParams,
        max_new: int | None = None,
        mm_inputs: dict[str, torch.Tensor] | None = None,
    ) -> list[int]:
        """Queue a prompt's ``params.n`` samples; returns their sequence ids. ``max_new``: a response budget
        below ``params.max_new_tokens`` (a sample continued from a partial rollout has spent the rest).
        ``mm_inputs``: the prompt's images (a vision-language model), ``{"pixel_values": (P, D),
        "image_grid_thw": (I, 3)}`` as ``VisionProcessor.images_to_inputs`` gives them, its image pads expanded
        in ``prompt``; None for a text-only prompt."""
        if params.n > self.max_num_seqs:
            raise UserError(
                f"n={params.n} samples cannot run at once with max_num_seqs={self.max_num_seqs}; raise "
                "rollout.max_num_seqs (--max-num-seqs) or lower rollout.n"
            )
        if not prompt:
            raise ValueError("a prompt needs at least one token")
        limit = self.max_len
        if len(prompt) >= limit:
            raise UserError(
                f"a prompt of {len(prompt)} tokens leaves no room to generate within the context of {limit} "
                "tokens; shorten it or raise max_model_len (data.max_prompt_length)"
            )
        if self.session is not None:
            check_params(self.session.params, params)
        mm = mm_prompt(prompt, mm_inputs, self.runner.image_token_id, self.runner.merge_size)
        room = limit - len(prompt)  # the response stops at the context's end
        budget = room if room < params.max_new_tokens else 0
        if max_new is not None:
            budget = min(max_new, room)
        group = [
            Sequence(next(self._ids), list(prompt), len(prompt), params, max_new=budget, mm=mm)
            for _ in range(params.n)
        ]
        self._by_id.update((s.id, s) for s in group)
        self.waiting.append(group)
        return [s.id for s in group]

    def step(self, max_tokens: int | None = 1, fetch_all: bool = True) -> list[Sequence]:
        """One scheduling round: prefills, then up to ``max_tokens`` decode steps for every running sequence
        (None: until the next sequence could finish, at least ``sync_interval`` steps when others go on).
        Returns the sequences that got tokens; finished ones have left the engine (blocks back in the pool).

        ``fetch_all=False`` (``generate``) copies to the host only the tokens of sequences that finished; the
        others' stay on the device (``Sequence.pending``) until they finish or leave their seat."""
        if self.paused or not self.has_work:
            return []
        session = self._open()
        touched = {s.id: s for s in self.running if s.finish_reason is not None}  # ended by extend's budget
        for s in touched.values():
            self._release(s)
        prefilled = self._prefill_round(session)
        steps = self._reserve(session, max_tokens)
        self.stalled = not (prefilled or steps or session.seats.num_used)
        if steps:
            session.decode(steps)
            self._concurrent.append(session.seats.num_used)
        seated, (gen, ended) = self._seated(), session.seats.counts()
        fetch = [i for i, reason in enumerate(ended) if fetch_all or reason is not None]
        for i, (tokens, logprobs) in zip(fetch, session.seats.fetch(fetch, gen)):
            self._take(seated[i], tokens, logprobs, finished=ended[i] is not None)
            touched[seated[i].id] = seated[i]
        for i, s in enumerate(seated):
            s.pending = gen[i] - session.seats.synced[i]
            s.finish_reason = ended[i]
        for s in touched.values():
            if s.finish_reason is not None and s in self.running:
                self._release(s)
        if not self.has_work:
            self._close()
        return list(touched.values())

    def extend(self, seq_id: int, token_ids: list[int]) -> None:
        """Append tokens that were not sampled (a tool's output) to a running sequence: prefilled at the next
        step, never trained on; the next sampled token follows them. Tokens that spend the response budget
        (``max_new_tokens`` counts every token after the prompt) end the sequence ("length") at the next step."""
        s = self._running(seq_id)
        self._unseat(s)  # its sampled tokens come first; it decodes again after its catch-up prefill
        s.tokens += token_ids
        s.logprobs += [math.nan] * len(token_ids)
        s.versions += [-1] * len(token_ids)
        if len(s.tokens) >= s.budget_end:
            s.finish_reason = "length"

    def pause(self) -> None:
        """Hold every sequence as it is (the weights may change in place meanwhile); ``step`` does nothing."""
        self.paused = True

    def resume(self, weights_changed: bool = True) -> None:
        """Go on. With new weights every cached K and V is stale: each running sequence is prefilled again
        under the new weights at the next step (so it continues as a fresh run from its tokens would)."""
        if weights_changed:
            self.version += 1
            for s in list(self.running):
                self._preempt(s, count=False)
            if self.session is not None:
                self.session.pool.forget_prefixes()
                self.session.refresh_weights()
        self.paused = False

    def abort(self, seq_ids: list[int]) -> list[Sequence]:
        """Stop these sequences now; returns each with its tokens and log-probs so far (finish "abort")."""
        wanted, out = set(seq_ids), []
        for s in list(self.running):
            if s.id in wanted:
                s.finish_reason = "abort"
                self._release(s)
                out.append(s)
        for group in self.waiting:
            for s in [s for s in group if s.id in wanted]:
                s.finish_reason = "abort"
                group.remove(s)
                del self._by_id[s.id]
                out.append(s)
        self.waiting = [g for g in self.waiting if g]
        if not self.has_work:
            self._close()
        return out

    def reset_stats(self) -> None:
        """Start the figures of a new call (``stats``): preemptions and the decode batch sizes."""
        self.preemptions, self._concurrent = 0, []

    @property
    def has_work(self) -> bool:
        """Whether any sequence is waiting or running."""
        return bool(self.running or self.waiting)

    @property
    def pool(self) -> BlockPool:
        """The block pool of the current (or last) session."""
        assert self._pool is not None, "no session has run yet"
        return self._pool

    @property
    def max_len(self) -> int:
        """The most positions a sequence may take (the model's, or ``max_model_len``)."""
        return min(self.cfg.max_model_len or math.inf, self.runner.max_position_embeddings)

    def stats(self) -> dict[str, float]:
        """The engine's figures so far, under the trainer's metric names (``rollout/*``)."""
        s = (
            self.last_stats
            if self.session is None
            else self.session.stats(self._concurrent, self.preemptions)
        )
        return {
            "rollout/kv_blocks_used": s.kv_blocks_used,
            "rollout/concurrent_seqs_mean": s.concurrent_seqs_mean,
            "rollout/concurrent_seqs_peak": s.concurrent_seqs_peak,
            "rollout/prefix_cache_hit_rate": s.prefix_cache_hit_rate,
            "rollout/preemptions": s.preemptions,
        }

    # ---- generate: the loop over the step API ----------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        progress: Callable[[int], None] | None = None,
        lengths: list[list[int]] | None = None,
        mm_inputs: list[dict[str, torch.Tensor] | None] | None = None,
    ) -> list[list[GenerationOutput]]:
        """Every prompt's ``params.n`` samples: ``add`` each, then ``step`` until all have finished.

        ``progress`` is called with the number of sequences that just finished, after each round.
        ``lengths``: per prompt and sample, a response limit below ``params.max_new_tokens``.
        ``mm_inputs``: per prompt, its images or None (``add``)."""
        lengths = check_lengths(lengths, len(prompts), params)
        if self.has_work:
            raise ValueError("generate needs an idle engine; finish or abort the sequences added with add()")
        if not prompts:
            raise ValueError("no prompts to generate from")
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if mm_inputs is not None and len(mm_inputs) != len(prompts):
            raise ValueError(f"{len(mm_inputs)} mm_inputs for {len(prompts)} prompts")
        self.reset_stats()
        mm_inputs = [None] * len(prompts) if mm_inputs is None else mm_inputs
        ids = [self.add(p, params, mm_inputs=mm) for p, mm in zip(prompts, mm_inputs)]
        for k, group in enumerate(self.waiting if lengths is not None else []):
            for s, limit in zip(group, lengths[k]):
                s.max_new = min(limit, s.budget_end - s.prompt_len)
        self._open(demand=(len(prompts) * params.n, max(map(len, prompts)) + params.max_new_tokens))
        done: dict[int, Sequence] = {}
        while len(done) < len(prompts) * params.n:
            touched = self.step(max_tokens=None, fetch_all=False)
            if self.stalled:  # nothing could run: a sequence longer than the whole pool
                pool = self.pool
                self.abort([i for group in ids for i in group])
                raise UserError(
                    f"the KV pool's {pool.num_free} free blocks of {pool.block_size} positions cannot hold the "
                    "next sequence; raise rollout.gpu_memory_utilization or lower max_model_len"
                )
            finished = [s for s in touched if s.finish_reason is not None]
            done.update((s.id, s) for s in finished)
            if progress is not None and finished:
                progress(len(finished))
        self.runner.settle()  # ep > tp: serve the other rollout groups' MoE layers until they are done too
        return [[to_output(done[i]) for i in group] for group in ids]

    def memory_shortfall(self, prompts: list[list[int]], params: SamplingParams) -> int:
        """Device bytes the pool lacks to hold every sequence of this call at full length at once (0: fits)."""
        if self.device.type != "cuda":
            return 0
        count, length = len(prompts) * params.n, max(map(len, prompts)) + params.max_new_tokens
        return Session.shortfall(self.runner, self.cfg, count, min(length, self.max_len))

    # ---- scheduling --------------------------------------------------------------------------------------

    def _open(self, demand: tuple[int, int] | None = None) -> Session:
        """The current session, or a new one: the pool, the cache and the seats, sized for the work."""
        if self.session is None:
            params = (self.waiting[0][0] if self.waiting else self.running[0]).params
            # The step API's requests are not known ahead: room for any length, max_num_seqs of them.
            count, length = demand or (self.max_num_seqs, self.max_len)
            seats = min(count, self.max_num_seqs)
            self.session = Session(self, params, seats, count, min(length, self.max_len))
            self._pool = self.session.pool
        return self.session

    def _close(self) -> None:
        """End the session: free the cache and the cast weights (``free_cache_engine``), keep the figures."""
        if self.session is not None:
            self.session.close()
            self.last_stats = self.session.stats(self._concurrent, self.preemptions)
            self.session = None

    def _prefill_round(self, session: Session) -> bool:
        """Catch-up prefills (extended, preempted, re-weighted) and then new prompt groups, while seats and
        blocks allow; each gets its first sampled token."""
        seats, jobs, groups = session.seats, [], []
        for s in self.running:  # seats this round's prefills take count against the free ones
            free = seats.num_used + len(jobs) < seats.num_seats
            if free and s.seat is None and s.finish_reason is None and self._seat(s, session):
                jobs.append(s)
        taken = seats.num_used + len(jobs)
        while self.waiting and taken + len(self.waiting[0]) <= seats.num_seats:
            if not self._admit(self.waiting[0], session, taken):
                break
            group = self.waiting.pop(0)
            self.running += group
            groups.append(group)
            taken += len(group)
        rows = [[s] for s in jobs] + [[g[0]] for g in groups]
        if not rows:
            return False
        session.prefill([(r[0], r[0].written) for r in rows])
        for group in groups:  # the samples share the prompt's full blocks and copy a partial one
            first = group[0]
            for s in group[1:]:
                s.table, copy = session.pool.fork(first.table)
                if copy is not None:
                    session.cache.copy_block(copy[0] + 1, copy[1] + 1)
                s.written = first.written
        for s in jobs + [s for g in groups for s in g]:
            s.written = len(s.tokens)
            s.seat = seats.take(s.id)
            seats.set_table(s.seat, s.table.blocks)
        session.first_tokens(jobs, groups)
        return True

    def _seat(self, s: Sequence, session: Session) -> bool:
        """Room for a running sequence's catch-up prefill: its blocks for every token; False when short."""
        pool = session.pool
        if s.table is None:
            if not pool.can_allocate(hash_keys(s)):
                return False
            s.table = pool.allocate(hash_keys(s))
            s.written = s.table.cached_tokens
            return True
        try:
            pool.reserve(s.table, len(s.tokens))
        except PoolExhausted:
            self._preempt(s)  # its blocks go back; it is prefilled again from the start when there is room
            return False
        return True

    def _admit(self, group: list[Sequence], session: Session, taken: int) -> bool:
        """Blocks for a group's prompt (and the samples' own partial blocks), leaving a block of growth per
        seat taken (``taken`` before this group); False when short."""
        pool, first, n = session.pool, group[0], len(group)
        partial = 1 if len(first.tokens) % pool.block_size else 0
        headroom = taken + n
        if (
            not pool.can_allocate(hash_keys(first))
            or pool.num_free < pool.blocks_for(len(first.tokens)) + (n - 1) * partial + headroom
        ):
            return False
        first.table = pool.allocate(hash_keys(first))
        first.written = first.table.cached_tokens
        return True

    def _reserve(self, session: Session, max_tokens: int | None) -> int:
        """Decode steps for this round, with the blocks they write reserved; preempts the youngest when the
        pool cannot hold one step for every running sequence."""
        while True:
            seated = self._seated()
            if not seated:
                return 0
            # Tokens each may still sample. With no early stop possible (ignore_eos, or no EOS) the round runs
            # until the first sequence ends by length, but at least sync_interval steps while others go on
            # (a finished sequence rides along until the sync: fewer syncs for ragged lengths);
            # with EOS, sync_interval steps. 0 everywhere: all finished at prefill, nothing to decode.
            left = [s.budget_end - len(s.tokens) - s.pending for s in seated]
            if max(left) <= 0:
                return 0
            soonest, bound = min(x for x in left if x > 0), min(self.cfg.sync_interval, max(left))
            steps = max(soonest, bound) if session.params_never_stop else bound
            if max_tokens is not None:
                steps = min(steps, max_tokens)
            while True:
                need = sum(session.pool.blocks_to_reserve(s.table, positions_for(s, steps)) for s in seated)
                if need <= session.pool.num_free or steps == 1:
                    break
                steps = max(1, steps // 2)
            if need <= session.pool.num_free:
                break
            self._preempt(next(s for s in reversed(self.running) if s.seat is not None))  # the youngest
        for s in seated:
            if session.pool.blocks_to_reserve(s.table, positions_for(s, steps)):
                session.pool.reserve(s.table, positions_for(s, steps))
                session.seats.set_table(s.seat, s.table.blocks)
        return steps

    def _take(self, s: Sequence, tokens: list[int], logprobs: list[float], finished: bool = False) -> None:
        """Hand a seat's newly sampled tokens to its sequence and hash the blocks they fill.

        A sequence that finished rode along until this sync feeding its last token at its last fed position
        again, so that position's K and V are stale: its block is not hashed (no later sequence finds it)."""
        s.tokens += tokens
        s.logprobs += logprobs
        s.versions += [self.version] * len(tokens)
        s.pending = 0
        self.session.counts.decode_tokens += len(tokens)
        s.written = len(s.tokens) - 1  # every token but the last is in the cache
        self.session.pool.record(s.table, hash_keys(s), s.written - finished)

    def _seated(self) -> list[Sequence]:
        """The sequences holding seats, in seat order."""
        return [self._by_id[i] for i in self.session.seats.owner] if self.session is not None else []

    def _unseat(self, s: Sequence) -> None:
        """Take a sequence off the decode batch, its tokens still on the device fetched first."""
        if s.seat is None or self.session is None:
            return
        seats = self.session.seats
        if s.pending:
            gen = list(seats.synced)
            gen[s.seat] += s.pending
            ((tokens, logprobs),) = seats.fetch([s.seat], gen)
            self._take(s, tokens, logprobs)
        moved = seats.leave(s.seat)
        if moved is not None:
            self._by_id[moved].seat = s.seat
        s.seat = None

    def _preempt(self, s: Sequence, count: bool = True) -> None:
        """Free a running sequence's blocks; it keeps its tokens and is prefilled again later."""
        self._unseat(s)
        if s.table is not None:
            self.session.pool.free(s.table)
        s.table, s.written = None, 0
        self.preemptions += count

    def _release(self, s: Sequence) -> None:
        self._unseat(s)
        self.running.remove(s)
        del self._by_id[s.id]
        if s.table is not None:
            if self.session.cache.routing is not None:  # the records of every position in the cache
                s.routing = self.session.cache.routing_of([b + 1 for b in s.table.blocks], s.written)
            self.session.pool.free(s.table)
            s.table = None

    def _running(self, seq_id: int) -> Sequence:
        s = self._by_id.get(seq_id)
        if s is None or s not in self.running:
            raise KeyError(f"sequence {seq_id} is not running (finished, aborted or not yet admitted)")
        return s
