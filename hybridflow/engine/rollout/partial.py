"""Partial rollouts: generate until enough groups have finished, hand back the unfinished ones with what they
sampled so far, and continue them later, possibly under newer weights (asynchronous RL, ``colocate``).

A group is a prompt's n samples (GRPO's unit); a sample keeps every token it sampled with that token's
log-prob and the weight version that sampled it. ``roll_partial`` runs one phase on the paged engine's step
API: new groups share their prompt's prefill; a sample carried over from an earlier phase is added again as
its prompt plus its tokens so far (one sample, re-prefilled under the current weights, the rest of its budget
left), so its next tokens come from the current version while the earlier ones keep theirs. The phase ends
once ``quota`` groups are complete and every group named in ``finish`` is (a group that could not be carried
once more without growing too stale); the rest are aborted, keeping their tokens.

Re-prefilling is the exact way to continue under new weights (cached K and V of the old weights would mix
two policies inside one token's attention); it costs one prefill of the partial sequence per phase.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from hybridflow.engine.rollout.engine import PagedEngine
from hybridflow.engine.rollout.sampling import SamplingParams
from hybridflow.engine.rollout.sequence import Sequence
from hybridflow.utils.errors import UserError


@dataclass
class SampleState:
    """One sample so far: its response tokens, their log-probs and versions; how it ended (None: unfinished)."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def done(self) -> bool:
        """Whether the sample has finished (eos, stop or length)."""
        return self.finish_reason is not None


@dataclass
class GroupState:
    """A prompt and its n samples (empty states until it first runs)."""

    key: int  # the driver's id of the group
    prompt: list[int]
    samples: list[SampleState]

    @property
    def done(self) -> bool:
        """Whether every sample has finished."""
        return all(s.done for s in self.samples)

    @property
    def started(self) -> bool:
        """Whether any sample has a token."""
        return any(s.tokens for s in self.samples)

    def oldest_version(self) -> int | None:
        """The oldest weight version among its sampled tokens (None: nothing sampled yet)."""
        versions = [v for s in self.samples for v in s.versions if v >= 0]
        return min(versions) if versions else None


def new_group(key: int, prompt: list[int], n: int) -> GroupState:
    """A group that has not run yet."""
    return GroupState(key, list(prompt), [SampleState() for _ in range(n)])


def _add(engine: PagedEngine, group: GroupState, params: SamplingParams) -> dict[int, SampleState]:
    """Queue a group's unfinished samples: all n on one shared prefill if none has started, else each alone
    as its prompt plus its tokens so far, with the rest of its response budget."""
    if not group.started:
        ids = engine.add(group.prompt, dataclasses.replace(params, n=len(group.samples)))
        return dict(zip(ids, group.samples))
    out = {}
    one = dataclasses.replace(params, n=1)
    for sample in (s for s in group.samples if not s.done):
        left = params.max_new_tokens - len(sample.tokens)
        (seq_id,) = engine.add(group.prompt + sample.tokens, one, max_new=left)
        out[seq_id] = sample
    return out


def _take(sample: SampleState, seq: Sequence) -> None:
    """Append what a sequence sampled in this phase to its sample's state."""
    sample.tokens += seq.response
    sample.logprobs += seq.logprobs
    sample.versions += seq.versions
    if seq.finish_reason not in (None, "abort"):
        sample.finish_reason = seq.finish_reason


def roll_partial(
    engine: PagedEngine,
    groups: list[GroupState],
    params: SamplingParams,
    quota: int,
    version: int,
    finish: frozenset[int] = frozenset(),
) -> list[GroupState]:
    """Run ``groups`` until ``quota`` of them are done and every group whose key is in ``finish`` is, then
    abort the rest keeping their tokens; returns ``groups``, updated in place. Tokens sampled here carry
    ``version``."""
    if engine.has_work:
        raise ValueError("roll_partial needs an idle engine")
    if engine.runner.visual is not None:  # a group would need its images through every phase
        raise UserError(
            "trainer.async_mode=colocate (partial rollouts) does not carry images yet; use "
            "trainer.async_mode=sync for a vision-language model"
        )
    if any(len(g.samples) != params.n for g in groups):
        raise UserError(f"every group of a partial rollout has rollout.n={params.n} samples")
    engine.version = version
    engine.reset_stats()
    running: dict[int, SampleState] = {}
    for g in groups:
        if not g.done:
            running.update(_add(engine, g, params))
    while running and not _phase_over(groups, quota, finish):
        # sync_interval decode steps per round: the host sees which samples ended (EOS) that often
        touched = engine.step(max_tokens=engine.cfg.sync_interval, fetch_all=False)
        if engine.stalled:
            engine.abort(list(running))
            raise UserError(
                "the KV pool cannot hold the next sequence of a partial rollout; raise "
                "rollout.gpu_memory_utilization or lower data.max_response_length"
            )
        for seq in touched:
            if seq.finish_reason is not None and seq.id in running:
                _take(running.pop(seq.id), seq)
    for seq in engine.abort(list(running)):
        _take(running.pop(seq.id), seq)
    return groups


def _phase_over(groups: list[GroupState], quota: int, finish: frozenset[int]) -> bool:
    """Whether enough groups are done and none that must finish is still running."""
    done = sum(g.done for g in groups)
    return done >= quota and all(g.done for g in groups if g.key in finish)
