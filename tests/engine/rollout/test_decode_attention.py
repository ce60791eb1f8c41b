"""The split-K decode-attention kernel against its pure-torch reference (Triton interpreter on CPU, or CUDA).

Without CUDA the kernels run in Triton's CPU interpreter: tests/conftest.py sets TRITON_INTERPRET before
anything imports triton (the interpreter only works when it was set at that moment).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.row_cache import RowCache
from support.triton_util import needs_kernels

from hybridflow.engine.rollout import decode_attention as da
from hybridflow.engine.rollout.model import LlamaRunner
from hybridflow.models import build_tiny_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


needs_kernel = needs_kernels(da)


def _case(batch: int, group: int, kv_heads: int, length: int, dim: int, dtype: torch.dtype, seed: int = 0):
    """Random q (B, H, 1, D), dense caches with two spare rows (S, KVH, L, D) and ragged positions (B,)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, kv_heads * group, 1, dim, generator=gen)
    k = torch.randn(batch + 2, kv_heads, length, dim, generator=gen)
    v = torch.randn(batch + 2, kv_heads, length, dim, generator=gen)
    fixed = torch.tensor([0, 1, length - 1])
    positions = torch.cat([fixed, torch.randint(0, length, (batch - 3,), generator=gen)])[:batch]
    return (x.to(DEVICE, dtype) for x in (q, k, v)), positions.to(DEVICE)


def _poison(cache: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A copy with NaN at every position a row must not read (past its position, spare rows)."""
    out = cache.clone()
    batch, length = positions.shape[0], cache.shape[2]
    beyond = torch.arange(length, device=cache.device) > positions[:, None]  # (B, L)
    out[:batch].masked_fill_(beyond[:, None, :, None], float("nan"))
    out[batch:] = float("nan")
    return out


def test_reference_equals_masked_sdpa_with_gqa() -> None:
    (q, k, v), positions = _case(5, 3, 2, 24, 16, torch.float32)
    q, k, v, positions = q.cpu(), k.cpu(), v.cpu(), positions.cpu()
    mask = (torch.arange(24) <= positions[:, None])[:, None, None, :]  # (B, 1, 1, L)
    sdpa = F.scaled_dot_product_attention(q, k[:5], v[:5], attn_mask=mask, scale=0.2, enable_gqa=True)
    torch.testing.assert_close(da.decode_attention_reference(q, k, v, positions, 0.2), sdpa)


@needs_kernel
@pytest.mark.parametrize("group", [1, 2, 7])
@pytest.mark.parametrize("dim", [32, 64])
def test_kernel_matches_reference_for_ragged_rows(group: int, dim: int) -> None:
    # L = 70 with 16-position blocks: a masked tail in the last block, and splits that end past a row's length.
    # float32 runs only in the interpreter (the GPU kernel takes half precision): float16 on CUDA.
    dtype = torch.float32 if DEVICE == "cpu" else torch.float16
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    (q, k, v), positions = _case(4, group, 2, 70, dim, dtype, seed=group * dim)
    ref = da.decode_attention_reference(q, k, v, positions, dim**-0.5)
    k_bad, v_bad = _poison(k, positions), _poison(v, positions)
    for splits in (1, 3, None):  # one split (direct store), three, and the default for this shape
        got = da.decode_attention_triton(q, k_bad, v_bad, positions, dim**-0.5, block_n=16, num_splits=splits)
        assert got.shape == q.shape and got.dtype == q.dtype
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol, msg=f"splits={splits}")


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_in_half_precision_and_strided_inputs(dtype: torch.dtype) -> None:
    (q, k, v), positions = _case(3, 7, 2, 40, 64, dtype, seed=3)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # (B, H, 1, D) with H-major strides, as RoPE leaves it
    k_view, v_view = k[:, :, :33], v[:, :, :33]  # a kv_len bound: a non-contiguous view of the cache
    positions = positions.clamp(max=32)
    ref = da.decode_attention_reference(q, k_view, v_view, positions, 0.125)
    got = da.decode_attention_triton(q, k_view, v_view, positions, 0.125, block_n=16, num_splits=2)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


def _new_token(batch: int, kv_heads: int, dim: int, dtype: torch.dtype, seed: int) -> da.NewToken:
    """Un-rotated k and v (B, KVH, 1, D) as strided views of one projection output, and cos/sin (B, D)."""
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(batch, 1, 2 * kv_heads * dim, generator=gen).to(DEVICE, dtype)  # (B, 1, 2 KVH D)
    k, v = (x.view(batch, 1, kv_heads, dim).transpose(1, 2) for x in kv.split(kv_heads * dim, dim=-1))
    angles = torch.rand(batch, dim // 2, generator=gen) * 6.0
    emb = torch.cat((angles, angles), dim=-1)
    return da.NewToken(k, v, emb.cos().to(DEVICE, dtype), emb.sin().to(DEVICE, dtype))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernel_applies_rope_writes_the_cache_and_attends(dtype: torch.dtype) -> None:
    if dtype == torch.float32 and DEVICE == "cuda":
        pytest.skip("float32 runs only in the interpreter; the GPU kernel takes bf16 or fp16")
    # Ragged positions (0, 1, L - 1, random) over splits of 16 positions: the split holding a row's position
    # writes k and v there and attends to it from registers; positions past it hold NaN and stay unread.
    (q, k, v), positions = _case(5, 7, 2, 48, 32, dtype, seed=11)
    new = _new_token(5, 2, 32, dtype, seed=12)
    new = new._replace(
        v=new.v.contiguous()
    )  # k a strided view, v its own layout (Qwen3's normed k is the other way)
    k_ref, v_ref = k.clone(), v.clone()
    want = da.decode_attention_rope_reference(q, new, k_ref, v_ref, positions, 32**-0.5)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for splits in (1, 3):
        k_got, v_got = _poison(k, positions - 1), _poison(v, positions - 1)  # NaN from each row's position on
        got = da.decode_attention_triton(
            q, k_got, v_got, positions, 32**-0.5, new=new, block_n=16, num_splits=splits
        )
        torch.testing.assert_close(got.float(), want.float(), **tol, msg=f"splits={splits}")
        rows = torch.arange(5, device=DEVICE)
        # The CPU interpreter truncates float32 -> bf16 where the GPU rounds to nearest: one bf16 ulp there.
        exact = dict(atol=0, rtol=0 if dtype == torch.float32 or DEVICE == "cuda" else 2**-7)
        torch.testing.assert_close(k_got[rows, :, positions], k_ref[rows, :, positions], **exact)
        torch.testing.assert_close(v_got[rows, :, positions], v_ref[rows, :, positions], atol=0, rtol=0)
        assert not torch.isnan(got).any()
    with pytest.raises(ValueError, match="fused decode attention expects"):
        da.decode_attention_triton(q, k, v, positions, 0.1, new=new._replace(cos=new.cos[:, :16]))


@needs_kernel
def test_fused_paged_op_mutates_only_the_cache_and_compiles_fullgraph() -> None:
    dtype = torch.float16 if DEVICE == "cuda" else torch.float32
    (q, _, _), positions = _case(3, 2, 2, 20, 32, dtype, seed=5)
    new = _new_token(3, 2, 32, dtype, seed=6)
    # (layers, 2, blocks, KVH, block size, D): each row owns 5 blocks of 4 positions, block 0 is scratch
    gen = torch.Generator().manual_seed(7)
    storage = torch.randn(2, 2, 16, 2, 4, 32, generator=gen).to(DEVICE, dtype)
    tables = (torch.randperm(15, generator=gen).view(3, 5) + 1).to(DEVICE)
    op = torch.ops.hybridflow.decode_attention_rope_paged.default
    torch.library.opcheck(
        op, (q, *new, storage.clone(), 1, positions, tables, 0.3)
    )  # declared mutation = actual

    def step(q: torch.Tensor, storage: torch.Tensor) -> torch.Tensor:
        return op(q * 2, *new, storage, 1, positions, tables, 0.3) + 1

    eager_storage, compiled_storage = storage.clone(), storage.clone()
    want = step(q, eager_storage)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")  # dynamo must not trace the launch
    torch.testing.assert_close(compiled(q, compiled_storage), want)
    torch.testing.assert_close(compiled_storage, eager_storage)  # the write reached the caller's tensor
    assert not torch.equal(compiled_storage, storage)


def _qwen3() -> torch.nn.Module:
    """A tiny Qwen3: q/k norms make k its own tensor, laid out unlike v (a view of the projection)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(2)
    config = Qwen3Config(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
    )  # fmt: skip
    return Qwen3ForCausalLM(config).eval()


@needs_kernel
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_runner_decode_with_the_kernel_equals_sdpa(arch: str) -> None:
    if arch == "qwen3":
        model = _qwen3().to(DEVICE)
    else:
        model = build_tiny_model("qwen2", vocab_size=64, hidden_size=64, num_attention_heads=4, seed=2).to(
            DEVICE
        )
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    runner = LlamaRunner(model, dtype=dtype)
    assert runner.decode_attention == ("triton" if DEVICE == "cuda" else "sdpa")
    ids = torch.randint(1, 64, (3, 9), device=DEVICE)
    lengths = torch.tensor([9, 4, 1], device=DEVICE)
    logits = {}
    for backend in ("sdpa", "triton"):
        runner.decode_attention = backend
        rows = RowCache(runner, 3, 24)
        rows.prefill(ids, lengths)
        token = torch.tensor([5, 6, 7], device=DEVICE)
        logits[backend] = [rows.decode(token, lengths), rows.decode(token, lengths + 1)]
    tol = dict(atol=3e-2, rtol=3e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    for got, want in zip(logits["triton"], logits["sdpa"]):
        torch.testing.assert_close(got, want, **tol)


@pytest.mark.gpu
@needs_kernel
def test_kernel_on_gpu_matches_reference_and_sdpa_in_bf16_and_in_a_graph() -> None:
    # The Qwen2.5-0.5B attention shape: 14 query heads, 2 KV heads, head dim 64, L = 640.
    (q, k, v), positions = _case(64, 7, 2, 640, 64, torch.bfloat16, seed=1)
    ref = da.decode_attention_reference(q, k, v, positions, 0.125)
    mask = (torch.arange(640, device="cuda") <= positions[:, None])[:, None, None, :]
    sdpa = F.scaled_dot_product_attention(q, k[:64], v[:64], attn_mask=mask, scale=0.125, enable_gqa=True)
    got = da.decode_attention_triton(q, _poison(k, positions), _poison(v, positions), positions, 0.125)
    assert (got.float() - ref.float()).abs().max().item() < 2e-2
    assert (got.float() - sdpa.float()).abs().max().item() < 2e-2
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        captured = da.decode_attention_triton(q, k, v, positions, 0.125)
    positions.copy_(positions.flip(0))  # new values, same tensor: the replay must follow them
    graph.replay()
    torch.testing.assert_close(
        captured, da.decode_attention_reference(q, k, v, positions, 0.125), atol=2e-2, rtol=2e-2
    )
