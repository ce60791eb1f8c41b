"""Reward calls in the trainer's own process, each limited to ``timeout_s`` (``reward.num_workers=0``).

On the main thread (the usual case) the calls run right here under a ``SIGALRM`` timer, as in the pool's
workers: it interrupts Python code and blocking system calls (``time.sleep``, a socket read), and the
function keeps the main thread, so reward functions that set timers of their own (``signal.alarm``, as
math graders such as math_verify do) still work. A call stuck inside C code never sees the signal, and
when that code holds the GIL no thread of this process can run at all: the watchdog process
(``watchdog.py``) then stops the run with one line naming the function, the sample and the fix, once the
call has run ``watchdog.stuck_after(timeout_s)`` (only worker processes can be killed alone:
``reward.num_workers > 0``).

Elsewhere (the scorer on a background thread, ``reward.launch_async``, where no signal arrives) a daemon
thread makes the calls one after another while the calling thread waits. The worker only stamps ``(call
index, start time)`` before each call, so a fast reward pays about a microsecond per sample, and the
waiting thread wakes only at the deadline of the call in progress. A call past its deadline is abandoned:
the calls after it continue on a fresh thread, and the stuck thread is sent an asynchronous
``RewardTimeoutError`` that ends a pure-Python hang (a busy loop at once, a ``time.sleep`` when it
returns). A call stuck in C code keeps its daemon thread, which never delays the interpreter's exit; one
that also holds the GIL stops the waiting thread too, and the watchdog process ends the run as above.

Either way, ``give_up_after=K`` stops calling a function that timed out on each of its first K samples (as
the pool does): the samples after them get ``(False, RewardSkippedError)`` instead of a wait each.
"""

from __future__ import annotations

import ctypes
import logging
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from hybridflow.rewards.pool import Call, Outcome, RewardSkippedError, RewardTimeoutError
from hybridflow.rewards.watchdog import Slot, watch

logger = logging.getLogger(__name__)

# The fix the watchdog's line gives for a stuck call: per-sample functions can score in worker processes.
SAMPLE_FIX = (
    "set reward.num_workers >= 1 to score in worker processes, where a stuck call is killed and its sample "
    "counts as a timeout (or make the function return within reward.timeout_s)"
)
BATCH_FIX = (
    "make the batch function return within reward.timeout_s (a batch function runs in the trainer's "
    "process), or score per sample (reward.manager=naive) with reward.num_workers >= 1, where a stuck call "
    "is killed"
)


def run_here(
    fn: Callable,
    calls: Sequence[Call],
    timeout_s: float,
    extra_args: tuple = (),
    stop_on_error: bool = False,
    name: str = "reward function",
    give_up_after: int | None = None,
    batch_of: int | None = None,
) -> list[Outcome]:
    """Call ``fn`` on each call in this process, each limited to ``timeout_s``; outcomes in call order.

    A call past the limit gets ``(False, RewardTimeoutError)``. With ``stop_on_error`` the outcomes end at
    the first failed call (nothing after it runs). With ``give_up_after=K``, once each of the first K calls
    timed out the rest are not made: they get ``(False, RewardSkippedError)``. ``batch_of=N``: the one call
    scores a batch of N samples (so the watchdog's line says). A call that cannot be interrupted stops the
    run (``watchdog.py``).
    """
    who = name if name.startswith("reward function") else f"reward function {name}"
    unit = f"a batch of {batch_of} samples" if batch_of is not None else ""
    with watch(who, BATCH_FIX if unit else SAMPLE_FIX, timeout_s, len(calls), unit) as slot:
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
            outcomes = run_with_alarm(fn, calls, timeout_s, extra_args, stop_on_error, give_up_after, slot)
        else:
            outcomes = run_in_thread(fn, calls, timeout_s, extra_args, stop_on_error, give_up_after, slot)
    if len(outcomes) < len(calls) and gave_up(outcomes, give_up_after):
        reason = (
            f"not scored: {name} timed out on each of its first {give_up_after} samples, so the rest "
            "were not called"
        )
        logger.warning("reward: %d sample(s) %s", len(calls) - len(outcomes), reason)
        outcomes += [(False, RewardSkippedError(reason))] * (len(calls) - len(outcomes))
    return outcomes


def gave_up(outcomes: Sequence[Outcome], give_up_after: int | None) -> bool:
    """Whether there are ``give_up_after`` outcomes, all timeouts (so the calls after them stop)."""
    if not give_up_after or len(outcomes) != give_up_after:  # checked after each outcome: one compare
        return False
    return all(not ok and isinstance(v, RewardTimeoutError) for ok, v in outcomes)


class _Alarm:
    """The SIGALRM handler of ``run_with_alarm``: raises only while a call is armed (never in between)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.armed = False

    def __call__(self, signum: int, frame: Any) -> None:
        if self.armed:
            self.armed = False
            raise RewardTimeoutError(f"timed out after {self.timeout_s} s")


def run_with_alarm(
    fn: Callable,
    calls: Sequence[Call],
    timeout_s: float,
    extra_args: tuple = (),
    stop_on_error: bool = False,
    give_up_after: int | None = None,
    slot: Slot | None = None,
) -> list[Outcome]:
    """The calls on this (main) thread, each under a SIGALRM timer; the previous handler is restored.

    ``slot``: the watchdog's, stamped before each call.
    """
    slot = slot or Slot(None, 0)
    alarm = _Alarm(timeout_s)
    previous = signal.signal(signal.SIGALRM, alarm)
    outcomes: list[Outcome] = []
    try:
        for k, (args, kwargs) in enumerate(calls):
            slot.arm(k, time.monotonic())
            try:
                alarm.armed = True  # before the timer starts, so that its signal always finds it armed
                signal.setitimer(signal.ITIMER_REAL, timeout_s)
                outcome: Outcome = (True, fn(*args, *extra_args, **kwargs))
            except Exception as exc:  # the timer's RewardTimeoutError included
                outcome = (False, exc)
            finally:
                alarm.armed = False  # a signal arriving now is ignored
                signal.setitimer(signal.ITIMER_REAL, 0)
            outcomes.append(outcome)
            if (stop_on_error and not outcome[0]) or gave_up(outcomes, give_up_after):
                break
    finally:
        slot.disarm()
        signal.signal(signal.SIGALRM, previous)
    return outcomes


class _ThreadRun:
    """One daemon thread's pass over ``calls[start:]``; the waiting thread reads its clock and outcomes."""

    def __init__(
        self, fn: Callable, calls: Sequence[Call], start: int, extra_args: tuple, stop: bool, slot: Slot
    ) -> None:
        self.fn, self.calls, self.start, self.extra_args, self.stop = fn, calls, start, extra_args, stop
        self.slot = slot  # the watchdog's: stamped before each call, cleared when the run is abandoned
        self.outcomes: list[Outcome] = []
        # (index of the call in progress, its start time): one tuple, so it is always read consistently.
        self.clock = (start, time.monotonic())
        self.abandoned = False
        self.lock = threading.Lock()  # an abandoned thread never stamps the slot after abandon() cleared it
        self.escaped: BaseException | None = None  # SystemExit and the like: re-raised in the caller
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._work, name="reward-call", daemon=True)
        self.thread.start()

    def _work(self) -> None:
        try:
            for k in range(self.start, len(self.calls)):
                args, kwargs = self.calls[k]
                with self.lock:
                    if self.abandoned:  # timed out between two calls: the next one is not ours to make
                        return
                    self.clock = (k, time.monotonic())
                    self.slot.arm(*self.clock)
                try:
                    outcome: Outcome = (True, self.fn(*args, *self.extra_args, **kwargs))
                except Exception as exc:
                    outcome = (False, exc)
                # Timed out meanwhile (and the function may have swallowed the injected error): the calls
                # after this one belong to the thread that replaced this one.
                if self.abandoned:
                    return
                self.outcomes.append(outcome)
                if self.stop and not outcome[0]:
                    return
        except RewardTimeoutError:
            pass  # injected just after the call it was meant for had finished: nothing to report
        except BaseException as exc:
            self.escaped = exc
        finally:
            self.done.set()

    def abandon(self) -> None:
        """Stop reporting, and raise RewardTimeoutError inside the thread (effective in Python code only)."""
        with self.lock:
            self.abandoned = True
            self.slot.disarm()  # the watchdog no longer times it: the calls go on on another thread
        ident = self.thread.ident
        if ident is not None and self.thread.is_alive():
            set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
            set_async_exc(ctypes.c_ulong(ident), ctypes.py_object(RewardTimeoutError))


def run_in_thread(
    fn: Callable,
    calls: Sequence[Call],
    timeout_s: float,
    extra_args: tuple = (),
    stop_on_error: bool = False,
    give_up_after: int | None = None,
    slot: Slot | None = None,
) -> list[Outcome]:
    """Call ``fn`` on each call in a daemon thread, each call limited to ``timeout_s``; outcomes in order.

    A call past the limit gets ``(False, RewardTimeoutError)``. With ``stop_on_error`` the outcomes end at
    the first failed call (nothing after it runs), with ``give_up_after=K`` once the first K timed out.
    ``slot``: the watchdog's, stamped before each call.
    """
    slot = slot or Slot(None, 0)
    outcomes: list[Outcome] = []
    while len(outcomes) < len(calls):
        run = _ThreadRun(fn, calls, len(outcomes), extra_args, stop_on_error, slot)
        timed_out = _wait_for(run, timeout_s)
        if timed_out is None:  # every call done, or stopped at the first error
            if run.escaped is not None:
                raise run.escaped
            outcomes += run.outcomes
            break
        run.abandon()
        logger.debug("reward call %d passed its %s s limit; its thread is abandoned", timed_out, timeout_s)
        outcomes += run.outcomes[: timed_out - run.start]
        outcomes.append((False, RewardTimeoutError(f"timed out after {timeout_s} s")))
        if stop_on_error or gave_up(outcomes, give_up_after):
            break
    return outcomes


def _wait_for(run: _ThreadRun, timeout_s: float) -> int | None:
    """Wait until ``run`` ends (None) or one of its calls passes ``timeout_s`` (that call's index)."""
    while not run.done.is_set():
        index, started = run.clock
        remaining = started + timeout_s - time.monotonic()
        if remaining > 0:
            run.done.wait(remaining)
        elif run.clock[0] == index:
            return index
    return None
