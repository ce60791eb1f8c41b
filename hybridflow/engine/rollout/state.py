"""Per-seat decoding state kept on the device, so a decode step needs no host synchronisation."""

from __future__ import annotations

import torch

# Finish reasons, stored as small ints on the device and named on the host.
RUNNING, EOS, STOP, LENGTH = 0, 1, 2, 3
REASONS = {EOS: "eos", STOP: "stop", LENGTH: "length"}


def _member(tokens: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``tokens`` (b,) in ``ids`` (k,), as one broadcast compare: CUDA-graph safe for any k.

    ``torch.isin`` switches to a sort-based algorithm for longer id lists, which cannot run inside CUDA-graph
    capture (16 EOS ids made the capture fail with cudaErrorStreamCaptureUnsupported on an H200).
    """
    return (tokens[:, None] == ids[None, :]).any(dim=-1)  # (b, k) -> (b,)


class DecodeState:
    """Tensors indexed by seat (``seats.Seats``): the token to feed next, its position, and the tokens generated
    so far.

    Output buffers have one spare column (index ``max_new``): a finished sequence that keeps riding along in
    the decode batch until the next host sync writes there, so it never overwrites its real tokens.
    """

    def __init__(
        self, num_slots: int, max_new: int, stop_ids: list[int], eos_ids: list[int], device: torch.device
    ):
        self.max_new = max_new
        self.last_token = torch.zeros(num_slots, dtype=torch.long, device=device)  # (S,)
        self.position = torch.zeros(num_slots, dtype=torch.long, device=device)  # (S,) next cache position
        # (S,) M-RoPE's rope delta (a vision-language model): the fed token's RoPE position is position + delta
        self.rope_delta = torch.zeros(num_slots, dtype=torch.long, device=device)
        self.gen_len = torch.zeros(num_slots, dtype=torch.long, device=device)  # (S,)
        self.limit = torch.zeros(num_slots, dtype=torch.long, device=device)  # (S,) most tokens allowed
        self.done = torch.ones(num_slots, dtype=torch.bool, device=device)  # (S,)
        self.reason = torch.zeros(num_slots, dtype=torch.long, device=device)  # (S,)
        self.tokens = torch.zeros(num_slots, max_new + 1, dtype=torch.long, device=device)  # (S, W + 1)
        self.logprobs = torch.zeros(num_slots, max_new + 1, dtype=torch.float32, device=device)  # (S, W + 1)
        self.eos_ids = torch.tensor(eos_ids, dtype=torch.long, device=device)
        self.stop_ids = torch.tensor(stop_ids, dtype=torch.long, device=device)
        self._rows = torch.arange(num_slots, device=device)

    def begin(
        self,
        slots: torch.Tensor,
        position: torch.Tensor,
        limit: torch.Tensor,
        rope_delta: torch.Tensor | None = None,
    ) -> None:
        """Reset ``slots`` (b,) for sequences whose first ``position`` (b,) tokens are in the cache, each to
        sample at most ``limit`` (b,) tokens (at most ``max_new``); ``rope_delta`` (b,) their M-RoPE deltas."""
        # index_fill_ for the constants: ``t[slots] = 0`` copies the scalar up from the host first, which
        # synchronises the stream (the host could no longer queue prefill chunks ahead of the GPU).
        self.position[slots] = position
        if rope_delta is None:
            self.rope_delta.index_fill_(0, slots, 0)
        else:
            self.rope_delta[slots] = rope_delta
        self.gen_len.index_fill_(0, slots, 0)
        self.limit[slots] = limit
        self.done.index_fill_(0, slots, False)
        self.reason.index_fill_(0, slots, RUNNING)

    def record(
        self, idx: torch.Tensor | slice, tokens: torch.Tensor, logprobs: torch.Tensor, advance: bool
    ) -> None:
        """Append sampled ``tokens`` (and log-probs) to the sequences in ``idx``; mark the finished ones.

        ``advance`` moves the feed position on by one: true after a decode step (the fed token now sits in
        the cache), false after prefill (the first sampled token goes right after the prompt).
        """
        active = ~self.done[idx]  # (b,)
        rows = self._rows[idx]  # (b,)
        col = torch.where(
            active, self.gen_len[idx], self.max_new
        )  # (b,) finished rows write the spare column
        self.tokens[rows, col] = tokens
        self.logprobs[rows, col] = logprobs
        self.gen_len[idx] += active
        is_eos = active & _member(tokens, self.eos_ids)
        is_stop = active & _member(tokens, self.stop_ids) & ~is_eos
        at_limit = active & (self.gen_len[idx] >= self.limit[idx]) & ~is_eos & ~is_stop
        reason = torch.where(
            is_eos, EOS, torch.where(is_stop, STOP, torch.where(at_limit, LENGTH, self.reason[idx]))
        )
        self.reason[idx] = reason
        self.done[idx] |= is_eos | is_stop | at_limit
        self.last_token[idx] = tokens
        if advance:  # a finished row stops, so it never writes past the positions reserved for it
            self.position[idx] += ~self.done[idx] & active

    def park(self, first_free: int) -> None:
        """Mark seats from ``first_free`` on as done, so padding rows of a graphed step stay inert."""
        self.done[first_free:] = True

    def move(self, src: int, dst: int) -> None:
        """Copy seat ``src``'s state into seat ``dst`` (the last seat moving into a freed one)."""
        for t in (
            self.last_token,
            self.position,
            self.rope_delta,
            self.gen_len,
            self.limit,
            self.done,
            self.reason,
            self.tokens,
            self.logprobs,
        ):
            t[dst] = t[src]
