"""Slot-based KV cache: one contiguous (slots, KV heads, positions, head dim) block per layer for K and V.

A slot holds one sequence. Keeping every slot as a dense row lets decode attention read the cache with
plain SDPA (``enable_gqa=True``), which DESIGN.md section 8 measured at near-copy bandwidth; a paged cache
would need its own kernel. The whole cache is one allocation so that ``free()`` hands all of it back.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from hybridflow.engine.ops.packing import to_device

logger = logging.getLogger(__name__)


class KVCache:
    """Per-layer K and V of shape (num_slots, KVH, L, D), all views of one tensor."""

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, value in (
            ("num_layers", num_layers),
            ("num_slots", num_slots),
            ("max_len", max_len),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if value < 1:
                raise ValueError(f"KVCache {name} must be >= 1, got {value}")
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.max_len = max_len
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        # (layers, 2, S, KVH, L, D): K at [:, 0], V at [:, 1]; slot-major within a layer so that slots
        # 0..B-1 are one contiguous slice for decode and a slot copy moves whole rows.
        self._storage: torch.Tensor | None = torch.zeros(
            num_layers, 2, num_slots, num_kv_heads, max_len, head_dim, dtype=dtype, device=self.device
        )
        self.k: list[torch.Tensor] = [self._storage[i, 0] for i in range(num_layers)]  # each (S, KVH, L, D)
        self.v: list[torch.Tensor] = [self._storage[i, 1] for i in range(num_layers)]  # each (S, KVH, L, D)
        logger.debug(
            "KV cache: %d layers x %d slots x %d positions, %.1f MiB",
            num_layers,
            num_slots,
            max_len,
            self.nbytes() / 2**20,
        )

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Bytes of K and V that one cached token takes over all layers."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * head_dim * itemsize

    @property
    def storage(self) -> torch.Tensor:
        """The one (layers, 2, S, KVH, L, D) tensor behind every per-layer view (K at [:, 0], V at [:, 1])."""
        if self._storage is None:
            raise ValueError("the KV cache was freed; allocate a new KVCache before using it")
        return self._storage

    @property
    def is_allocated(self) -> bool:
        """Whether the cache still holds its memory (false after ``free()``)."""
        return self._storage is not None

    def nbytes(self) -> int:
        """Bytes held by the cache (0 after ``free()``)."""
        return 0 if self._storage is None else self._storage.numel() * self._storage.element_size()

    def free(self) -> None:
        """Drop every tensor so the allocator can hand the memory back to training."""
        self._storage = None
        self.k = []
        self.v = []

    def _check_slot(self, slot: int, what: str) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"{what} slot {slot} is out of range [0, {self.num_slots})")

    def _check_length(self, length: int | None) -> int:
        if self._storage is None:
            raise ValueError("the KV cache was freed; allocate a new KVCache before using it")
        if length is None:
            return self.max_len
        if not 0 <= length <= self.max_len:
            raise ValueError(f"length {length} is out of range [0, {self.max_len}]")
        return length

    def copy_slot(self, src: int, dst_slots: Sequence[int] | torch.Tensor, length: int | None = None) -> None:
        """Copy the first ``length`` positions (default all) of slot ``src`` into each of ``dst_slots``.

        This is prefix sharing: the n samples of one prompt reuse one prefill. One indexed copy for all
        layers and destinations; positions past ``length`` in the destinations are left untouched.
        """
        length = self._check_length(length)
        self._check_slot(src, "source")
        dst = torch.as_tensor(dst_slots, dtype=torch.long).flatten()
        if dst.numel() == 0 or length == 0:
            return
        for slot in dst.tolist():
            self._check_slot(slot, "destination")
            if slot == src:
                raise ValueError(f"copy_slot destination {slot} equals the source slot")
        dst = to_device(dst, self.device)  # no stream sync: the copy is queued behind prefill
        src_rows = self._storage[:, :, src : src + 1, :, :length]  # (layers, 2, 1, KVH, length, D)
        # Advanced index in dim 2 with slices around it: index_put_ broadcasts the single source row.
        self._storage[:, :, dst, :, :length] = src_rows

    def move_slot(self, src: int, dst: int, length: int | None = None) -> None:
        """Move the first ``length`` positions (default all) of slot ``src`` to slot ``dst`` (compaction)."""
        length = self._check_length(length)
        self._check_slot(src, "source")
        self._check_slot(dst, "destination")
        if src == dst or length == 0:
            return
        self._storage[:, :, dst, :, :length] = self._storage[:, :, src, :, :length]


@torch.library.custom_op("hybridflow::write_kv", mutates_args=("kv_storage",))
def write_kv(
    k: torch.Tensor,  # (n, KVH, D)
    v: torch.Tensor,  # (n, KVH, D)
    kv_storage: torch.Tensor,  # (layers, 2, S, KVH, L, D)
    layer: int,
    slots: torch.Tensor,  # (n,)
    positions: torch.Tensor,  # (n,)
) -> None:
    """Write n tokens' k and v into ``layer`` of the whole cache tensor, token i at (slots[i], positions[i]).

    An op on the cache's one tensor (as ``hybridflow::decode_attention_rope``), so that a compiled prefill
    updates the cache in place instead of cloning it around the write.
    """
    kv_storage[layer, 0, slots, :, positions] = k
    kv_storage[layer, 1, slots, :, positions] = v


@write_kv.register_fake
def _(k, v, kv_storage, layer, slots, positions):  # the op's signature
    return None
