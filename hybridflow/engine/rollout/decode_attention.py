"""GQA decode attention over a KV cache: a split-K (flash-decoding) Triton kernel, its reference.

One decode step attends each running row b's single query token to cache positions 0..positions[b]
(inclusive) of row b: a dense (rows, KV heads, L, D) cache, or the paged cache through block tables (the
engine's). Masked SDPA over a whole row reads all L positions of every row (L = 640 while the mean context is
384 in the issue-4 benchmark) and ran at ~1/5 of the HBM roofline on the H200. The kernel:

* one program per (row, KV head, split) loads that KV head's keys and values once for all G = H / KVH query
  heads of its group (the group's queries are a (G, D) tile), and loops only up to the row's own length:
  the loop bound comes from ``positions[b]`` on the device, the tail of the last block is masked;
* the length axis is cut into ``num_splits`` chunks so that small batches still fill every SM; a second
  small kernel merges the per-split partial outputs with the log-sum-exp rescale (skipped for one split);
* the grid depends only on (B, KVH, L) and the launch config, never on the values of ``positions``: no host
  sync, so it runs inside CUDA-graph capture; softmax in float32 (base 2, the scale folded with log2(e)),
  bf16/fp16 in and out (float32 too, in the CPU interpreter only: compiled dots would be TF32).

* fused mode (``new=NewToken(...)``, what the runner's decode uses): q and the step's k arrive before RoPE;
  the kernel rotates them, writes the new k and v into row b at ``positions[b]`` and attends to that
  position from registers, so RoPE, the cache write and attention are one launch per layer.

``decode_attention_rope_paged`` (fused, paged) is a ``torch.library`` custom op with a fake implementation,
so ``torch.compile`` (``fullgraph=True``) treats it as one opaque call instead of tracing into the Triton
launch.
"""

from __future__ import annotations

import functools
import math

import torch

from hybridflow.engine.rollout.decode_reference import (  # noqa: F401 (re-exported: the kernel's references)
    NewToken,
    decode_attention_reference,
    decode_attention_rope_reference,
    rope_reference,
)

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install: the reference (and SDPA in the runner) still work
    triton = None
    tl = None

_LOG2E = 1.4426950408889634


def _interpreting() -> bool:
    """Whether the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 when this module loaded).

    The interpreter (3.9) computes bf16 ``tl.dot`` and bf16 arithmetic on the raw bits, so there the kernel
    upcasts bf16 tiles to float32 as it loads them; compiled kernels keep bf16 tensor-core dots.
    """
    return triton is not None and type(_split_kernel).__name__ == "InterpretedFunction"


def available() -> bool:
    """Whether the Triton kernel can be launched at all (triton imports)."""
    return triton is not None


if triton is not None:

    @triton.jit
    def _round_e4m3(x):
        """x (float32, within +-448) rounded to the nearest e4m3 value (ties up), so the cast is exact: used
        only in Triton's CPU interpreter, whose (3.9) cast drops the carry when rounding up fills the mantissa
        (31.7 became 16, not 32); the GPU's conversion rounds correctly."""
        exponent = tl.floor(tl.log2(tl.maximum(tl.abs(x), 0.015625)))  # -6 below 2^-6: subnormals' step
        step = tl.exp2(exponent - 3.0)  # 3 mantissa bits
        return tl.floor(x / step + 0.5) * step

    @triton.jit
    def _split_kernel(
        Q, K, V, POS, OUT, LSE, KNEW, VNEW, COS, SIN, TABLE, KSCALE, VSCALE,
        stride_qb, stride_qh, stride_qd,
        stride_kb, stride_kh, stride_kl, stride_kd,
        stride_vb, stride_vh, stride_vl, stride_vd,
        stride_ob, stride_oh, stride_os, stride_od,
        stride_lb, stride_lh,
        stride_knb, stride_knh, stride_knd, stride_vnb, stride_vnh, stride_vnd, stride_cb, stride_cd,
        stride_pos, stride_tb, qk_scale, length_cap, split_len,
        G: tl.constexpr, D: tl.constexpr, DIRECT: tl.constexpr, UPCAST: tl.constexpr, FUSED: tl.constexpr,
        PAGE: tl.constexpr, QUANT: tl.constexpr, ROUND_FP8: tl.constexpr,
        BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """One (row, KV head, split): online softmax over the split's visible positions for G query heads.

        FUSED: q and the new token's k arrive before RoPE (applied here from the row's cos/sin, in float32
        and rounded once to the cache dtype, as the compiled torch path does), the split that holds the
        row's position writes the new k and v into the cache, and that position is attended from registers.

        PAGE > 0: the cache is paged. K and V are (blocks, KVH, PAGE, D) views, and row b's position p lives in
        block ``TABLE[b, p // PAGE]`` at offset p % PAGE (the block id is loaded per position, so a tile may
        span blocks of any size). PAGE == 0: K and V are dense (S, KVH, L, D) rows and row b reads row b.

        QUANT: K and V are FP8 with one scale per KV head (KSCALE, VSCALE (KVH,)). A program is one KV head,
        so the scales are scalars: K's folds into the logits' scale, V's multiplies the output, and the tiles
        are only converted (e4m3 -> bf16 is exact). The new token is quantised as written and attended as
        read back, as the torch reference does.

        One body on purpose: with RoPE, the cache loop and the new-token step as ``@triton.jit`` helpers the
        rollout benchmark decoded 4% slower at batch 64 on the H200, though the kernel alone timed the same
        (benchmarks/RESULTS.md, eighth session).
        """
        b = tl.program_id(0).to(tl.int64)  # row offsets exceed 2^31 elements for large caches
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        if QUANT:
            k_scale = tl.load(KSCALE + kvh).to(tl.float32)
            v_scale = tl.load(VSCALE + kvh).to(tl.float32)
            qk_scale = qk_scale * k_scale
        row_pos = tl.load(POS + b * stride_pos).to(tl.int32)
        length = tl.minimum(row_pos + 1, length_cap)
        lo = split * split_len
        hi = tl.minimum(lo + split_len, length)  # hi <= lo: an empty split (row shorter than this chunk)
        offs_g = tl.arange(0, BLOCK_G)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        g_ok = offs_g < G
        d_ok = offs_d < D
        heads = kvh * G + offs_g  # query head h reads KV head h // G (SDPA's enable_gqa convention)
        q_ptr = Q + b * stride_qb + heads[:, None] * stride_qh
        q_mask = g_ok[:, None] & d_ok[None, :]
        q = tl.load(q_ptr + offs_d[None, :] * stride_qd, mask=q_mask, other=0.0)  # (BLOCK_G, BLOCK_D)
        # padded heads are zeros, harmless and never stored
        if FUSED:
            # rotate-half RoPE: x * cos + (-x[D/2:], x[:D/2]) * sin
            swap = tl.where(offs_d < D // 2, offs_d + D // 2, offs_d - D // 2)
            sign = tl.where(offs_d < D // 2, -1.0, 1.0)
            cos = tl.load(COS + b * stride_cb + offs_d * stride_cd, mask=d_ok, other=0.0).to(tl.float32)
            sin = tl.load(SIN + b * stride_cb + offs_d * stride_cd, mask=d_ok, other=0.0).to(tl.float32)
            q_swap = tl.load(q_ptr + swap[None, :] * stride_qd, mask=q_mask, other=0.0).to(tl.float32)
            q = q.to(tl.float32) * cos[None, :] + sign[None, :] * q_swap * sin[None, :]
            q = q.to(Q.dtype.element_ty)
            n_ptr = KNEW + b * stride_knb + kvh * stride_knh
            k_new = tl.load(n_ptr + offs_d * stride_knd, mask=d_ok, other=0.0).to(tl.float32)
            k_swap = tl.load(n_ptr + swap * stride_knd, mask=d_ok, other=0.0).to(tl.float32)
            k_new = (k_new * cos + sign * k_swap * sin).to(Q.dtype.element_ty)  # (BLOCK_D,) rounded as q
            v_ptr = VNEW + b * stride_vnb + kvh * stride_vnh
            v_new = tl.load(v_ptr + offs_d * stride_vnd, mask=d_ok, other=0.0)
            if QUANT:  # stored and attended in units of the head's scale
                k_new = tl.minimum(tl.maximum(k_new.to(tl.float32) / k_scale, -448.0), 448.0)
                v_new = tl.minimum(tl.maximum(v_new.to(tl.float32) / v_scale, -448.0), 448.0)
                if ROUND_FP8:  # the interpreter's float32 -> e4m3 cast loses a rounding's carry: round first
                    k_new = _round_e4m3(k_new)
                    v_new = _round_e4m3(v_new)
            k_new = k_new.to(K.dtype.element_ty)
            v_new = v_new.to(V.dtype.element_ty)
            mine = (row_pos >= lo) & (row_pos < lo + split_len) & (row_pos < length_cap)
            write = d_ok & (offs_d * 0 + mine.to(tl.int32) > 0)  # (BLOCK_D,) a vector mask
            if PAGE > 0:
                new_blk = tl.load(TABLE + b * stride_tb + row_pos // PAGE).to(tl.int64)
                new_k_at = new_blk * stride_kb + (row_pos % PAGE) * stride_kl
                new_v_at = new_blk * stride_vb + (row_pos % PAGE) * stride_vl
            else:
                new_k_at = b * stride_kb + row_pos * stride_kl
                new_v_at = b * stride_vb + row_pos * stride_vl
            tl.store(K + new_k_at + kvh * stride_kh + offs_d * stride_kd, k_new, mask=write)
            tl.store(V + new_v_at + kvh * stride_vh + offs_d * stride_vd, v_new, mask=write)
            hi = tl.minimum(
                hi, row_pos
            )  # the cache holds positions < row_pos; row_pos itself comes from registers
        if UPCAST:
            q = q.to(tl.float32)
        k_base = K + kvh * stride_kh + offs_d[None, :] * stride_kd
        v_base = V + kvh * stride_vh + offs_d[None, :] * stride_vd
        m = tl.full([BLOCK_G], float("-inf"), tl.float32)
        den = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            pos = start + offs_n  # (BLOCK_N,)
            n_ok = pos < hi
            kv_mask = n_ok[:, None] & d_ok[None, :]
            if PAGE > 0 and PAGE % BLOCK_N == 0:  # the tile lies in one block: one id, a contiguous run
                blk = tl.load(TABLE + b * stride_tb + start // PAGE).to(tl.int64)
                k_at = blk * stride_kb + (pos % PAGE) * stride_kl  # (BLOCK_N,)
                v_at = blk * stride_vb + (pos % PAGE) * stride_vl
            elif PAGE > 0:  # each position's block from the row's table (entries past the length masked)
                blk = tl.load(TABLE + b * stride_tb + pos // PAGE, mask=n_ok, other=0).to(tl.int64)
                k_at = blk * stride_kb + (pos % PAGE) * stride_kl  # (BLOCK_N,)
                v_at = blk * stride_vb + (pos % PAGE) * stride_vl
            else:
                k_at = b * stride_kb + pos * stride_kl
                v_at = b * stride_vb + pos * stride_vl
            k = tl.load(k_base + k_at[:, None], mask=kv_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
            if UPCAST or QUANT:
                k = k.to(q.dtype)
            s = tl.dot(q, tl.trans(k)) * qk_scale  # (BLOCK_G, BLOCK_N) float32, base-2 logits
            s = tl.where(n_ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))  # finite: every iteration has >= 1 visible position
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            den = den * alpha + tl.sum(p, 1)
            v = tl.load(v_base + v_at[:, None], mask=kv_mask, other=0.0)  # (BLOCK_N, BLOCK_D)
            if UPCAST or QUANT:
                v = v.to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        if FUSED:  # noqa: SIM102 (a compile-time branch around a run-time one)
            if mine:  # the new token, one more step of the same online softmax
                s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], 1) * qk_scale  # (BLOCK_G,)
                m_new = tl.maximum(m, s_new)
                alpha = tl.exp2(m - m_new)
                p_new = tl.exp2(s_new - m_new)
                den = den * alpha + p_new
                acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
                m = m_new
        out = acc / tl.where(den > 0, den, 1.0)[:, None]  # an empty split stores zeros with lse = -inf
        if QUANT:
            out = out * v_scale
        o_ptr = (
            OUT + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :] * stride_od
        )
        o_mask = g_ok[:, None] & d_ok[None, :]
        if DIRECT:  # one split: this is the final output
            tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=o_mask)
        else:
            tl.store(o_ptr, out, mask=o_mask)
            lse = tl.where(den > 0, m + tl.log2(tl.where(den > 0, den, 1.0)), float("-inf"))
            tl.store(LSE + b * stride_lb + heads * stride_lh + split, lse, mask=g_ok)

    @triton.jit
    def _combine_kernel(
        PART, LSE, OUT,
        stride_pb, stride_ph, stride_ps, stride_pd,
        stride_lb, stride_lh,
        stride_ob, stride_oh, stride_od,
        NUM_SPLITS: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """Merge the splits of one (row, query head): weights 2^(lse_s - max lse), renormalised."""
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_ok = offs_s < NUM_SPLITS
        lse = tl.load(LSE + b * stride_lb + h * stride_lh + offs_s, mask=s_ok, other=float("-inf"))
        w = tl.exp2(lse - tl.max(lse, 0))  # (BLOCK_S,); split 0 always holds position 0, so max is finite
        part = tl.load(
            PART + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :] * stride_pd,
            mask=s_ok[:, None] & (offs_d[None, :] < D),
            other=0.0,
        )  # (BLOCK_S, BLOCK_D) float32
        out = tl.sum(part * w[:, None], 0) / tl.sum(w, 0)
        tl.store(
            OUT + b * stride_ob + h * stride_oh + offs_d * stride_od,
            out.to(OUT.dtype.element_ty),
            mask=offs_d < D,
        )


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; 132 (an H200) off-GPU, so the interpreter sees GPU layouts."""
    if device.type != "cuda":
        return 132
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def default_num_splits(batch: int, kv_heads: int, length: int, block_n: int, device: torch.device) -> int:
    """Splits per (row, KV head): one when the rows alone fill the SMs, else enough for about one wave.

    Splitting costs a merge launch and leaves the long rows' splits running after the short rows' ones, so
    at batch 64-256 (128-512 programs of one split) one split was fastest on the H200 (9.5 and 18.8 us
    against 10.8 and 24.5 us with four programs per SM). Shapes only, so graph-safe.
    """
    rows = batch * kv_heads
    if rows >= num_sms(device) // 2:
        return 1
    return max(1, min(math.ceil(num_sms(device) / rows), math.ceil(length / block_n), 16))


def launch_config(batch: int, kv_heads: int, device: torch.device) -> tuple[int, int, int]:
    """(block_n, num_warps, num_stages): small blocks on two warps once the rows fill the GPU twice over.

    From a sweep on the H200 at L = 640 (mean context 384): batch 256 x 2 KV heads, 64/2/3 took 18.8 us
    (62% of the bytes-in-context bound); batch 64, 128/4/3 took 9.5 us.
    """
    return (64, 2, 3) if batch * kv_heads >= 2 * num_sms(device) else (128, 4, 3)


def split_layout(
    batch: int, kv_heads: int, length: int, block_n: int, num_splits: int | None, device: torch.device
) -> tuple[int, int]:
    """(splits, positions per split) the kernel launches with: whole blocks per split, no split always empty."""
    want = num_splits or default_num_splits(batch, kv_heads, length, block_n, device)
    split_len = math.ceil(math.ceil(length / want) / block_n) * block_n
    return math.ceil(length / split_len), split_len


def _check_new_token(new: NewToken, batch: int, kv_heads: int, dim: int) -> None:
    """Shapes the fused kernel indexes; cos and sin share strides (only those of dims longer than 1 count)."""
    kv_shape, table_shape = (batch, kv_heads, 1, dim), (batch, dim)

    def used_strides(t: torch.Tensor) -> tuple[int, ...]:
        return tuple(st for st, n in zip(t.stride(), t.shape) if n > 1)

    if (
        new.k.shape != kv_shape
        or new.v.shape != kv_shape
        or new.cos.shape != table_shape
        or new.sin.shape != table_shape
        or used_strides(new.cos) != used_strides(new.sin)
        or dim % 2
    ):
        raise ValueError(
            f"fused decode attention expects k, v {kv_shape} and cos, sin {table_shape} with equal strides "
            f"(even D); got k {tuple(new.k.shape)}, v {tuple(new.v.shape)}, cos {tuple(new.cos.shape)}, "
            f"sin {tuple(new.sin.shape)}"
        )


def _check_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    new: NewToken | None,
    table: torch.Tensor | None = None,
) -> None:
    """The shapes and dtypes the kernel indexes: q (B, H, 1, D), caches (S >= B, KVH, L, D), H % KVH == 0;
    paged (``table`` (B, max_blocks)): caches (blocks, KVH, block size, D)."""
    batch, heads, one, dim = q.shape
    _, kv_heads, _, k_dim = k_cache.shape
    rows = k_cache.shape[0] if table is None else table.shape[0]
    if one != 1 or k_dim != dim or heads % kv_heads or rows < batch or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"decode attention expects q (B, H, 1, D) and caches (S>=B, KVH, L, D) with H % KVH == 0; got "
            f"q {tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}"
        )
    if q.device.type == "cuda" and q.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"the decode attention kernel takes bf16 or fp16 on CUDA, got {q.dtype}")
    if new is not None:
        _check_new_token(new, batch, kv_heads, dim)


def _partials(out: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor, tuple, tuple]:
    """The split kernel's partial outputs and log-sum-exps, with their strides; one split writes ``out``
    (B, H, 1, D) itself and leaves the LSE untouched."""
    if splits == 1:
        return out, out, (out.stride(0), out.stride(1), 0, out.stride(3)), (0, 0)
    batch, heads, _, dim = out.shape
    part = torch.empty((batch, heads, splits, dim), dtype=torch.float32, device=out.device)  # (B, H, S, D)
    lse = torch.empty((batch, heads, splits), dtype=torch.float32, device=out.device)  # (B, H, S)
    return part, lse, part.stride(), lse.stride()[:2]


def decode_attention_triton(
    q: torch.Tensor,  # (B, H, 1, D)
    k_cache: torch.Tensor,  # (S >= B, KVH, L, D)
    v_cache: torch.Tensor,  # (S >= B, KVH, L, D)
    positions: torch.Tensor,  # (B,) int
    scale: float,
    *,
    new: NewToken | None = None,
    table: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Launch the split-K kernel (and the merge); returns (B, H, 1, D) in q's dtype.

    With ``new`` (the step's un-rotated k, its v, and the rows' cos/sin), q is un-rotated too: the kernel
    applies RoPE, writes k and v at ``positions`` into the caches, and attends to them (``FUSED``).
    With ``table`` (B, max_blocks) the caches are paged (blocks, KVH, block size, D): row b's position p is in
    block ``table[b, p // block size]``. ``kv_scales`` (2, KVH): the caches are FP8 and a stored value stands
    for itself times its head's scale (K's at [0], V's at [1]). Tuning args are keyword-only; None takes
    ``launch_config``.
    """
    if triton is None:
        raise RuntimeError("decode_attention_triton needs triton (pip install triton)")
    _check_inputs(q, k_cache, v_cache, new, table)
    batch, heads, _, dim = q.shape
    kv_heads, page = k_cache.shape[1], (0 if table is None else k_cache.shape[2])
    length = k_cache.shape[2] if table is None else table.shape[1] * page  # positions a row may reach
    tuned = launch_config(batch, kv_heads, q.device)  # (block_n, num_warps, num_stages) unless given
    block_n, num_warps, num_stages = (x or y for x, y in zip((block_n, num_warps, num_stages), tuned))
    splits, split_len = split_layout(batch, kv_heads, length, block_n, num_splits, q.device)
    out = torch.empty((batch, heads, 1, dim), dtype=q.dtype, device=q.device)  # (B, H, 1, D)
    direct = splits == 1
    part, lse, part_strides, lse_strides = _partials(out, splits)
    block_d = max(16, triton.next_power_of_2(dim))  # tl.dot needs every dimension >= 16
    group = heads // kv_heads
    k_new, v_new, cos, sin = new if new is not None else (q, q, q, q)  # unread placeholders when not fused
    table_arg = positions if table is None else table  # unread when not paged
    k_scale, v_scale = (q, q) if kv_scales is None else (kv_scales[0], kv_scales[1])  # unread unless FP8
    _split_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, positions, part, lse, k_new, v_new, cos, sin, table_arg, k_scale, v_scale,
        q.stride(0), q.stride(1), q.stride(3),
        *k_cache.stride(), *v_cache.stride(),
        *part_strides, *lse_strides,
        k_new.stride(0), k_new.stride(1), k_new.stride(-1), v_new.stride(0), v_new.stride(1), v_new.stride(-1),
        cos.stride(0), cos.stride(-1),
        positions.stride(0), table_arg.stride(0), scale * _LOG2E, length, split_len,
        G=group, D=dim, DIRECT=direct, UPCAST=_interpreting() and q.dtype == torch.bfloat16,
        FUSED=new is not None, PAGE=page, QUANT=kv_scales is not None, ROUND_FP8=_interpreting(),
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if not direct:
        _combine_kernel[(batch, heads)](
            part, lse, out,
            *part.stride(), *lse.stride()[:2],
            out.stride(0), out.stride(1), out.stride(3),
            NUM_SPLITS=splits, D=dim, BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d,
            num_warps=1,
        )  # fmt: skip
    return out


@torch.library.custom_op("hybridflow::decode_attention_rope_paged", mutates_args=("kv_storage",))
def decode_attention_rope_paged(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_storage: torch.Tensor,
    layer: int,
    positions: torch.Tensor,
    tables: torch.Tensor,
    scale: float,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """The fused kernel on the paged cache (layers, 2, blocks, KVH, block size, D) through block ``tables``
    (B, max_blocks): RoPE, the write of the step's k and v, and attention, one launch -> (B, H, 1, D).
    ``kv_scales`` (layers, 2, KVH): the cache is FP8 (``kv_cache``)."""
    new = NewToken(k_new, v_new, cos, sin)
    k, v = kv_storage[layer, 0], kv_storage[layer, 1]  # (blocks, KVH, block size, D) each
    scales = None if kv_scales is None else kv_scales[layer]  # (2, KVH)
    return decode_attention_triton(q, k, v, positions, scale, new=new, table=tables, kv_scales=scales)


@decode_attention_rope_paged.register_fake
def _(
    q, k_new, v_new, cos, sin, kv_storage, layer, positions, tables, scale, kv_scales=None
):  # its signature
    return q.new_empty(q.shape)
