"""The engine's side of the endpoint: one thread owns the paged engine; HTTP handlers hand it jobs.

Every request of every episode becomes a ``Job`` on a queue; the driver's thread admits jobs into the
engine, runs its scheduling rounds (the requests of all episodes decode in one batch), and calls each job's
``done`` (and, while it streams, ``progress``) from that thread. Requests in flight together must share their
sampling settings (one sampler per engine session, ``session.check_params``): a job whose settings differ
waits until the engine is idle, and no later job is admitted before it (first come, first served). Each
job's own ``max_tokens`` is its sequences' budget (``max_new``), so it never splits the batch.

Stop strings are the host's: the engine stops on token ids only, so a job with ``stop`` strings is fetched
after every round, and a choice whose text holds one is aborted there and cut just after the token that
completed it (what comes after was never shown, and is never trained on).
"""

from __future__ import annotations

import dataclasses
import logging
import queue
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridflow.engine import PagedEngine, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class Choice:
    """One sampled answer: its tokens, log-probs, weight versions and how it ended."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # eos, stop (a stop token or string), length, abort


@dataclass(eq=False)
class Job:
    """One request's generation: ``params.n`` choices of ``prompt``, at most ``max_new`` tokens each."""

    prompt: list[int]
    params: SamplingParams
    max_new: int
    done: Callable[[list[Choice] | BaseException], None]
    stop: tuple[str, ...] = ()
    progress: Callable[[int, list[int]], None] | None = None  # (choice, tokens so far), while it streams
    choices: list[Choice] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)  # the engine's sequence ids, by choice

    @property
    def watched(self) -> bool:
        """Whether its tokens are fetched after every round (streaming, stop strings)."""
        return self.progress is not None or bool(self.stop)


def stop_cut(tokenizer: Any, tokens: list[int], stops: tuple[str, ...]) -> int | None:
    """The number of leading ``tokens`` whose text first holds one of ``stops`` (None: none does)."""
    text = tokenizer.decode(tokens, skip_special_tokens=False)
    if not any(s in text for s in stops):
        return None
    lo, hi = 1, len(tokens)  # the shortest prefix holding a stop string (holding is monotone in the prefix)
    while lo < hi:
        mid = (lo + hi) // 2
        if any(s in tokenizer.decode(tokens[:mid], skip_special_tokens=False) for s in stops):
            hi = mid
        else:
            lo = mid + 1
    return lo


class EngineDriver:
    """Runs the engine for the jobs handed to ``submit`` (see the module doc); ``run_until`` on its thread."""

    def __init__(self, engine: PagedEngine, tokenizer: Any) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self.inbox: queue.Queue[Job] = queue.Queue()
        self.waiting: deque[Job] = deque()  # jobs not admitted yet, in order
        self.by_seq: dict[int, tuple[Job, int]] = {}  # engine sequence id -> (job, choice)
        self.live: set[Job] = set()

    def submit(self, job: Job) -> None:
        """Queue a job (any thread)."""
        self.inbox.put(job)

    @property
    def busy(self) -> bool:
        """Whether any job is waiting or running."""
        return bool(self.waiting or self.live or not self.inbox.empty())

    def run_until(self, finished: Callable[[], bool], poll_s: float = 0.02) -> None:
        """Serve jobs on this thread until ``finished()`` holds (checked between rounds)."""
        while not finished():
            self.round(poll_s)

    def round(self, poll_s: float = 0.02) -> None:
        """Take new jobs (waiting up to ``poll_s`` for one when idle), admit what fits, run one engine round."""
        try:
            block = not (self.live or self.waiting)
            self.waiting.append(self.inbox.get(timeout=poll_s) if block else self.inbox.get_nowait())
            while True:
                self.waiting.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        self._admit()
        if not self.engine.has_work:
            return
        watched = any(job.watched for job in self.live)
        with torch.no_grad():
            touched = self.engine.step(max_tokens=self.engine.cfg.sync_interval, fetch_all=watched)
        if self.engine.stalled:
            self._fail_all(RuntimeError("the KV pool cannot hold the next sequence; shorten the request"))
            return
        for seq in touched:
            if seq.id in self.by_seq:
                self._update(seq)

    def abort_all(self, reason: str) -> None:
        """End every job now (the run is over): each gets an error naming ``reason``."""
        self._fail_all(RuntimeError(reason))

    # ---- internals ---------------------------------------------------------------------------------------

    def _admit(self) -> None:
        while self.waiting:
            job = self.waiting[0]
            session = self.engine.session
            if session is not None and not _compatible(session.params, job.params):
                return  # it waits for the engine to go idle; nothing after it jumps the queue
            self.waiting.popleft()
            try:
                job.ids = self.engine.add(job.prompt, job.params, max_new=job.max_new)
            except Exception as exc:  # a prompt too long for the context: this request's error
                job.done(exc)
                continue
            job.choices = [Choice() for _ in job.ids]
            self.live.add(job)
            self.by_seq.update((seq_id, (job, i)) for i, seq_id in enumerate(job.ids))

    def _update(self, seq: Any) -> None:
        job, i = self.by_seq[seq.id]
        choice = job.choices[i]
        choice.tokens, choice.logprobs = list(seq.response), list(seq.logprobs)
        choice.versions = list(seq.versions)
        if job.stop and choice.tokens:
            cut = stop_cut(self.tokenizer, choice.tokens, job.stop)
            if cut is not None:
                if seq.finish_reason is None:
                    self.engine.abort([seq.id])
                del choice.tokens[cut:], choice.logprobs[cut:], choice.versions[cut:]
                seq.finish_reason = "stop"
        if job.progress is not None:
            job.progress(i, list(choice.tokens))
        if seq.finish_reason is not None:
            choice.finish_reason = seq.finish_reason
            del self.by_seq[seq.id]
            if all(c.finish_reason is not None for c in job.choices):
                self.live.discard(job)
                job.done(job.choices)

    def _fail_all(self, error: BaseException) -> None:
        running = [seq_id for job in self.live for seq_id in job.ids if seq_id in self.by_seq]
        if running:
            self.engine.abort(running)
        for job in [*self.live, *self.waiting]:
            job.done(error)
        self.live.clear(), self.waiting.clear(), self.by_seq.clear()
        while not self.inbox.empty():
            self.inbox.get_nowait().done(error)


def _compatible(running: SamplingParams, new: SamplingParams) -> bool:
    """Whether ``new`` may join the session of ``running`` (``session.check_params``'s rule)."""
    same = dataclasses.replace(new, n=running.n, max_new_tokens=running.max_new_tokens) == running
    return same and new.max_new_tokens <= running.max_new_tokens
