"""``RewardManager``: scores a batch of responses with a reward function and checks what it returns.

Three kinds of reward function:
  * ``naive`` (verl's default): ``fn(data_source=, solution_str=, ground_truth=, extra_info=, **reward_kwargs)``
    called once per sample, returning a number or a dict with a numeric ``"score"`` (other numeric or bool
    entries become per-sample extras; non-numeric entries such as a predicted string are dropped).
  * ``batch``: ``fn(data_sources=, solution_strs=, ground_truths=, extra_infos=, **reward_kwargs)`` called
    once with lists, returning one such value per sample (``reward.manager=batch``).
  * ``token``: ``fn(prompt_ids, response_ids, tokenizer, **reward_kwargs)`` per sample, on token ids, so
    nothing is decoded. Chosen explicitly with ``kind="token"``, or detected: a function given with the
    default ``kind="naive"`` whose parameters include ``prompt_ids`` and ``response_ids`` is a token
    function. Detection is by parameter names only.

Errors: a call that raises, returns NaN/inf, or returns anything but an int/float/bool or a dict with a
numeric ``"score"`` raises ``RewardError`` naming the sample index, its data source and the function. With
``on_error="zero"`` the sample scores 0 instead, a warning is logged, and the extras always carry
``reward/errors`` (1.0 for each failed sample, 0.0 otherwise; its sum is the error count).
``on_error="raise"`` stops at the first timeout; with ``"zero"`` scoring stops waiting once the function
timed out on each of its first max(2, num_workers) samples (the rest score 0; in the pool or, with
num_workers=0, in-process), and the extras of naive and token functions carry ``reward/timeouts`` and
``reward/skipped`` per sample.

Every call is limited to ``timeout_s`` seconds (one sample, or the whole batch for a batch function); a
timeout is an error like the others, reported with the limit and the settings that change it.
``num_workers > 0`` scores naive and token functions in a spawned process pool, one sample per task, where
a stuck call is killed. The function must be picklable (a module-level function of an importable module)
or come from a file: pass ``(path, name)``, or a function returned by ``load_reward_function``, and the
workers load the file themselves. With ``num_workers=0``, and for batch functions always, the calls run in
the calling process (``in_process.run_here``: under a timer on the main thread, on a daemon thread
elsewhere); a call stuck in C code cannot be stopped there: a watchdog process stops the run instead, with
one line naming the function, the sample and the fix (``watchdog.py``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
import pickle
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from hybridflow.rewards.in_process import run_here
from hybridflow.rewards.loader import (
    describe_function,
    file_source,
    is_token_reward_function,
    load_reward_function,
)
from hybridflow.rewards.pool import RewardSkippedError, RewardTimeoutError, ScoringPool
from hybridflow.rewards.scorer import default_compute_score
from hybridflow.utils.errors import UserError

logger = logging.getLogger(__name__)

KINDS = ("naive", "batch", "token")
ON_ERROR = ("raise", "zero")
ERRORS_KEY = "reward/errors"
TIMEOUTS_KEY = "reward/timeouts"  # per sample, 1.0 where the call timed out (on_error=zero)
SKIPPED_KEY = "reward/skipped"  # per sample, 1.0 where scoring stopped waiting for a hung function


class RewardError(UserError):
    """A reward function failed on a sample (raised, timed out, or returned a non-finite or wrong value)."""


class _Skipped(Exception):
    """A sample the pool did not score because it stopped at another sample's timeout."""


class _BadResult(Exception):
    """A reward function returned something that is not a usable score (internal)."""


def _extra_value(value: Any) -> float | None:
    """A per-sample extra as a float: numbers and bools (numpy scalars included); None for anything else."""
    if isinstance(value, numbers.Real) or (hasattr(value, "dtype") and getattr(value, "shape", None) == ()):
        try:
            return float(value)
        except (TypeError, ValueError):
            return None
    return None


def _check_result(value: Any) -> tuple[float, dict[str, float]]:
    """``(score, numeric extras)`` from a returned number or dict; _BadResult for anything else."""
    extras: dict[str, float] = {}
    if isinstance(value, Mapping):
        if "score" not in value:
            raise _BadResult(f"returned a dict without a 'score' key (keys: {sorted(map(str, value))})")
        for key, item in value.items():
            number = _extra_value(item) if key != "score" else None
            if number is not None:
                extras[str(key)] = number
        value = value["score"]
    # numbers.Real covers int, float, bool, numpy scalars and Fraction; not str, None, tensors or complex.
    if not isinstance(value, numbers.Real):
        hint = " (call .item() on a tensor)" if hasattr(value, "item") else ""
        raise _BadResult(f"returned a score of type {type(value).__name__}, expected a float{hint}")
    score = float(value)
    if not math.isfinite(score):
        raise _BadResult(f"returned a non-finite score {score}")
    return score, extras


def _call_payload(compute_score: Callable | tuple[str, str] | None) -> tuple[Callable, Callable | tuple]:
    """The function to call here, and what a pool worker needs to get the same function."""
    if compute_score is None:
        return default_compute_score, default_compute_score
    if isinstance(compute_score, tuple):
        if len(compute_score) != 2 or not all(isinstance(s, str) for s in compute_score):
            raise TypeError(f"compute_score as a tuple must be (path, name), got {compute_score!r}")
        fn = load_reward_function(*compute_score)
    elif callable(compute_score):
        fn = compute_score
    else:
        raise TypeError(f"compute_score must be a function or a (path, name) pair, got {compute_score!r}")
    source = file_source(fn)
    return fn, (source if source is not None else fn)


def _as_list(values: Sequence | None, n: int, name: str) -> list:
    """``values`` as a list of length ``n`` (None -> n Nones); ValueError on a length mismatch."""
    if values is None:
        return [None] * n
    values = list(values)
    if len(values) != n:
        raise UserError(f"{name} has {len(values)} entries but the batch has {n} samples")
    return values


class RewardManager:
    """Scores a batch of responses with one reward function (kinds, errors and pool: module docstring)."""

    def __init__(
        self,
        compute_score: Callable | tuple[str, str] | None = None,
        kind: str = "naive",
        on_error: str = "raise",
        num_workers: int = 0,
        timeout_s: float = 60.0,
        fn_name: str | None = None,
        reward_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        if kind not in KINDS:
            raise UserError(f"reward manager kind must be one of {', '.join(KINDS)}, got {kind!r}")
        if on_error not in ON_ERROR:
            raise UserError(f"reward on_error must be 'raise' or 'zero', got {on_error!r}")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise UserError(f"reward num_workers must be an int >= 0 (0 = no pool), got {num_workers!r}")
        if not timeout_s > 0:
            raise UserError(f"reward timeout_s must be > 0 seconds, got {timeout_s!r}")
        fn, self._payload = _call_payload(compute_score)
        if kind == "naive" and is_token_reward_function(fn):
            kind = "token"
            logger.info("reward function %s takes prompt_ids/response_ids: scoring token ids", fn_name or fn)
        self.compute_score = fn
        self.kind = kind
        self.on_error = on_error
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.fn_name = fn_name or describe_function(fn)
        self.reward_kwargs = dict(reward_kwargs or {})
        self._pool: ScoringPool | None = None
        self._pool_tokenizer: Any = None
        if num_workers > 0 and kind != "batch":
            self._check_picklable()

    def _check_picklable(self) -> None:
        """Fail early, with the fix, when the function cannot be sent to worker processes."""
        try:
            pickle.dumps((self._payload, self.reward_kwargs))
        except Exception as exc:
            raise TypeError(
                f"reward function {self.fn_name} cannot be sent to reward worker processes ({exc}); define it "
                "at module level in an importable module or a .py file and pass (path, name), or set "
                "reward.num_workers=0"
            ) from exc

    def score(
        self,
        data_sources: Sequence[str] | None,
        solution_strs: Sequence[str] | None,
        ground_truths: Sequence[Any] | None,
        extra_infos: Sequence[dict | None] | None = None,
        prompt_ids: Sequence[Any] | None = None,
        response_ids: Sequence[Any] | None = None,
        tokenizer: Any = None,
    ) -> tuple[list[float], dict[str, list[float]]]:
        """Per-sample scores and per-sample extras (key -> list, 0.0 where a sample lacks the key).

        Token functions read ``prompt_ids``/``response_ids`` (one sequence of valid token ids per sample,
        padding already removed) and ``tokenizer``; the text arguments may then be None.
        """
        if self.kind == "token":
            if prompt_ids is None or response_ids is None:
                raise UserError(f"token reward function {self.fn_name} needs prompt_ids and response_ids")
            n = len(response_ids)
        elif solution_strs is None:
            raise UserError(f"reward function {self.fn_name} needs solution_strs (the decoded responses)")
        else:
            n = len(solution_strs)
        sources = _as_list(data_sources, n, "data_sources")
        texts = _as_list(solution_strs, n, "solution_strs")
        truths = _as_list(ground_truths, n, "ground_truths")
        infos = _as_list(extra_infos, n, "extra_infos")
        if self.kind == "batch":
            outcomes: Iterable = self._batch_outcomes(sources, texts, truths, infos)
        elif self.kind == "token":
            prompts, responses = (
                _as_list(prompt_ids, n, "prompt_ids"),
                _as_list(response_ids, n, "response_ids"),
            )
            calls = [((prompts[i], responses[i]), self.reward_kwargs) for i in range(n)]
            outcomes = self._outcomes(calls, (tokenizer,))
        else:
            calls = [
                ((), dict(data_source=s, solution_str=t, ground_truth=g, extra_info=e, **self.reward_kwargs))
                for s, t, g, e in zip(sources, texts, truths, infos)
            ]
            outcomes = self._outcomes(calls, ())
        return self._collect(outcomes, sources)

    def _outcomes(self, calls: list[tuple[tuple, dict]], extra_args: tuple) -> Iterable[tuple[bool, Any]]:
        """Outcomes of per-sample calls, in the pool or on a thread here.

        In-process with on_error=raise, no call is made after one that raised or timed out. (A bad return
        value is found later, by ``_collect``: checking it here too would double the per-sample cost.)
        """
        if self.num_workers > 0:
            raise_now = self.on_error == "raise"
            give_up = None if raise_now else max(2, self.num_workers)
            return self._get_pool(extra_args).run(calls, stop_on_timeout=raise_now, give_up_after=give_up)
        stop = self.on_error == "raise"
        give_up = None if stop else 2
        return run_here(self.compute_score, calls, self.timeout_s, extra_args, stop, self.fn_name, give_up)

    def _get_pool(self, extra_args: tuple) -> ScoringPool:
        """The pool, (re)started when first needed or when the tokenizer it holds changes."""
        tokenizer = extra_args[0] if extra_args else None
        if self._pool is not None and self._pool_tokenizer is not tokenizer:
            self.close()
        if self._pool is None:
            self._pool = ScoringPool(self.num_workers, self._payload, self.timeout_s, extra_args)
            self._pool_tokenizer = tokenizer
        return self._pool

    def _batch_outcomes(
        self, sources: list, texts: list, truths: list, infos: list
    ) -> list[tuple[bool, Any]]:
        """One call with lists, under the timeout; a failure of the call itself fails every sample."""
        n = len(texts)
        kwargs = dict(
            data_sources=sources,
            solution_strs=texts,
            ground_truths=truths,
            extra_infos=infos,
            **self.reward_kwargs,
        )
        [(ok, values)] = run_here(
            self.compute_score, [((), kwargs)], self.timeout_s, name=self.fn_name, batch_of=n
        )
        if not ok:
            problem = values
        elif isinstance(values, (str, bytes, Mapping)) or not hasattr(values, "__len__"):
            problem = _BadResult(f"batch reward function returned a {type(values).__name__}, expected a list")
        elif len(values) != n:
            problem = _BadResult(f"batch reward function returned {len(values)} scores for {n} samples")
        else:
            return [(True, v) for v in values]
        if self.on_error == "raise":
            what = f"{type(problem).__name__}: {problem}"
            if isinstance(problem, RewardTimeoutError):
                what = str(problem)
            raise RewardError(
                f"batch reward function {self.fn_name} failed on a batch of {n} samples (data sources: "
                f"{', '.join(sorted(set(map(str, sources))))}): {what}. {self._fix(problem)}"
            ) from problem
        return [(False, problem)] * n

    def _collect(
        self, outcomes: Iterable[tuple[bool, Any]], sources: list
    ) -> tuple[list[float], dict[str, list[float]]]:
        """Check each outcome; raise RewardError on the first failure, or score it 0 (on_error=zero)."""
        scores: list[float] = []
        per_sample: list[dict[str, float]] = []
        errors: list[float] = []
        timeouts: list[float] = []
        skipped: list[float] = []
        failures: list[str] = []
        for i, (ok, value) in enumerate(outcomes):
            timeouts.append(float(not ok and isinstance(value, RewardTimeoutError)))
            skipped.append(float(not ok and isinstance(value, RewardSkippedError)))
            try:
                if skipped[-1] and self.on_error == "raise":
                    raise _Skipped  # the pool stopped at a timeout; that sample raises below
                if not ok:
                    raise _BadResult(f"raised {type(value).__name__}: {value}")
                score, extras = _check_result(value)
                errors.append(0.0)
            except _BadResult as bad:
                cause = value if not ok else None
                sample = f"sample {i} (data_source={sources[i]!r})"
                if isinstance(cause, RewardTimeoutError):
                    message = f"reward function {self.fn_name} on {sample}: {cause}"
                else:
                    message = f"reward function {self.fn_name} failed on {sample}: {bad}"
                if self.on_error == "raise":
                    raise RewardError(f"{message}. {self._fix(cause)}") from cause
                failures.append(message)
                score, extras = 0.0, {}
                errors.append(1.0)
            except _Skipped:
                score, extras = 0.0, {}
                errors.append(1.0)
            scores.append(score)
            per_sample.append(extras)
        keys = dict.fromkeys(k for extras in per_sample for k in extras)
        extra_lists = {k: [extras.get(k, 0.0) for extras in per_sample] for k in keys}
        if self.on_error == "zero":
            extra_lists[ERRORS_KEY] = errors
            if self.kind != "batch":
                extra_lists[TIMEOUTS_KEY], extra_lists[SKIPPED_KEY] = timeouts, skipped
        if failures:
            logger.warning(
                "%d of %d samples scored 0 after a reward error; first: %s",
                len(failures),
                len(scores),
                failures[0],
            )
        return scores, extra_lists

    def _fix(self, cause: BaseException | None) -> str:
        """What to do about a failed call: the timeout settings for a timeout, else fix the function."""
        zero = "set reward.on_error=zero to score failing samples 0"
        if not isinstance(cause, RewardTimeoutError):
            return f"Fix the function, or {zero}"
        fix = f"Make the function faster or raise reward.timeout_s (now {self.timeout_s} s), or {zero}"
        if self.num_workers > 0 and self.kind != "batch":
            return fix
        fix += "; in-process, a stuck call keeps running in the background"
        if self.kind != "batch":  # batch functions always run in-process
            fix += " (reward.num_workers=N scores in worker processes, which are killed instead)"
        return fix

    def close(self) -> None:
        """Stop the worker processes, if any (a later ``score`` starts new ones)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None
            self._pool_tokenizer = None

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        # Workers are separate processes; do not leave them behind when the manager is dropped.
        pool = getattr(self, "_pool", None)
        if pool is not None:
            # At interpreter shutdown the modules close() needs may already be gone.
            with contextlib.suppress(Exception):
                pool.close()
