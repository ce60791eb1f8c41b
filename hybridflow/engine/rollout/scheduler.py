"""Continuous-batching bookkeeping: which prompt groups enter the KV cache, their prefill chunks, and slots.

Running sequences always occupy the dense slot range ``[0, num_running)`` so a decode step runs on plain
views of the cache (no gather of scattered slots). A prompt group of n samples takes n adjacent slots; its
prompt is prefilled once into the first and copied to the others (prefix sharing). When sequences finish,
the last running slots move into the holes. Everything here is plain Python: the engine does the tensors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class PromptGroup:
    """One prompt and its n samples."""

    index: int  # position of the prompt in the generate() call
    token_ids: list[int]
    n: int
    first_slot: int = -1  # the prompt is prefilled here, then copied to first_slot + 1 .. first_slot + n - 1


@dataclass
class PrefillChunk:
    """A contiguous piece of one prompt to run through prefill."""

    group: PromptGroup
    start: int  # first prompt position of the chunk (> 0 continues a chunked prefill)
    length: int

    @property
    def last(self) -> bool:
        """True when the chunk ends the prompt (its logits give the first sampled token)."""
        return self.start + self.length == len(self.group.token_ids)


@dataclass
class SlotScheduler:
    """FIFO admission of prompt groups into ``num_slots`` cache slots, with a prefill token budget."""

    num_slots: int
    max_batched_tokens: int
    groups: list[PromptGroup]
    waiting: deque[PromptGroup] = field(init=False)
    owner: list[tuple[int, int]] = field(init=False, default_factory=list)  # slot -> (prompt, sample)

    def __post_init__(self) -> None:
        widest = max((g.n for g in self.groups), default=1)
        if widest > self.num_slots:
            raise ValueError(
                f"n={widest} samples per prompt need {widest} KV-cache slots but only {self.num_slots} fit; "
                "raise rollout.max_num_seqs or rollout.gpu_memory_utilization, or lower max_model_len"
            )
        self.waiting = deque(self.groups)

    @property
    def num_running(self) -> int:
        """Slots in use, always the dense range [0, num_running)."""
        return len(self.owner)

    @property
    def done(self) -> bool:
        """True when nothing waits and nothing runs."""
        return not self.waiting and not self.owner

    def admit(self) -> list[list[PrefillChunk]]:
        """Admit waiting groups that fit into free slots; return their prefill calls (each within budget).

        Short prompts share a call while ``rows x longest chunk`` stays within the budget (the call is
        right-padded); a prompt longer than the budget is split into budget-sized chunks, one per call.
        """
        admitted = []
        while self.waiting and self.num_slots - self.num_running >= self.waiting[0].n:
            group = self.waiting.popleft()
            group.first_slot = self.num_running
            self.owner.extend((group.index, s) for s in range(group.n))
            admitted.append(group)
        calls: list[list[PrefillChunk]] = []
        current: list[PrefillChunk] = []
        for group in admitted:
            total = len(group.token_ids)
            for start in range(0, total, self.max_batched_tokens):
                chunk = PrefillChunk(group, start, min(self.max_batched_tokens, total - start))
                longest = max([c.length for c in current] + [chunk.length])
                if current and (len(current) + 1) * longest > self.max_batched_tokens:
                    calls.append(current)
                    current = []
                current.append(chunk)
                if not chunk.last:  # a continuation must see its earlier chunk in the cache: new call
                    calls.append(current)
                    current = []
        if current:
            calls.append(current)
        return calls

    def release(self, finished: list[int]) -> list[tuple[int, int]]:
        """Free the given slots; return the ``(src, dst)`` moves that keep running slots dense."""
        free = set(finished)
        moves = []
        holes = sorted(s for s in free if s < self.num_running)
        for hole in holes:
            last = self.num_running - 1
            while last in free and last > hole:  # drop finished slots from the tail first
                self.owner.pop()
                free.discard(last)
                last -= 1
            if hole >= self.num_running:
                continue
            if last == hole:
                self.owner.pop()
            else:
                self.owner[hole] = self.owner.pop()
                moves.append((last, hole))
            free.discard(hole)
        return moves
