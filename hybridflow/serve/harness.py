"""User harnesses: ``async def episode(client, row) -> reward`` (or ``(reward, metrics)``), ``client`` a real
``openai.AsyncOpenAI`` pointed at one episode's base URL on the run's endpoint.

``HarnessRunner.run`` plays every episode of a rollout on the endpoint's event loop, at most
``max_concurrency`` at once, each within ``timeout_s``, while the calling thread drives the engine (the
requests of all episodes batched together). What goes wrong in a harness is its episode's failure, never the
run's: an exception (a bug, an HTTP 400 for a malformed request), a timeout (a hang) or a reward that is not a
finite number is counted (``harness/errors``, ``harness/timeouts``, ``harness/bad_rewards``) and the episode
either scores 0 with what it sampled (``on_error=zero``) or is dropped (``on_error=drop``).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from typing import Any

from hybridflow.serve.server import Endpoint
from hybridflow.serve.trajectory import Sequence
from hybridflow.utils.errors import UserError

logger = logging.getLogger(__name__)

ON_ERROR = ("zero", "drop")


@dataclass
class EpisodeResult:
    """One episode: its training rows, its reward and metrics, and what went wrong (None: nothing)."""

    sequences: list[Sequence] = field(default_factory=list)
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    failure: str | None = None  # error, timeout or bad_reward
    requests: int = 0
    splits: int = 0


def load_harness(module: str, function: str) -> Callable:
    """The harness function ``function`` of ``module`` (a dotted module or a .py file); an async function."""
    from hybridflow.rewards.loader import import_reward_module

    try:
        mod = import_reward_module(module)
    except UserError as exc:
        raise UserError(f"rollout.harness.module={module!r}: {exc}") from exc
    fn = getattr(mod, function, None)
    if fn is None:
        names = sorted(
            k for k, v in vars(mod).items() if inspect.iscoroutinefunction(v) and not k.startswith("_")
        )
        raise UserError(
            f"rollout.harness.function={function!r} is not in {module}; its async functions: "
            f"{', '.join(names) or 'none'}"
        )
    if not inspect.iscoroutinefunction(fn):
        raise UserError(
            f"rollout.harness.function={function!r} in {module} must be an async function "
            "(async def episode(client, row) -> reward)"
        )
    return fn


def _reward(value: Any) -> tuple[float, dict[str, float]] | None:
    """``reward`` or ``(reward, metrics)`` as floats; None when it is neither."""
    metrics: dict[str, float] = {}
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict):
        value, extra = value
        try:
            metrics = {str(k): float(v) for k, v in extra.items()}
        except (TypeError, ValueError):
            return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value), metrics


class HarnessRunner:
    """Runs a harness's episodes on an endpoint (see the module doc)."""

    def __init__(
        self,
        fn: Callable,
        max_concurrency: int,
        timeout_s: float,
        on_error: str,
        serving: Callable[[], AbstractAsyncContextManager] | None = None,
    ) -> None:
        """``serving``: resources the episodes share, held on the endpoint's loop for each rollout."""
        if on_error not in ON_ERROR:
            raise UserError(f"rollout.harness.on_error={on_error!r}; use one of {', '.join(ON_ERROR)}")
        self.fn, self.max_concurrency, self.timeout_s, self.on_error = (
            fn,
            max_concurrency,
            timeout_s,
            on_error,
        )
        self.serving = serving

    def run(
        self, endpoint: Endpoint, rows: list[dict[str, Any]], progress: Callable[[int], None] | None = None
    ) -> list[EpisodeResult]:
        """One episode per row, in order; the engine is driven on this thread until the last one ends."""
        future = asyncio.run_coroutine_threadsafe(self._all(endpoint, rows, progress), endpoint.loop)
        try:
            endpoint.driver.run_until(future.done)
        finally:
            if not future.done():
                future.cancel()
            endpoint.driver.abort_all("the rollout is over")  # a request a cancelled harness left behind
        return future.result()

    async def _all(
        self, endpoint: Endpoint, rows: list[dict[str, Any]], progress: Callable[[int], None] | None
    ) -> list[EpisodeResult]:
        import openai

        gate = asyncio.Semaphore(self.max_concurrency)

        async def one(row: dict[str, Any]) -> EpisodeResult:
            async with gate:
                key, traj = endpoint.open_episode()
                client = openai.AsyncOpenAI(
                    base_url=endpoint.base_url(key),
                    api_key=endpoint.token,
                    max_retries=0,
                    timeout=self.timeout_s,
                )
                out = EpisodeResult()
                try:
                    value = await asyncio.wait_for(self.fn(client, row), self.timeout_s)
                    parsed = _reward(value)
                    if parsed is None:
                        out.failure = "bad_reward"
                        logger.warning("a harness episode returned %.100r, not a reward (a number)", value)
                    else:
                        out.reward, out.metrics = parsed
                except asyncio.TimeoutError:
                    out.failure = "timeout"
                    logger.warning("a harness episode ran past rollout.harness.timeout_s=%s", self.timeout_s)
                except Exception as exc:  # the harness's failure: its episode's, never the run's
                    out.failure = "error"
                    logger.warning("a harness episode failed (%s: %.300s)", type(exc).__name__, exc)
                finally:
                    await client.close()
                    endpoint.close_episode(key)
                    if progress is not None:
                        progress(1)
                out.sequences, out.requests, out.splits = traj.leaves(), traj.requests, traj.splits
                if out.failure is not None:
                    out.reward, out.metrics = 0.0, {}
                    if self.on_error == "drop":
                        out.sequences = []
                return out

        async with self.serving() if self.serving is not None else contextlib.nullcontext():
            return list(await asyncio.gather(*(one(r) for r in rows)))


def harness_metrics(results: list[EpisodeResult]) -> dict[str, float]:
    """The rollout's ``harness/*`` counts and means, and the harnesses' own metrics as ``harness/<name>/mean``."""
    n = max(len(results), 1)
    out = {
        "harness/episodes": float(len(results)),
        "harness/errors": float(sum(r.failure == "error" for r in results)),
        "harness/timeouts": float(sum(r.failure == "timeout" for r in results)),
        "harness/bad_rewards": float(sum(r.failure == "bad_reward" for r in results)),
        "harness/requests/mean": sum(r.requests for r in results) / n,
        "harness/sequences/mean": sum(len(r.sequences) for r in results) / n,
        "harness/splits": float(sum(r.splits for r in results)),
        "harness/reward/mean": sum(r.reward for r in results) / n,
    }
    names = sorted({k for r in results for k in r.metrics})
    for name in names:
        values = [r.metrics[name] for r in results if name in r.metrics]
        out[f"harness/{name}/mean"] = sum(values) / len(values)
    return out
