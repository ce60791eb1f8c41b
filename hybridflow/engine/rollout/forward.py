"""The runner's forward over the paged KV cache (``kv_cache``): prefill and decode through block tables, and
the routing records of a mixture of experts written beside each token's K and V.

A mixin of ``model.LlamaRunner``, kept apart so each file stays readable: it uses the runner's ``_forward``,
``_logits``, ``_rope_tables`` and settings.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybridflow.engine.ops.exact_attention import attend as exact_attend
from hybridflow.engine.ops.invariant import exact_on
from hybridflow.engine.ops.packing import to_device
from hybridflow.engine.rollout.kv_cache import (
    PagedKVCache,
    calibrate_kv_scales,
    paged_decode_attention,
    read_kv_paged,
    write_kv_paged,
    write_kv_paged_fp8,
    write_routing,
)

logger = logging.getLogger(__name__)

# A prefill chunk's images: (3, b, t) M-RoPE positions, (b, t) image-token mask, features (n, hidden) or None.
ImageChunk = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]

# Takes a sparse layer's routing: (its index among the sparse layers, expert ids (b * t, k) int64).
Sink = Callable[[int, torch.Tensor], None]


class PagedForward:
    """``prefill_paged`` and ``decode_paged`` of ``LlamaRunner`` (see the module doc)."""

    @torch.no_grad()
    def prefill_paged(
        self,
        input_ids: torch.Tensor,  # (b, t) right-padded
        lengths: torch.Tensor,  # (b,)
        start_pos: torch.Tensor,  # (b,) > 0: positions below are cached (a shared prefix, an earlier turn)
        cache: PagedKVCache,
        tables: torch.Tensor,  # (b, max_blocks)
        images: ImageChunk | None = None,
    ) -> torch.Tensor:
        """Prefill through block tables: each row's valid tokens are written at their positions and attend
        causally to everything cached below them; last-token logits (b, V).

        ``images`` (a vision-language model): the chunk's (3, b, t) M-RoPE positions, and the image features
        that replace the embeddings of its image tokens (``multimodal.chunk_inputs``).

        When every row starts at 0 attention runs on the chunk alone, causal (right padding only adds keys
        after every valid query); else each row reads its blocks up to the longest row's end. ``lengths``,
        ``start_pos`` and ``tables`` are read on the host: pass CPU tensors and the call never waits for the
        GPU (they go up through pinned memory).

        An FP8 cache due for calibration (``cache.calibrate``: the first prefill after a weight refresh) takes
        its per-head scales from this call's tokens before writing them; so do FP8 projections' static
        activation scales (``act_pending``, set by ``calibrate_activations``), from the valid tokens' inputs.
        """
        b, t = input_ids.shape
        lengths, start_pos, tables = (x.detach().to("cpu", torch.long) for x in (lengths, start_pos, tables))
        kv_end = int((start_pos + lengths).max())
        causal = not bool(start_pos.any())
        positions = start_pos[:, None] + torch.arange(t)  # (b, t)
        valid = torch.arange(t)[None] < lengths[:, None]  # (b, t)
        rows, cols = valid.nonzero(as_tuple=True)  # (n,) valid tokens
        blocks, offsets = cache.locate(tables, rows, positions[rows, cols])  # (n,) each
        tables = tables[:, : -(-kv_end // cache.block_size)]  # (b, blocks read)
        up = [to_device(x, self.device) for x in (input_ids, positions, rows, cols, blocks, offsets, tables)]
        extra = {}
        if images is not None:
            rope, mask, feats = images
            embeds = self.embed_ids(up[0])  # (b, t, hidden)
            if (
                feats is not None
            ):  # HF's masked_scatter: the features fill the image tokens in row-major order
                where = to_device(mask, self.device)[..., None]  # (b, t, 1)
                embeds = embeds.masked_scatter(where, feats.to(embeds.dtype))
            extra = {"rope_positions": to_device(rope, self.device), "embeds": embeds}
        calibrate, cache.calibrate = cache.calibrate, False
        if self.act_pending:
            extra["act_calib"] = to_device(valid, self.device)
        h = self._prefill_paged_layers(
            *up, cache.storage, causal, cache.routing, cache.scales, calibrate, **extra
        )  # (b, t, hidden)
        if self.act_pending:  # the scales are set (queued on the device, before any later forward reads them)
            self.act_pending, self.weights.act_calibrated = False, True
            logger.debug("FP8 static activation scales calibrated on %d prefill tokens", len(rows))
        last = h[torch.arange(b, device=self.device), to_device(lengths, self.device) - 1]  # (b, hidden)
        return self._logits(last)

    def _prefill_paged_hidden(
        self,
        input_ids: torch.Tensor,  # (b, t)
        positions: torch.Tensor,  # (b, t)
        rows: torch.Tensor,  # (n,) with cols: the valid tokens
        cols: torch.Tensor,  # (n,)
        blocks: torch.Tensor,  # (n,) where each valid token's K and V go
        offsets: torch.Tensor,  # (n,)
        tables: torch.Tensor,  # (b, M): the blocks attention reads (unless causal)
        kv_storage: torch.Tensor,  # (layers, 2, N, KVH, bs, D)
        causal: bool,
        routing: torch.Tensor | None = None,  # (N, bs, sparse layers, k): record each token's experts
        kv_scales: torch.Tensor | None = None,  # (layers, 2, KVH): an FP8 cache's scales
        calibrate: bool = False,  # set kv_scales from this call's tokens first
        rope_positions: torch.Tensor | None = None,  # (3, b, t) M-RoPE positions (else ``positions``)
        embeds: torch.Tensor | None = None,  # (b, t, hidden) the embeddings with image features inserted
        act_calib: torch.Tensor | None = None,  # (b, t) bool: set the static activation scales from these
    ) -> torch.Tensor:
        """Prefill's layers on the paged cache (``prefill_paged``); compiled by ``compile_prefill``. With an
        FP8 cache the writes quantise and the cached keys and values are read back dequantised; the chunk's own
        tokens attend in the compute dtype when every row starts at 0 (causal)."""
        bs = kv_storage.shape[4]
        sink = None
        if routing is not None:
            t = input_ids.shape[1]

            def sink(layer: int, ids: torch.Tensor) -> None:
                valid = ids.view(-1, t, ids.shape[-1])[rows, cols]  # (n, k)
                write_routing(valid, routing, layer, blocks, offsets)

        mask = None
        if not causal:
            keys_at = torch.arange(tables.shape[1] * bs, device=positions.device)  # (L,)
            mask = keys_at <= positions[:, None, :, None]  # (b, 1, t, L)

        def attend(idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k_valid, v_valid = k[rows, :, cols], v[rows, :, cols]  # (n, KVH, D)
            if exact_on():  # each token over the cache, in the trainer's order (``exact_attention``)
                write_kv_paged(k_valid, v_valid, kv_storage, idx, blocks, offsets)
                keys, values = read_kv_paged(kv_storage, None, idx, tables, q.dtype)  # (b, L, KVH, D) each
                starts = rows * keys.shape[1]  # (n,) each token's sequence in the flattened keys
                flat = keys.flatten(0, 1), values.flatten(0, 1)  # (b * L, KVH, D) each
                out = exact_attend(
                    q[rows, :, cols], *flat, starts, positions[rows, cols], self.scaling
                )  # (n, H, D)
                full = q.new_zeros(q.shape).transpose(1, 2)  # (b, t, H, D) view
                full[rows, cols] = out
                return full.transpose(1, 2)  # (b, H, t, D)
            if kv_scales is None:
                write_kv_paged(k_valid, v_valid, kv_storage, idx, blocks, offsets)
            else:
                if calibrate:
                    calibrate_kv_scales(k_valid, v_valid, kv_scales, idx)
                write_kv_paged_fp8(k_valid, v_valid, kv_storage, kv_scales, idx, blocks, offsets)
            if mask is None:
                return F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=self.scaling, enable_gqa=True
                )
            keys, values = read_kv_paged(kv_storage, kv_scales, idx, tables, q.dtype)  # (b, L, KVH, D) each
            return F.scaled_dot_product_attention(
                q,
                keys.transpose(1, 2),
                values.transpose(1, 2),
                attn_mask=mask,
                scale=self.scaling,
                enable_gqa=True,
            )

        rope = positions if rope_positions is None else rope_positions
        return self._forward(input_ids, rope, attend, sink=sink, embeds=embeds, calib=act_calib)

    @torch.no_grad()
    def decode_paged(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: PagedKVCache,
        tables: torch.Tensor,
        live: torch.Tensor | None = None,
        rope_positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One decode step through block tables (B, max_blocks): token b written at ``positions[b]`` of its
        sequence, attending to positions <= it; logits (B, V). Fixed shapes, no host sync: graph-safe.

        The Triton backend is one fused launch per layer (RoPE, the cache write, split-K attention over the
        blocks; an FP8 cache quantised as written, dequantised as read); "sdpa" is the reference
        (``kv_cache.paged_decode_attention``: gather, then mask).
        With ``cache.routing`` each row's experts are recorded at its position; ``live`` (B,) bool sends the
        records of rows that are not (finished sequences riding along) to the scratch block 0 instead.
        ``rope_positions`` (B,): where RoPE puts the tokens when not at ``positions`` (a vision-language
        model's position + rope delta; the cache still writes at ``positions``)."""
        rope = positions if rope_positions is None else rope_positions
        sink = None if cache.routing is None else self._decode_sink(positions, cache, tables, live)
        if self._decode_attention == "triton" and not exact_on():
            kernel = torch.ops.hybridflow.decode_attention_rope_paged.default
            cos, sin = (t[:, 0, 0] for t in self._rope_tables(rope[:, None]))  # (B, D) each

            def fused(idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                return kernel(
                    q, k, v, cos, sin, cache.storage, idx, positions, tables, self.scaling, cache.scales
                )

            h = self._forward(input_ids[:, None], rope[:, None], fused, False, self._decode_dims, sink)
            return self._logits(h[:, 0])  # (B, V)

        batch = input_ids.shape[0]
        write_at = cache.locate(tables, torch.arange(batch, device=input_ids.device), positions)  # (B,) each

        def attend(idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            cache.write(idx, k[:, :, 0], v[:, :, 0], write_at)  # (B, KVH, D) each
            if exact_on():  # the trainer's order over the same keys (``exact_attention``)
                keys, values = cache.gather(idx, tables)  # (B, L, KVH, D) each
                starts = torch.arange(keys.shape[0], device=keys.device) * keys.shape[1]  # (B,)
                flat = keys.flatten(0, 1), values.flatten(0, 1)  # (B * L, KVH, D) each
                return exact_attend(q[:, :, 0], *flat, starts, positions, self.scaling)[:, :, None]
            out = paged_decode_attention(q[:, :, 0], cache, idx, tables, positions + 1, self.scaling)
            return out[:, :, None]  # (B, H, 1, D)

        h = self._forward(input_ids[:, None], rope[:, None], attend, True, self._decode_dims, sink)
        return self._logits(h[:, 0])  # (B, V)

    @staticmethod
    def _decode_sink(
        positions: torch.Tensor, cache: PagedKVCache, tables: torch.Tensor, live: torch.Tensor | None
    ) -> Sink:
        """Where a decode step records its rows' experts: each row's block and offset of ``positions``."""
        rows = torch.arange(positions.shape[0], device=positions.device)  # (B,)
        blocks, offsets = cache.locate(tables, rows, positions)  # (B,) each
        if live is not None:
            blocks = torch.where(live, blocks, torch.zeros_like(blocks))  # ridden-along rows: scratch

        def sink(layer: int, ids: torch.Tensor) -> None:
            write_routing(ids, cache.routing, layer, blocks, offsets)

        return sink
