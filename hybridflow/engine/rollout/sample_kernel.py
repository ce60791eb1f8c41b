"""A fused Triton sampler for the unfiltered and greedy paths: one pass over the logits, no host sync.

The torch sampler's default path (``sampling.sample``, no filter) makes five passes over (B, V) float32:
the ``.float()`` copy, the softmax, ``exponential_``, ``probs / noise`` and the argmax (~0.45 ms of a
~2.2 ms decode step at batch 256 x 151,936 on an H200). Here one kernel reads the logits once in their own
dtype (bf16 from the LM head, or float32) and, with ``z = logits / T`` in float32, keeps per program:

* an online max and sum-exp of ``z`` (the log-sum-exp, as in flash attention), for the log-prob;
* the Gumbel-max draw ``argmax_j z_j + g_j``, ``g_j = -log(E_j)``, ``E_j ~ Exp(1)``: a categorical draw
  from ``softmax(z)``, the same distribution as the torch path's race ``argmax_j p_j / E_j``;
* for greedy, ``argmax_j logits_j`` (first index on ties, as ``torch.argmax``) with the log-sum-exp at the
  log-prob temperature.

The vocabulary is cut into splits so that a small batch still fills the GPU; a second tiny kernel merges the
per-split (max, sum-exp, best key, best index) of each row and writes ``(token, z_token - lse)``.

Randomness is Triton's counter-based Philox: key = the request's seed, counter = (column block, row, step).
Seed and step live in a device tensor (``make_rng_state``); the merge kernel advances the step, so a
replayed CUDA graph draws new numbers and nothing syncs with the host. A draw depends only on (seed, step,
row, column) and the block width, never on the batch size or the number of splits, so a graph padded to a
bucket draws the same tokens for the live rows as an eager step.

``fused_sample`` is a ``torch.library`` custom op with a fake implementation, so ``torch.compile``
(``fullgraph=True``) records one opaque call instead of tracing into the Triton launches.
"""

from __future__ import annotations

import math

import torch

from hybridflow.engine.rollout.decode_attention import num_sms
from hybridflow.engine.rollout.sampling import SamplingParams

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install: the torch sampler is used
    triton = None
    tl = None

_MAX_BLOCK = 1024  # columns per chunk; four chunks per loop iteration share one Philox call
_SEED_MASK = 2**63 - 1  # the seed must fit a (non-negative) int64 on the device


def available() -> bool:
    """Whether the Triton kernels can be launched at all (triton imports)."""
    return triton is not None


def applies(params: SamplingParams) -> bool:
    """Whether the fused sampler covers these params: greedy, or sampling with no top-k/top-p/min-p."""
    return params.greedy or not params.filtered


def make_rng_state(seed: int | None, device: torch.device | str) -> torch.Tensor:
    """The sampler's RNG state on ``device``: int64 ``[seed, step]`` with step 0.

    ``seed=None`` draws a seed from torch's global (CPU) RNG, once: seeding torch makes runs repeatable.
    """
    if seed is None:
        seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    return torch.tensor([seed & _SEED_MASK, 0], dtype=torch.int64, device=device)


if triton is not None:

    @triton.jit
    def _sample_split_kernel(
        LOGITS, stride_row, V, split_len, RNG, inv_t,
        PART_M, PART_S, PART_KEY, PART_IDX, num_splits,
        SAMPLE: tl.constexpr, LSE: tl.constexpr, Q: tl.constexpr,
    ):  # fmt: skip
        """One (row, split): online max / sum-exp of z and the best key over columns [lo, hi)."""
        row = tl.program_id(0)
        split = tl.program_id(1)
        base = LOGITS + row.to(tl.int64) * stride_row
        lo = split * split_len  # split_len is a multiple of 4 Q: Philox counters do not depend on splits
        hi = tl.minimum(lo + split_len, V)
        offs = tl.arange(0, Q)
        zero = offs * 0
        if SAMPLE:
            seed = tl.load(RNG)
            step = tl.load(RNG + 1).to(tl.uint32)
        m = tl.full([Q], float("-inf"), tl.float32)  # per-lane running max of z
        s = tl.zeros([Q], tl.float32)  # per-lane sum exp(z - m)
        best_key = tl.full([Q], float("-inf"), tl.float32)
        best_idx = zero + lo  # an all -inf split reports its first column, a valid index
        for start in range(lo, hi, 4 * Q):
            if SAMPLE:
                # One Philox call gives four words, one per chunk; counter (column block, row, step, 0).
                r0, r1, r2, r3 = tl.philox(seed, start // 4 + offs, zero + row, zero + step, zero)
            for k in tl.static_range(4):  # four chunks of Q columns (unrolled)
                cols = start + k * Q + offs
                x = tl.load(base + cols, mask=cols < hi, other=float("-inf")).to(tl.float32)  # (Q,)
                z = x * inv_t
                if SAMPLE:
                    bits = r0 if k == 0 else (r1 if k == 1 else (r2 if k == 2 else r3))
                    # Gumbel noise g = -log(E), E = -log(u) ~ Exp(1) for u = 1 - v, v = (bits + 1/2) / 2^32.
                    # u and v both come straight from the bits (~bits = 2^32 - 1 - bits), so each has full
                    # float32 relative precision: u in [2^-33, 1) keeps E finite, and where v is small (E
                    # small, where the race is decided) E = -log(1 - v) comes from its series, exact to 3e-8.
                    v = (bits.to(tl.float32) + 0.5) * 2.3283064365386963e-10  # 2^-32
                    u = ((~bits).to(tl.float32) + 0.5) * 2.3283064365386963e-10
                    series = v * (1.0 + v * (0.5 + v * (0.3333333333333333 + v * 0.25)))
                    key = z - tl.log(tl.where(v < 0.015625, series, -tl.log(u)))
                else:
                    key = x  # greedy ranks the raw logits: x / T may round two of them into a tie
                take = key > best_key  # strict: a lane keeps its first index on ties
                best_key = tl.where(take, key, best_key)
                best_idx = tl.where(take, cols, best_idx)
                if LSE:
                    # Online log-sum-exp per lane, one exp per element and no reduction in the loop: the
                    # smaller of (m, z) is exp-scaled onto the larger. z == -inf adds e = 0 (both -inf:
                    # exp(-inf - 0), not NaN); z > m == -inf gives e = 0 and s = 1.
                    top = tl.maximum(m, z)
                    e = tl.exp(tl.minimum(m, z) - tl.where(top == float("-inf"), 0.0, top))
                    s = tl.where(z > m, s * e + 1.0, s + e)
                    m = top
        key = tl.max(best_key, 0)
        idx = tl.min(tl.where(best_key == key, best_idx, 2147483647), 0)  # first column among the best
        out = row * num_splits + split
        tl.store(PART_KEY + out, key)
        tl.store(PART_IDX + out, idx)
        if LSE:
            top = tl.max(m, 0)
            top_safe = tl.where(top == float("-inf"), 0.0, top)
            tl.store(PART_M + out, top)
            tl.store(PART_S + out, tl.sum(s * tl.exp(m - top_safe), 0))  # lanes with m = -inf hold s = 0

    @triton.jit
    def _sample_merge_kernel(
        PART_M, PART_S, PART_KEY, PART_IDX, num_splits,
        LOGITS, stride_row, inv_t, RNG, TOKENS, LOGPROBS,
        SAMPLE: tl.constexpr, LSE: tl.constexpr, BLOCK_S: tl.constexpr,
    ):  # fmt: skip
        """One row: the best key over splits (first split on ties), lse, and log p = z_token - lse."""
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK_S)
        ok = offs < num_splits
        part = row * num_splits + offs
        keys = tl.load(PART_KEY + part, mask=ok, other=float("-inf"))
        idx = tl.load(PART_IDX + part, mask=ok, other=2147483647)
        # Splits are in column order, so the smallest index among the best keys is the first one.
        token = tl.min(tl.where(keys == tl.max(keys, 0), idx, 2147483647), 0)
        tl.store(TOKENS + row, token.to(tl.int64))
        if LSE:
            m = tl.load(PART_M + part, mask=ok, other=float("-inf"))
            s = tl.load(PART_S + part, mask=ok, other=0.0)
            top = tl.max(m, 0)
            top_safe = tl.where(top == float("-inf"), 0.0, top)
            lse = top + tl.log(tl.sum(s * tl.exp(m - top_safe), 0))
            z = tl.load(LOGITS + row.to(tl.int64) * stride_row + token).to(tl.float32) * inv_t
            tl.store(LOGPROBS + row, z - lse)
        else:
            tl.store(LOGPROBS + row, 0.0)
        if SAMPLE:  # noqa: SIM102 (a compile-time branch around a run-time one)
            if row == 0:  # the split kernel has read the step: advance it for the next call (or replay)
                tl.store(RNG + 1, tl.load(RNG + 1) + 1)


def default_block(vocab: int) -> int:
    """Columns per chunk: 1024, or less for a small vocabulary (a power of two, at least 16)."""
    return max(16, min(_MAX_BLOCK, triton.next_power_of_2(math.ceil(vocab / 4))))


def split_layout(
    batch: int, vocab: int, block: int, num_splits: int | None, device: torch.device
) -> tuple[int, int]:
    """(splits, columns per split): whole loop iterations (4 * block columns) per split, none empty.

    By default about eight programs per SM (132 SMs off-GPU, so the interpreter sees the same layout);
    it depends on shapes only, so a CUDA graph replays a fixed grid.
    """
    if num_splits is None:
        num_splits = math.ceil(8 * num_sms(device) / max(batch, 1))
    step = 4 * block
    split_len = math.ceil(math.ceil(vocab / max(num_splits, 1)) / step) * step
    return math.ceil(vocab / split_len), split_len


def fused_sample_triton(
    logits: torch.Tensor,  # (B, V) bf16, fp16 or float32
    rng: torch.Tensor,  # (2,) int64 [seed, step]; the step is advanced when sampling
    inv_temperature: float,
    greedy: bool,
    with_logprobs: bool,
    *,
    block: int | None = None,
    num_splits: int | None = None,
    num_warps: int = 8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the split and merge kernels; returns (tokens (B,) int64, logprobs (B,) float32).

    Tuning args are keyword-only. Sampling draws from ``softmax(logits * inv_temperature)``; greedy takes the
    argmax of ``logits``. Log-probs are ``log_softmax(logits * inv_temperature)[token]`` or zeros.
    """
    if triton is None:
        raise RuntimeError("fused_sample_triton needs triton (pip install triton)")
    if logits.dim() != 2 or rng.shape != (2,) or rng.dtype != torch.int64:
        raise ValueError(
            f"fused sampling expects logits (B, V) and an int64 rng state [seed, step], got "
            f"{tuple(logits.shape)} and {tuple(rng.shape)} {rng.dtype}"
        )
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    batch, vocab = logits.shape
    dev = logits.device
    tokens = torch.empty(batch, dtype=torch.int64, device=dev)
    logprobs = torch.empty(batch, dtype=torch.float32, device=dev)
    if batch == 0:
        return tokens, logprobs
    block = block or default_block(vocab)
    splits, split_len = split_layout(batch, vocab, block, num_splits, dev)
    stats = torch.empty(3, batch, splits, dtype=torch.float32, device=dev)  # max, sum-exp, best key
    idx = torch.empty(batch, splits, dtype=torch.int32, device=dev)
    sample, lse = not greedy, with_logprobs
    _sample_split_kernel[(batch, splits)](
        logits, logits.stride(0), vocab, split_len, rng, inv_temperature,
        stats[0], stats[1], stats[2], idx, splits,
        SAMPLE=sample, LSE=lse, Q=block, num_warps=num_warps,
    )  # fmt: skip
    _sample_merge_kernel[(batch,)](
        stats[0], stats[1], stats[2], idx, splits,
        logits, logits.stride(0), inv_temperature, rng, tokens, logprobs,
        SAMPLE=sample, LSE=lse, BLOCK_S=triton.next_power_of_2(splits), num_warps=1,
    )  # fmt: skip
    return tokens, logprobs


@torch.library.custom_op("hybridflow::fused_sample", mutates_args=("rng",))
def _fused_sample_op(
    logits: torch.Tensor, rng: torch.Tensor, inv_temperature: float, greedy: bool, with_logprobs: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fused sampler as an opaque op: (B, V) logits -> (tokens (B,) int64, logprobs (B,) float32)."""
    return fused_sample_triton(logits, rng, inv_temperature, greedy, with_logprobs)


@_fused_sample_op.register_fake
def _(logits: torch.Tensor, rng: torch.Tensor, inv_temperature: float, greedy: bool, with_logprobs: bool):
    batch = logits.shape[0]
    return logits.new_empty(batch, dtype=torch.int64), logits.new_empty(batch, dtype=torch.float32)


def fused_sample(
    logits: torch.Tensor, params: SamplingParams, rng: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sampling.sample`` for greedy or unfiltered params, in one pass: ``(tokens (B,), logprobs (B,))``.

    Same log-prob semantics: ``log_softmax(logits / T)[token]`` (T = ``params.logprob_temperature``), or
    zeros when ``params.logprobs`` is False. ``rng`` comes from ``make_rng_state`` and advances per call.
    """
    if not applies(params):
        raise ValueError("the fused sampler covers greedy and unfiltered sampling only; use sampling.sample")
    return _fused_sample_op(logits, rng, 1.0 / params.logprob_temperature, params.greedy, params.logprobs)
