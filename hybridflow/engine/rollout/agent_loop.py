"""Multi-turn episodes with tools on the paged engine, token in and token out.

An episode is one sample of a prompt: the policy generates an assistant turn until it ends it (EOS or a stop
token); the environment (``respond``) reads the turn, runs any tool it calls and answers with the tokens to
append (the tool's output rendered as a tool turn by the chat template, ending with the next assistant
header), or None to end the episode. The appended tokens are never trained on (mask 0, log-prob nan); the
next turn continues from every token so far (the prompt's and the earlier turns' blocks are found again by
their prefix hashes, so only the new tokens are prefilled). Nothing is ever re-tokenised: the tokens the policy
sampled are the tokens it is trained on.

Many episodes run at once in one engine; the environment's answers come from a thread pool, so a slow tool
holds only its own episode. In a tensor-parallel rollout group every rank must add the same sequences at the
same step: ``agree`` (rank 0's view, broadcast) decides which answers are taken in each round.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Protocol

from hybridflow.engine.rollout.engine import PagedEngine
from hybridflow.engine.rollout.sampling import SamplingParams


@dataclass
class ToolTurn:
    """The environment's answer to an assistant turn: tokens to append, and what the tools did."""

    tokens: list[int]
    calls: int = 0
    errors: int = 0  # calls that failed, malformed ones included
    parse_errors: int = 0  # malformed calls (of ``errors``)
    skipped: int = 0  # calls past the per-turn cap, answered with an error and not run (of ``errors``)


@dataclass
class Episode:
    """One sample's episode: its response (every turn and tool output) and its bookkeeping."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)  # after the prompt: sampled and appended
    logprobs: list[float] = field(default_factory=list)  # nan on appended tokens
    mask: list[int] = field(default_factory=list)  # 1: sampled by the policy, 0: a tool's output
    turns: int = 0  # assistant turns
    tool_turns: int = 0  # answers appended
    tool_calls: int = 0
    tool_errors: int = 0
    tool_parse_errors: int = 0
    tool_skipped: int = 0
    finish_reason: str | None = None


class Environment(Protocol):
    """What answers an assistant turn (``workers`` builds one from the tools and the chat template)."""

    def respond(self, episode: Episode, turn: list[int]) -> ToolTurn | None:
        """The tokens to append after ``turn`` (the assistant turn just generated), or None: the episode ends."""


@dataclass
class LoopLimits:
    """``rollout.multi_turn``'s bounds: assistant turns, and the whole response (tool tokens count)."""

    max_assistant_turns: int
    max_response_length: int
    workers: int = 8  # threads answering turns at once


def _same(x: Any) -> Any:
    return x


class AgentLoop:
    """Runs episodes on one engine until each ends (see the module doc)."""

    def __init__(
        self, engine: PagedEngine, env: Environment, limits: LoopLimits, agree: Callable[[Any], Any] = _same
    ) -> None:
        self.engine, self.env, self.limits, self.agree = engine, env, limits, agree

    def run(
        self, prompts: list[list[int]], params: SamplingParams, progress: Callable[[int], None] | None = None
    ) -> list[list[Episode]]:
        """``params.n`` episodes per prompt; returns them per prompt, in order (``progress(1)`` as each ends)."""
        self.progress = progress or (lambda n: None)
        if self.engine.has_work:
            raise ValueError("the agent loop needs an idle engine")
        self.engine.reset_stats()
        groups = [[Episode(list(p)) for _ in range(params.n)] for p in prompts]
        flat = [e for g in groups for e in g]
        one = dataclasses.replace(params, n=1)
        running: dict[int, int] = {}  # sequence id -> episode index
        for i, e in enumerate(flat):
            running[self._add(e, one)] = i
        pending: dict[int, Future] = {}  # episode index -> its environment answer
        with ThreadPoolExecutor(max_workers=self.limits.workers, thread_name_prefix="tools") as pool:
            while running or pending:
                self._take_answers(flat, pending, running, one)
                if not running:
                    if pending:  # every episode waits for a tool: nothing to decode meanwhile
                        wait(list(pending.values()), timeout=0.05, return_when=FIRST_COMPLETED)
                    continue
                for seq in self.engine.step(max_tokens=self.engine.cfg.sync_interval, fetch_all=False):
                    if seq.finish_reason is None or seq.id not in running:
                        continue
                    i = running.pop(seq.id)
                    self._end_turn(flat[i], seq)
                    if self._continues(flat[i]):
                        pending[i] = pool.submit(self.env.respond, flat[i], list(seq.response))
                    else:
                        self.progress(1)
        return groups

    def _add(self, e: Episode, params: SamplingParams) -> int:
        """Queue the episode's next assistant turn (prompt and everything so far; the rest of the budget)."""
        left = self.limits.max_response_length - len(e.tokens)
        (seq_id,) = self.engine.add(e.prompt + e.tokens, params, max_new=left)
        return seq_id

    def _end_turn(self, e: Episode, seq: Any) -> None:
        """Append a finished turn's sampled tokens."""
        e.tokens += seq.response
        e.logprobs += seq.logprobs
        e.mask += [1] * len(seq.response)
        e.turns += 1
        e.finish_reason = seq.finish_reason

    def _continues(self, e: Episode) -> bool:
        """Whether the environment gets to answer: the turn ended itself, with turns and budget left."""
        room = len(e.tokens) < self.limits.max_response_length
        return e.finish_reason in ("eos", "stop") and e.turns < self.limits.max_assistant_turns and room

    def _take_answers(
        self, flat: list[Episode], pending: dict[int, Future], running: dict[int, int], params: SamplingParams
    ) -> None:
        """Append the answers ready on every rank (rank 0's view) and queue those episodes' next turns."""
        ready = self.agree({i: f.result() for i, f in pending.items() if f.done()})
        for i in sorted(ready):
            pending.pop(i, None)  # a rank other than 0 takes rank 0's answer, ready or not here
            e, answer = flat[i], ready[i]
            if answer is None:
                self.progress(1)
                continue  # no tool call: the episode ends with this turn
            self._append(e, answer)
            if len(e.tokens) >= self.limits.max_response_length:
                e.finish_reason = "length"  # the tool's output spent the response budget
                self.progress(1)
                continue
            running[self._add(e, params)] = i

    def _append(self, e: Episode, answer: ToolTurn) -> None:
        """Append a tool turn's tokens (never trained on) and count what its tools did."""
        e.tool_turns += 1
        e.tool_calls += answer.calls
        e.tool_errors += answer.errors
        e.tool_parse_errors += answer.parse_errors
        e.tool_skipped += answer.skipped
        tokens = answer.tokens[: self.limits.max_response_length - len(e.tokens)]
        e.tokens += tokens
        e.logprobs += [math.nan] * len(tokens)
        e.mask += [0] * len(tokens)
