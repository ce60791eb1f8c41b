"""The paged KV cache's device side: one pool of fixed-size blocks per layer, written and read through block
tables, with the CPU reference of decode attention over it; ``block_pool.BlockPool`` decides which block holds
what.

Layout: (layers, 2, blocks, KV heads, block_size, head dim), K at [:, 0] and V at [:, 1]. Position p of a
sequence lives in block ``table[p // block_size]`` at offset ``p % block_size``: a token's write is one indexed
store, whatever block it falls in, and each KV head's part of a block is one contiguous (block_size, D) run
that the paged kernel streams (a position-major block interleaves the heads: half of every run the other
head's). Block tables are fixed-shape (B, max_blocks) tensors (unused entries any valid block id, masked by
the lengths), so a decode step's shapes do not change as sequences grow: what CUDA graphs need.

FP8 (``rollout.kv_cache_dtype=fp8``): the storage is float8_e4m3fn and ``scales`` (layers, 2, KVH) float32
holds one scale per (layer, K or V, KV head): a stored value x stands for x * scale. Writes quantise
(``write_kv_paged_fp8``: divide, clamp to +-448, round), reads dequantise (``gather``, the Triton kernel).
The scales are calibrated on the first prefill after each weight refresh (``calibrate_kv_scales``) and filled
in place, so a CUDA graph captured on them stays valid.

Router replay's records (a mixture of experts, asked for): ``routing`` (blocks, block_size, sparse layers, k)
uint8 holds each cached position's chosen experts beside its K and V, so prefix sharing, forks and preemption
treat them exactly as the K and V they came with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridflow.engine.ops.fp8 import FP8, FP8_MAX, MIN_SCALE

# The calibrated range over the prefill's largest magnitude: the scale is margin * amax / 448. e4m3 is a
# floating-point format (3 mantissa bits: ~6% relative precision at any magnitude), so headroom costs
# precision only at the bottom of the range (one binade of 17 goes subnormal), while decode tokens whose K
# or V exceed the prefill's largest value by up to 2x are still represented instead of saturating at 448.
KV_SCALE_MARGIN = 2.0
KV_DTYPES = ("auto", "fp8")  # rollout.kv_cache_dtype: the model's dtype, or e4m3 with per-head scales


class PagedKVCache:
    """K and V of ``num_blocks`` blocks of ``block_size`` positions per layer, in one allocation."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        routing: tuple[int, int] | None = None,
        fp8: bool = False,
    ) -> None:
        """``routing``: (sparse layers, experts per token) to keep each position's routing (uint8 ids).
        ``fp8``: store K and V in e4m3 with per-(layer, KV head) scales; ``dtype`` is then what reads return."""
        sizes = dict(layers=num_layers, blocks=num_blocks, block_size=block_size, kv_heads=num_kv_heads)
        bad = {k: v for k, v in {**sizes, "head_dim": head_dim}.items() if v < 1}
        if bad:
            raise ValueError(f"PagedKVCache sizes must be >= 1, got {bad}")
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.dtype = dtype  # what attention reads (the compute dtype)
        shape = (num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim)  # (layers, 2, N, KVH, bs, D)
        self.storage = torch.zeros(shape, dtype=FP8 if fp8 else dtype, device=device)
        self.scales = None  # FP8: (layers, 2, KVH) float32, static (filled in place)
        self.calibrate = False  # FP8: the next prefill sets the scales (after a weight refresh)
        if fp8:
            self.scales = torch.ones(num_layers, 2, num_kv_heads, dtype=torch.float32, device=device)
            self.calibrate = True
        self.routing = None
        if routing is not None:
            self.routing = torch.zeros(
                num_blocks, block_size, *routing, dtype=torch.uint8, device=device
            )  # (N, bs, sparse layers, k)

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        """Bytes one block takes over all layers (K and V): the unit a memory budget is divided by."""
        return (
            2
            * num_layers
            * block_size
            * num_kv_heads
            * head_dim
            * torch.empty((), dtype=dtype).element_size()
        )

    @property
    def fp8(self) -> bool:
        """Whether K and V are stored in FP8 (with ``scales``)."""
        return self.scales is not None

    def locate(
        self, tables: torch.Tensor, seq: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Where ``positions`` (n,) of the sequences ``seq`` (n,) whose block tables are ``tables`` (B,
        max_blocks) live: (block ids (n,), offsets in the block (n,)), for a write or a read of those tokens."""
        return tables[seq, positions // self.block_size], positions % self.block_size

    def write(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, where: tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        """Store K and V of n tokens, each (n, KVH, D), at ``where`` (from ``locate``) in ``layer``."""
        if self.fp8:
            write_kv_paged_fp8(k, v, self.storage, self.scales, layer, *where)
        else:
            write_kv_paged(k, v, self.storage, layer, *where)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src`` into ``dst`` in every layer: a forked sequence's own copy of a partial block."""
        self.storage[:, :, dst] = self.storage[:, :, src]
        if self.routing is not None:
            self.routing[dst] = self.routing[src]

    def routing_of(self, blocks: list[int], length: int) -> torch.Tensor:
        """The recorded experts of a sequence's first ``length`` positions held in ``blocks`` (device ids), on
        the host: (length, sparse layers, k) uint8."""
        assert self.routing is not None, "this cache keeps no routing"
        idx = torch.tensor(blocks, dtype=torch.long, device=self.routing.device)
        return self.routing[idx].flatten(0, 1)[:length].cpu()  # (length, L, k)

    def gather(self, layer: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of every sequence's blocks in position order, each (B, max_blocks * block_size, KVH, D)."""
        return read_kv_paged(self.storage, self.scales, layer, tables, self.dtype)


def read_kv_paged(
    kv_storage: torch.Tensor,  # (layers, 2, N, KVH, bs, D)
    kv_scales: torch.Tensor | None,  # (layers, 2, KVH) with an FP8 storage
    layer: int,
    tables: torch.Tensor,  # (B, M)
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of ``layer`` through block ``tables`` in position order, dequantised from FP8 where stored so,
    each (B, M * bs, KVH, D) in ``dtype``."""
    if kv_scales is None:
        k = kv_storage[layer, 0][tables].transpose(2, 3).flatten(1, 2)  # (B, L, KVH, D)
        v = kv_storage[layer, 1][tables].transpose(2, 3).flatten(1, 2)
        return k, v
    raw = kv_storage.view(torch.uint8)  # gathered as bytes (see write_kv_paged_fp8)
    k = raw[layer, 0][tables].view(FP8).transpose(2, 3).flatten(1, 2)  # (B, L, KVH, D)
    v = raw[layer, 1][tables].view(FP8).transpose(2, 3).flatten(1, 2)
    sk, sv = kv_scales[layer, 0][:, None], kv_scales[layer, 1][:, None]  # (KVH, 1): per head
    return (k.float() * sk).to(dtype), (v.float() * sv).to(dtype)


def kv_scales_for(amax: torch.Tensor) -> torch.Tensor:
    """The per-head scales of K or V whose largest magnitudes over the calibration tokens are ``amax`` (KVH,)."""
    return amax.float().clamp(min=MIN_SCALE) * KV_SCALE_MARGIN / FP8_MAX


def quantise_kv(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` (n, KVH, D) in FP8 with the per-head ``scale`` (KVH,); beyond the range saturates at +-448."""
    return (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def paged_decode_attention(
    q: torch.Tensor,  # (B, H, D): each sequence's newest query, its K and V already written
    cache: PagedKVCache,
    layer: int,
    tables: torch.Tensor,  # (B, max_blocks)
    lengths: torch.Tensor,  # (B,) positions each sequence attends to (its newest token included)
    scale: float | None = None,
) -> torch.Tensor:
    """Decode attention through block tables, the CPU reference: gather each sequence's blocks, mask the
    positions past its length, and attend with grouped KV heads. Returns (B, H, D)."""
    k, v = cache.gather(layer, tables)  # (B, L, KVH, D), L = max_blocks * block_size
    positions = torch.arange(k.shape[1], device=q.device)  # (L,)
    mask = positions[None, :] < lengths[:, None]  # (B, L)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # (B, H, 1, D)
        k.transpose(1, 2),  # (B, KVH, L, D)
        v.transpose(1, 2),
        attn_mask=mask[:, None, None, :],  # (B, 1, 1, L)
        scale=scale,
        enable_gqa=True,
    )  # (B, H, 1, D)
    return out.squeeze(2)


@torch.library.custom_op("hybridflow::write_kv_paged", mutates_args=("kv_storage",))
def write_kv_paged(
    k: torch.Tensor,  # (n, KVH, D)
    v: torch.Tensor,  # (n, KVH, D)
    kv_storage: torch.Tensor,  # (layers, 2, N, KVH, bs, D)
    layer: int,
    blocks: torch.Tensor,  # (n,)
    offsets: torch.Tensor,  # (n,)
) -> None:
    """Write n tokens' k and v into ``layer`` of the paged cache, token i in block ``blocks[i]`` at
    ``offsets[i]``. An op on the cache's one tensor, so a compiled prefill updates it in place (a view as a
    mutated input would make inductor clone the storage around the write)."""
    kv_storage[layer, 0, blocks, :, offsets] = k  # indices split by a slice: (n, KVH, D)
    kv_storage[layer, 1, blocks, :, offsets] = v


@write_kv_paged.register_fake
def _(k, v, kv_storage, layer, blocks, offsets):  # the op's signature
    return None


@torch.library.custom_op("hybridflow::write_kv_paged_fp8", mutates_args=("kv_storage",))
def write_kv_paged_fp8(
    k: torch.Tensor,  # (n, KVH, D)
    v: torch.Tensor,  # (n, KVH, D)
    kv_storage: torch.Tensor,  # (layers, 2, N, KVH, bs, D) float8_e4m3fn
    kv_scales: torch.Tensor,  # (layers, 2, KVH)
    layer: int,
    blocks: torch.Tensor,  # (n,)
    offsets: torch.Tensor,  # (n,)
) -> None:
    """``write_kv_paged`` into an FP8 cache: k and v quantised with ``layer``'s per-head scales. Indexed as
    bytes (uint8 views): indexing kernels cover float8 on CPU, not in every CUDA build."""
    raw = kv_storage.view(torch.uint8)
    raw[layer, 0, blocks, :, offsets] = quantise_kv(k, kv_scales[layer, 0]).view(torch.uint8)
    raw[layer, 1, blocks, :, offsets] = quantise_kv(v, kv_scales[layer, 1]).view(torch.uint8)


@write_kv_paged_fp8.register_fake
def _(k, v, kv_storage, kv_scales, layer, blocks, offsets):  # the op's signature
    return None


@torch.library.custom_op("hybridflow::calibrate_kv_scales", mutates_args=("kv_scales",))
def calibrate_kv_scales(
    k: torch.Tensor,  # (n, KVH, D): the calibration tokens' K of ``layer`` (after RoPE, as cached)
    v: torch.Tensor,  # (n, KVH, D)
    kv_scales: torch.Tensor,  # (layers, 2, KVH)
    layer: int,
) -> None:
    """Set ``layer``'s K and V scales from these tokens' per-head largest magnitudes, in place.

    Each tensor-parallel rank holds whole KV heads (or identical copies of a replicated one), so a head's
    scale is computed from all of its values on the rank that uses it: no collective."""
    kv_scales[layer, 0].copy_(kv_scales_for(k.abs().amax(dim=(0, 2))))  # (KVH,)
    kv_scales[layer, 1].copy_(kv_scales_for(v.abs().amax(dim=(0, 2))))


@calibrate_kv_scales.register_fake
def _(k, v, kv_scales, layer):  # the op's signature
    return None


@torch.library.custom_op("hybridflow::write_routing", mutates_args=("routing",))
def write_routing(
    ids: torch.Tensor,  # (n, k) expert ids of n tokens
    routing: torch.Tensor,  # (N, bs, sparse layers, k) uint8
    layer: int,  # the sparse layer's index
    blocks: torch.Tensor,  # (n,)
    offsets: torch.Tensor,  # (n,)
) -> None:
    """Record n tokens' experts of one sparse layer at their cache positions (an op, as ``write_kv_paged``)."""
    routing[blocks, offsets, layer] = ids.to(routing.dtype)


@write_routing.register_fake
def _(ids, routing, layer, blocks, offsets):  # the op's signature
    return None
