"""The paged rollout engine's step API (issue 41, CPU reference): ``add``, ``step``, ``extend``, ``pause`` /
``resume``, ``abort``, and ``generate`` as the loop over them. Not yet the trainer's engine (``engine.py``'s
slot engine is, with its CUDA graphs and fused kernels); this is the functional reference the GPU path
will match, on the runner's paged path (``LlamaRunner.prefill_paged`` / ``decode_paged``).

A sequence is running once its prompt is prefilled. Its K and V are written for every token but the last,
which the next decode step feeds (``written == len(tokens) - 1``). Tokens appended by ``extend`` (a tool's
output), a sequence preempted for want of blocks, and every sequence after ``resume`` with new weights
need a catch-up prefill of the tokens not written; a step runs those first, then one decode step for the
rest. The n samples of a prompt share its prefill and its full blocks. Every token after the prompt records
whether it was sampled (trainable), its log-prob, and the weight version that sampled it (-1: extended).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from hybridflow.engine.rollout.block_pool import BlockPool, BlockTable, PoolExhausted
from hybridflow.engine.rollout.model import LlamaRunner
from hybridflow.engine.rollout.paged_cache import PagedKVCache
from hybridflow.engine.rollout.sampling import SamplingParams, make_generator, sample
from hybridflow.engine.rollout.tp import RolloutTP
from hybridflow.engine.rollout.types import GenerationOutput


@dataclass
class Sequence:
    """One sample: its tokens, what the engine knows of them, and how it ended (None while it runs)."""

    id: int
    tokens: list[int]
    prompt_len: int
    params: SamplingParams
    logprobs: list[float] = field(default_factory=list)  # per token after the prompt (nan: extended)
    versions: list[int] = field(default_factory=list)  # per token after the prompt: weights that sampled it
    table: BlockTable | None = None
    written: int = 0  # leading tokens whose K and V are in the cache
    finish_reason: str | None = None

    @property
    def response(self) -> list[int]:
        """The tokens after the prompt (sampled and extended)."""
        return self.tokens[self.prompt_len :]

    @property
    def trainable(self) -> list[bool]:
        """Per token after the prompt: sampled by the policy (True) or extended (False)."""
        return [v >= 0 for v in self.versions]


class PagedEngine:
    """Generation over a paged KV cache of ``num_blocks`` blocks of ``block_size`` positions."""

    def __init__(
        self,
        model: nn.Module,
        num_blocks: int = 256,
        block_size: int = 16,
        max_num_seqs: int = 256,
        dtype: torch.dtype | None = None,
        tp: RolloutTP | None = None,
    ) -> None:
        """``tp``: ``model`` is this rank's tensor-parallel shard; every rank of the group makes the same calls
        (its cache holds its own KV heads; the ranks sample the same tokens from the same logits)."""
        self.runner = LlamaRunner(model, dtype, tp=tp)
        r = self.runner
        self.pool = BlockPool(num_blocks, block_size)
        self.cache = PagedKVCache(
            r.num_layers, num_blocks, block_size, r.num_kv_heads, r.head_dim, r.dtype, r.device
        )
        self.max_num_seqs = max_num_seqs
        self.waiting: list[list[Sequence]] = []  # prompt groups not yet prefilled, first come first served
        self.running: list[Sequence] = []  # in admission order: the youngest last (preempted first)
        self.version = 0  # the weights' version: +1 at every resume after a refresh
        self.paused = False
        self.preemptions = 0
        self._concurrent: list[int] = []  # running sequences after each step that ran
        self._ids = itertools.count()
        self._generators: dict[int | None, torch.Generator | None] = {}

    def add(self, prompt: list[int], params: SamplingParams) -> list[int]:
        """Queue a prompt's ``params.n`` samples; returns their sequence ids."""
        if params.n > self.max_num_seqs:
            raise ValueError(
                f"n={params.n} samples cannot run at once with max_num_seqs={self.max_num_seqs}; raise max_num_seqs"
            )
        limit = self.runner.max_position_embeddings
        if not prompt or len(prompt) + params.max_new_tokens > limit:
            raise ValueError(
                f"a prompt of {len(prompt)} tokens with max_new_tokens={params.max_new_tokens} does not fit the "
                f"model's {limit} positions (and a prompt needs at least one token); shorten one of them"
            )
        group = [Sequence(next(self._ids), list(prompt), len(prompt), params) for _ in range(params.n)]
        self.waiting.append(group)
        return [s.id for s in group]

    def step(self) -> list[Sequence]:
        """One scheduling round: catch-up prefills, new prompts while blocks and seats allow, then one decode
        step for every other running sequence. Returns the sequences that got tokens (finished ones freed)."""
        if self.paused:
            return []
        touched = [s for s in self.running if s.finish_reason is not None]  # ended by extend's budget
        touched += [
            s
            for s in list(self.running)
            if s.finish_reason is None and s.written < len(s.tokens) - 1 and self._catch_up(s)
        ]
        while self.waiting and len(self.running) + len(self.waiting[0]) <= self.max_num_seqs:
            if not self._admit(self.waiting[0]):
                break
            touched += self.waiting.pop(0)
        ready = [
            s
            for s in self.running
            if s.written == len(s.tokens) - 1 and s not in touched and s.finish_reason is None
        ]
        touched += self._decode(ready)
        self._concurrent.append(len(self.running))
        for s in touched:
            if s.finish_reason is not None and s in self.running:
                self._release(s)
        return touched

    def stats(self) -> dict[str, float]:
        """The engine's figures so far, under the trainer's metric names (``rollout/*``)."""
        steps = self._concurrent or [0]
        return {
            "rollout/kv_blocks_used": self.pool.stats.peak_used / len(self.pool.blocks),  # peak fraction
            "rollout/concurrent_seqs_mean": sum(steps) / len(steps),
            "rollout/concurrent_seqs_peak": float(max(steps)),
            "rollout/prefix_cache_hit_rate": self.pool.stats.hit_rate,
            "rollout/preemptions": float(self.preemptions),
        }

    def extend(self, seq_id: int, token_ids: list[int]) -> None:
        """Append tokens that were not sampled (a tool's output) to a running sequence: prefilled at the next
        step, never trained on; the next sampled token follows them. Tokens that spend the response budget
        (``max_new_tokens`` counts every token after the prompt) end the sequence ("length") at the next step."""
        s = self._running(seq_id)
        s.tokens += token_ids
        s.logprobs += [math.nan] * len(token_ids)
        s.versions += [-1] * len(token_ids)
        if len(s.response) >= s.params.max_new_tokens:  # the response budget is spent: it ends here
            s.finish_reason = "length"
            return
        if s.table is None:  # preempted: its next prefill covers these tokens too
            return
        try:
            self.pool.append(s.table, token_ids, s.tokens)
        except PoolExhausted:  # no room now: prefill it again from the start when there is
            self._preempt(s)

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
            self.pool.forget_prefixes()
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
                out.append(s)
        self.waiting = [g for g in self.waiting if g]
        return out

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[GenerationOutput]]:
        """Every prompt's ``params.n`` samples: ``add`` each, then ``step`` until all have finished."""
        ids = [self.add(p, params) for p in prompts]
        done: dict[int, Sequence] = {}
        while len(done) < sum(map(len, ids)):
            touched = self.step()
            if not touched:  # nothing could run: a sequence longer than the whole pool
                raise ValueError(
                    f"the KV pool's {self.pool.num_free} free blocks of {self.pool.block_size} positions cannot "
                    "hold the next sequence; give the engine more blocks"
                )
            done.update((s.id, s) for s in touched if s.finish_reason is not None)
        return [[_output(done[i]) for i in group] for group in ids]

    @property
    def has_work(self) -> bool:
        """Whether any sequence is waiting or running."""
        return bool(self.running or self.waiting)

    def _admit(self, group: list[Sequence]) -> bool:
        """Prefill a group's prompt once and fork it to the other samples; False when blocks are short."""
        first, n = group[0], len(group)
        if (
            not self.pool.can_allocate(first.tokens)
            or self.pool.num_free < self.pool.blocks_for(len(first.tokens)) + n - 1
        ):
            return False
        first.table = self.pool.allocate(first.tokens)
        logits = self._prefill(first, first.table.cached_tokens)  # (1, V)
        for s in group[1:]:
            s.table, copy = self.pool.fork(first.table)
            if copy is not None:
                self.cache.copy_block(*copy)
            s.written = first.written
        self.running += group
        self._take(group, logits.expand(n, -1))
        return True

    def _catch_up(self, s: Sequence) -> bool:
        """Prefill what a running sequence has not written (extended or re-admitted); False when blocks are short."""
        if s.table is None:
            if not self.pool.can_allocate(s.tokens):
                return False
            s.table = self.pool.allocate(s.tokens)
            s.written = 0
        self._take([s], self._prefill(s, max(s.written, s.table.cached_tokens)))
        return True

    def _prefill(self, s: Sequence, start: int) -> torch.Tensor:
        """Write ``s.tokens[start:]`` (at least the last token) and return the logits after it (1, V)."""
        start = min(start, len(s.tokens) - 1)
        ids = torch.tensor([s.tokens[start:]], device=self.runner.device)
        logits = self.runner.prefill_paged(
            ids,
            torch.tensor([ids.shape[1]], device=ids.device),
            torch.tensor([start], device=ids.device),
            self.cache,
            self._tables([s]),
        )
        s.written = len(s.tokens)
        return logits

    def _decode(self, seqs: list[Sequence]) -> list[Sequence]:
        """One decode step for ``seqs`` (each feeds its last token), preempting the youngest for blocks."""
        seqs = [s for s in seqs if s in self.running]
        if not seqs:
            return []
        ids = torch.tensor([s.tokens[-1] for s in seqs], device=self.runner.device)  # (B,)
        positions = torch.tensor([len(s.tokens) - 1 for s in seqs], device=self.runner.device)  # (B,)
        logits = self.runner.decode_paged(ids, positions, self.cache, self._tables(seqs))  # (B, V)
        for s in seqs:
            s.written = len(s.tokens)
        self._take(seqs, logits)
        return seqs

    def _take(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Sample each sequence's next token from its logits row (B, V), record it, grow its table, check the
        end. Rows of the same sampling parameters are sampled together."""
        picked: dict[int, tuple[int, float]] = {}
        for params in {id(s.params): s.params for s in seqs}.values():
            rows = [i for i, s in enumerate(seqs) if s.params is params]
            tokens, logprobs = sample(logits[rows], params, self._generator(params))
            picked.update(zip(rows, zip(tokens.tolist(), logprobs.tolist())))
        for i, s in enumerate(seqs):
            token, logprob = picked[i]
            s.tokens.append(token)
            s.logprobs.append(logprob)
            s.versions.append(self.version)
            s.finish_reason = _finish(s, token)
            if s.finish_reason is None and s.table is not None:  # a preempted one is prefilled again later
                self._grow(s, token)

    def _grow(self, s: Sequence, token: int) -> None:
        """Room in the table for the new token's position, preempting the youngest others when short."""
        while True:
            try:
                self.pool.append(s.table, [token], s.tokens)
                return
            except PoolExhausted:
                victim = next((v for v in reversed(self.running) if v is not s and v.table is not None), None)
                if victim is None:
                    self._preempt(s)
                    return
                self._preempt(victim)

    def _preempt(self, s: Sequence, count: bool = True) -> None:
        """Free a running sequence's blocks; it keeps its tokens and is prefilled again later."""
        if s.table is not None:
            self.pool.free(s.table)
        s.table, s.written = None, 0
        self.preemptions += count

    def _release(self, s: Sequence) -> None:
        self.running.remove(s)
        if s.table is not None:
            self.pool.free(s.table)
            s.table = None

    def _running(self, seq_id: int) -> Sequence:
        s = next((s for s in self.running if s.id == seq_id), None)
        if s is None:
            raise KeyError(f"sequence {seq_id} is not running (finished, aborted or not yet admitted)")
        return s

    def _tables(self, seqs: list[Sequence]) -> torch.Tensor:
        width = max(len(s.table.blocks) for s in seqs)
        rows = [s.table.blocks + [0] * (width - len(s.table.blocks)) for s in seqs]
        return torch.tensor(rows, device=self.runner.device)  # (B, width)

    def _generator(self, params: SamplingParams) -> torch.Generator | None:
        if params.seed not in self._generators:
            self._generators[params.seed] = make_generator(params.seed, self.runner.device)
        return self._generators[params.seed]


def _finish(s: Sequence, token: int) -> str | None:
    p = s.params
    if token in p.eos_token_ids and not p.ignore_eos:
        return "eos"
    if token in p.stop_token_ids:
        return "stop"
    return "length" if len(s.tokens) - s.prompt_len >= p.max_new_tokens else None


def _output(s: Sequence) -> GenerationOutput:
    return GenerationOutput(s.response, s.logprobs, s.finish_reason or "length")
