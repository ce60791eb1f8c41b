"""A process pool that scores one sample per task, with a per-sample timeout.

Timeouts are enforced twice. Inside the worker a ``SIGALRM`` timer interrupts the reward function after
``timeout_s`` seconds (this stops Python code, the worker lives on). A function stuck in C code never sees
the signal, so the parent also gives each task a hard deadline of ``timeout_s + HARD_TIMEOUT_GRACE_S``
after submission; past it the workers are killed, the task is reported as timed out, and the other tasks
in flight are re-run in a fresh pool. At most ``num_workers`` tasks are in flight, so a task starts when it
is submitted and the deadline does not count time spent queueing. A run can stop early instead of waiting
out every sample's timeout: at the first timeout (``stop_on_timeout``, for reward.on_error=raise), or once
each of the first K samples timed out (``give_up_after``). ``hybridflow.rewards.in_process`` holds the
timeouts of calls made in the trainer's own process.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import multiprocessing
import signal
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures.process import BrokenProcessPool
from typing import Any

logger = logging.getLogger(__name__)

# Seconds past timeout_s before the parent kills a worker that ignores the in-worker timer. It also covers
# the start of a fresh worker (a spawned interpreter importing the reward module).
HARD_TIMEOUT_GRACE_S = 10.0

# A call: (positional args, keyword args); an outcome: (True, returned value) or (False, exception).
Call = tuple[tuple, dict]
Outcome = tuple[bool, Any]


class RewardTimeoutError(TimeoutError):
    """A reward call ran past its time limit."""


class RewardSkippedError(RuntimeError):
    """A sample the pool stopped waiting for: an earlier sample timed out (see ``ScoringPool.run``)."""


class _StopRule:
    """When ``run`` stops waiting: at the first timeout, or when the first ``give_up_after`` all timed out."""

    def __init__(self, stop_on_timeout: bool, give_up_after: int | None) -> None:
        self.stop_on_timeout = stop_on_timeout
        self.give_up_after = give_up_after
        self.seen = self.timeouts = 0

    def reason(self, outcome: Outcome) -> str | None:
        """Why to stop after this completed outcome (None: keep going)."""
        self.seen += 1
        timed_out = not outcome[0] and isinstance(outcome[1], RewardTimeoutError)
        self.timeouts += timed_out
        if timed_out and self.stop_on_timeout:
            return "not scored: another sample timed out and reward.on_error=raise stops at the first"
        if self.give_up_after and self.seen == self.give_up_after == self.timeouts:
            return (
                f"not scored: the reward function timed out on each of its first {self.timeouts} samples, "
                "so the pool stopped waiting for it"
            )
        return None


class RewardWorkerDiedError(RuntimeError):
    """A reward worker process died (a crash, ``os._exit``, the OOM killer, or a bad start)."""


_DIED = (
    "a reward worker process died while this sample (or another one in flight) was scored: a crash, "
    "os._exit, the out-of-memory killer, or a script that starts training without "
    "`if __name__ == '__main__':` (worker processes are spawned)"
)


# Worker-process state, set once by _init_worker.
_worker: dict[str, Any] = {}


def _on_alarm(signum: int, frame: Any) -> None:
    raise RewardTimeoutError(f"timed out after {_worker['timeout_s']} s")


def _init_worker(payload: Callable | tuple[str, str], extra_args: tuple, timeout_s: float) -> None:
    """Load the reward function (a picklable callable, or (path, name) to load from a file) once."""
    if isinstance(payload, tuple):
        from hybridflow.rewards.loader import load_reward_function

        payload = load_reward_function(*payload)
    _worker.update(fn=payload, extra_args=extra_args, timeout_s=timeout_s)
    if hasattr(signal, "setitimer"):
        signal.signal(signal.SIGALRM, _on_alarm)


def _run_task(args: tuple, kwargs: dict) -> Any:
    """Call the worker's reward function on one sample under the in-worker timer."""
    timed = hasattr(signal, "setitimer")
    if timed:
        signal.setitimer(signal.ITIMER_REAL, _worker["timeout_s"])
    try:
        return _worker["fn"](*args, *_worker["extra_args"], **kwargs)
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)


class ScoringPool:
    """``num_workers`` spawned processes that call one reward function, one sample per task."""

    def __init__(
        self,
        num_workers: int,
        payload: Callable | tuple[str, str],
        timeout_s: float,
        extra_args: tuple = (),
    ) -> None:
        assert num_workers > 0 and timeout_s > 0
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        # extra_args go after each call's own positional args (the tokenizer of token-id functions): sent
        # once per worker, not once per sample.
        self._init_args = (payload, extra_args, timeout_s)
        self._executor: cf.ProcessPoolExecutor | None = None

    def _ensure_executor(self) -> cf.ProcessPoolExecutor:
        if self._executor is None:
            self._executor = cf.ProcessPoolExecutor(
                max_workers=self.num_workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
                initargs=self._init_args,
            )
        return self._executor

    def run(
        self, calls: Sequence[Call], stop_on_timeout: bool = False, give_up_after: int | None = None
    ) -> list[Outcome]:
        """Run every call; each outcome is ``(True, value)`` or ``(False, exception)``, in call order.

        ``stop_on_timeout``: after the first timeout, stop (the workers are killed) and give the calls not
        finished ``(False, RewardSkippedError)``. ``give_up_after=K``: the same when each of the first K
        calls to finish timed out (a function that hangs on everything), instead of waiting out every one.
        """
        outcomes: list[Outcome | None] = [None] * len(calls)
        todo = deque(range(len(calls)))
        self._stop = _StopRule(stop_on_timeout, give_up_after)
        while todo:
            survivors = self._run_round(calls, todo, outcomes)
            # A round ends early only when a task blew its hard deadline or a worker died, and the pool was
            # killed; the tasks that were still running get another go in a fresh pool, in their order.
            todo.extendleft(reversed(survivors))
        assert all(o is not None for o in outcomes)
        return outcomes  # type: ignore[return-value]

    def _run_round(self, calls: Sequence[Call], todo: deque, outcomes: list) -> list[int]:
        """Keep num_workers tasks in flight until todo is empty or a deadline passes; return survivors."""
        executor = self._ensure_executor()
        hard_limit = self.timeout_s + HARD_TIMEOUT_GRACE_S
        running: dict[cf.Future, tuple[int, float]] = {}
        while todo or running:
            while todo and len(running) < self.num_workers:
                i = todo.popleft()
                running[executor.submit(_run_task, *calls[i])] = (i, time.monotonic() + hard_limit)
            wait_s = max(0.0, min(d for _, d in running.values()) - time.monotonic())
            done, _ = cf.wait(running, timeout=wait_s, return_when=cf.FIRST_COMPLETED)
            broken = False
            finished = []
            for future in done:
                i, _ = running.pop(future)
                exc = future.exception()
                if isinstance(exc, BrokenProcessPool):
                    broken, exc = True, RewardWorkerDiedError(_DIED)
                outcomes[i] = (True, future.result()) if exc is None else (False, exc)
                finished.append(i)
            now = time.monotonic()
            expired = [f for f, (_, deadline) in running.items() if deadline <= now]
            for future in expired:
                i, _ = running.pop(future)
                outcomes[i] = (
                    False,
                    RewardTimeoutError(f"timed out: no result after {hard_limit:.1f} s; worker killed"),
                )
                finished.append(i)
            reasons = [self._stop.reason(outcomes[i]) for i in finished]  # every outcome counts
            reason = next((r for r in reasons if r), None)
            if reason is not None:
                self._skip([*todo, *(i for i, _ in running.values())], outcomes, reason)
                todo.clear()
                self.close()  # kills the calls still running
                return []
            if expired or broken:
                # A dead worker breaks the whole executor; a stuck one can only be killed. Start afresh.
                self.close()
                return [i for i, _ in sorted(running.values())]
        return []

    @staticmethod
    def _skip(indices: Sequence[int], outcomes: list, reason: str) -> None:
        if indices:
            logger.warning("reward pool: %d sample(s) %s", len(indices), reason)
        for i in indices:
            outcomes[i] = (False, RewardSkippedError(reason))

    def close(self) -> None:
        """Kill the workers (a stuck reward call must not keep the trainer alive) and drop the executor."""
        executor, self._executor = self._executor, None
        if executor is None:
            return
        # ProcessPoolExecutor has no public kill before Python 3.14 (kill_workers); its process table is
        # the only handle on the workers.
        kill = getattr(executor, "kill_workers", None)
        if kill is not None:
            kill()
        else:
            for process in list((getattr(executor, "_processes", None) or {}).values()):
                process.kill()
        executor.shutdown(wait=True, cancel_futures=True)
