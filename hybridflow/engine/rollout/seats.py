"""The paged engine's running batch on the device: a seat per running sequence, its decode state and its
block-table row, and the decode step that CUDA graphs replay.

Seats are dense: the running sequences sit in seats [0, B), so a decode step runs on plain prefixes of the
state and table tensors and a graph per batch bucket covers it (``graphs.DecodeGraphs``). A sequence that
leaves moves the last seat into its place: its state row and its table row move, never its K and V (those
stay in their blocks). Every tensor here is allocated once per session and written in place, because the
captured graphs hold their addresses.

Block ids on the device are the pool's ids + 1: block 0 is scratch, where the table rows of empty seats and
the unreserved tail of every row point, so the padding rows of a graphed step (and a finished sequence
riding along until the next sync) write only there, never into another sequence's blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from hybridflow.engine.ops.packing import to_device
from hybridflow.engine.rollout.decode_loop import Sampler
from hybridflow.engine.rollout.kv_cache import PagedKVCache
from hybridflow.engine.rollout.state import REASONS, DecodeState

# decode(ids (B,), positions (B,), cache, tables (B, W), live (B,) or None) -> logits (B, V)
Decode = Callable[[torch.Tensor, torch.Tensor, PagedKVCache, torch.Tensor], torch.Tensor]


class Seats:
    """``num_seats`` decode rows over a paged cache whose block tables are ``width`` blocks wide."""

    def __init__(
        self,
        num_seats: int,
        width: int,
        max_new: int,
        stop_ids: list[int],
        eos_ids: list[int],
        device: torch.device,
        mrope: bool = False,
    ) -> None:
        """``mrope``: decode feeds RoPE each seat's position + its rope delta (a vision-language model)."""
        self.num_seats, self.width, self.device, self.mrope = num_seats, width, device, mrope
        self.state = DecodeState(num_seats, max_new, stop_ids, eos_ids, device)
        self.tables = torch.zeros(num_seats, width, dtype=torch.int32, device=device)  # (S, W), 0 = scratch
        self.host_tables = np.zeros((num_seats, width), dtype=np.int32)  # the next upload
        self.synced: list[int] = []  # per occupied seat: buffered tokens already handed to the host
        self.owner: list[int] = []  # per occupied seat: the sequence id

    @property
    def num_used(self) -> int:
        """Occupied seats, always the dense range [0, num_used)."""
        return len(self.owner)

    def take(self, seq_id: int) -> int:
        """The next free seat, for ``seq_id``."""
        assert self.num_used < self.num_seats, "no free seat: the scheduler admits within num_seats"
        self.owner.append(seq_id)
        self.synced.append(0)
        return self.num_used - 1

    def set_table(self, seat: int, blocks: list[int]) -> None:
        """The seat's block table (pool ids), uploaded with the next ``upload``."""
        row = self.host_tables[seat]
        row[:] = 0
        row[: len(blocks)] = np.asarray(blocks, dtype=np.int32) + 1

    def upload(self) -> None:
        """Send the host's table rows up (before a decode round; the graphs read ``tables`` in place)."""
        self.tables.copy_(to_device(torch.from_numpy(self.host_tables.copy()), self.device))

    def begin(
        self, seats: list[int], positions: list[int], limits: list[int], deltas: list[int] | None = None
    ) -> None:
        """Start decode state for sequences whose first ``positions`` tokens are cached (``deltas``: their
        M-RoPE rope deltas)."""
        idx, pos, lim = (to_device(torch.tensor(x), self.device) for x in (seats, positions, limits))
        delta = None if deltas is None else to_device(torch.tensor(deltas), self.device)
        self.state.begin(idx, pos, lim, delta)

    def leave(self, seat: int) -> int | None:
        """Free ``seat``; the last seat moves into it. Returns the id of the sequence that moved, or None."""
        last = self.num_used - 1
        moved = None
        if seat != last:
            self.state.move(last, seat)
            self.host_tables[seat] = self.host_tables[last]
            self.owner[seat], self.synced[seat] = self.owner[last], self.synced[last]
            moved = self.owner[seat]
        self.owner.pop()
        self.synced.pop()
        self.host_tables[last] = 0
        self.state.park(self.num_used)
        return moved

    def counts(self) -> tuple[list[int], list[str | None]]:
        """Per occupied seat: tokens sampled since it began, and how it ended (None: running). Syncs once."""
        b, st = self.num_used, self.state
        if not b:
            return [], []
        ended = torch.where(st.done[:b], st.reason[:b], -1)  # (b,)
        packed = torch.stack([st.gen_len[:b], ended]).cpu().tolist()  # (2, b)
        return packed[0], [REASONS.get(r) for r in packed[1]]

    def fetch(self, seats: list[int], gen: list[int]) -> list[tuple[list[int], list[float]]]:
        """The tokens and log-probs ``seats`` sampled since their last fetch (``gen``: ``counts``' figures)."""
        if not seats:
            return []
        wide = max(max(gen[i] - self.synced[i] for i in seats), 1)
        start = torch.tensor([self.synced[i] for i in seats])
        cols = to_device((start[:, None] + torch.arange(wide)).clamp(max=self.state.max_new), self.device)
        rows = to_device(torch.tensor(seats), self.device)[:, None]
        tokens = self.state.tokens[rows, cols].cpu().numpy()  # (k, wide)
        logprobs = self.state.logprobs[rows, cols].cpu().numpy()
        out = []
        for k, i in enumerate(seats):
            n = gen[i] - self.synced[i]
            self.synced[i] = gen[i]
            out.append((tokens[k, :n].tolist(), logprobs[k, :n].tolist()))
        return out

    def decode_step(
        self, b: int, decode: Decode, cache: PagedKVCache, pick: Sampler, record: Callable
    ) -> None:
        """One decode step for seats [0, b): feed each last token, sample, record (graph-capturable)."""
        st = self.state
        live = None if cache.routing is None else ~st.done[:b]  # routing records of finished rows: scratch
        if self.mrope:  # generated tokens are text: all three M-RoPE rows at position + delta
            rope = st.position[:b] + st.rope_delta[:b]  # (b,)
            logits = decode(st.last_token[:b], st.position[:b], cache, self.tables[:b], live, rope)
        else:
            logits = decode(st.last_token[:b], st.position[:b], cache, self.tables[:b], live)  # (b, V)
        tokens, logprobs = pick(logits)
        record(st, slice(0, b), tokens, logprobs, True)
