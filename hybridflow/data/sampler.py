"""A seeded, resumable sampler of prompt-index batches.

The order of epoch ``e`` is a function of ``(seed, e)`` only (a fresh generator per epoch), so a resumed
run needs just ``(epoch, position)`` to continue with exactly the batches an uninterrupted run would see.

    sampler = PromptSampler(len(dataset), batch_size=16, seed=42)
    for epoch in range(sampler.epoch, total_epochs):
        for indices in sampler:          # the rest of the current epoch
            ...                          # checkpoint: sampler.state_dict()
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from hybridflow.utils.errors import UserError


class PromptSampler:
    """Batches of dataset indices, epoch after epoch; ``len()`` is the number of batches per epoch."""

    def __init__(
        self, num_items: int, batch_size: int, seed: int, shuffle: bool = True, drop_last: bool = True
    ) -> None:
        if batch_size < 1:
            raise UserError(f"batch_size must be >= 1, got {batch_size}")
        if num_items < 1:
            raise UserError("the dataset is empty; no batches to sample")
        if drop_last and num_items < batch_size:
            raise UserError(
                f"only {num_items} prompts for batches of {batch_size} with drop_last: no full batch; "
                "lower data.train_batch_size or add prompts"
            )
        self.num_items, self.batch_size, self.seed = num_items, batch_size, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        self.epoch = 0  # the epoch the next batch comes from
        self.position = 0  # the index of the next batch within that epoch

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_items // self.batch_size
        return -(-self.num_items // self.batch_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The permutation of all indices for ``epoch`` (identity without shuffle)."""
        if not self.shuffle:
            return np.arange(self.num_items)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_items)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """All index batches of ``epoch``, in order."""
        order = self.epoch_order(epoch).tolist()
        return [order[i * self.batch_size : (i + 1) * self.batch_size] for i in range(len(self))]

    def next_batch(self) -> list[int]:
        """The next batch, moving on to the next epoch after the last batch of this one."""
        batch = self.epoch_batches(self.epoch)[self.position]
        self._advance()
        return batch

    def _advance(self) -> None:
        # Roll over as soon as the last batch is handed out, so a checkpoint taken while it is being
        # trained on already points at the start of the next epoch.
        self.position += 1
        if self.position == len(self):
            self.epoch, self.position = self.epoch + 1, 0

    def __iter__(self) -> Iterator[list[int]]:
        """The remaining batches of the current epoch (all of them when starting at position 0)."""
        epoch = self.epoch
        batches = self.epoch_batches(epoch)
        while self.epoch == epoch:
            batch = batches[self.position]
            self._advance()
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The position (epoch, batch within it) plus the settings that must match on resume."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_items": self.num_items,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved position; the dataset size and sampler settings must be the same."""
        for key in ("seed", "num_items", "batch_size", "shuffle", "drop_last"):
            if key in state and state[key] != getattr(self, key):
                raise UserError(
                    f"cannot resume the data sampler: {key} was {state[key]!r} when saved but is "
                    f"{getattr(self, key)!r} now; resume with the same data and data/seed settings, "
                    "or start a fresh run"
                )
        if not 0 <= state["position"] < len(self) or state["epoch"] < 0:
            raise UserError(f"invalid sampler state: epoch {state['epoch']}, position {state['position']}")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
