"""The split-K SiLU * up + down projection kernel against its reference (Triton interpreter on CPU, or CUDA)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_util import needs_kernels

from hybridflow.engine.rollout import mlp_kernel as mk
from hybridflow.engine.rollout.model import LlamaRunner
from hybridflow.models import build_tiny_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


needs_kernel = needs_kernels(mk)
# float32 runs only in the interpreter (compiled dots would be TF32): half precision on CUDA.
EXACT = torch.float32 if DEVICE == "cpu" else torch.float16


def _case(rows: int, inner: int, cols: int, dtype: torch.dtype, seed: int = 0):
    """gate and up as the two halves of one (rows, 2 * inner) projection output, and a (cols, inner) weight."""
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(rows, 2 * inner, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(cols, inner, generator=gen) / inner**0.5).to(DEVICE, dtype)
    gate, up = gate_up.split(inner, dim=-1)  # strided views, as the runner passes them
    return gate, up, weight


@needs_kernel
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_partials_sum_to_the_reference_over_ragged_tiles_and_splits(rows: int) -> None:
    # inner = 72 with 16-wide K blocks: a masked last block, and splits that end inside the K range.
    gate, up, weight = _case(rows, 72, 40, EXACT, seed=rows)
    want = mk.silu_down_reference(gate, up, weight)
    tol = 1e-5 if torch.float32 == EXACT else 2e-3
    for splits in (1, 3, None):
        part = mk.silu_down_triton(gate, up, weight, num_splits=splits, block_m=16, block_n=16, block_k=16)
        assert part.dtype == torch.float32 and part.shape[1:] == (rows, 40)
        assert part.shape[0] <= mk.MAX_SPLITS
        torch.testing.assert_close(part.sum(0), want, atol=tol, rtol=tol, msg=f"splits={splits}")


@needs_kernel
def test_bf16_rounds_the_activation_once_like_the_compiled_torch_path() -> None:
    gate, up, weight = _case(9, 48, 24, torch.bfloat16, seed=3)
    part = mk.silu_down_triton(gate, up, weight, block_m=16, block_n=16, block_k=16)
    act = F.silu(gate.float()) * up.float()
    if DEVICE == "cuda":
        act = act.to(torch.bfloat16).float()  # rounded once, to nearest
    else:  # Triton's CPU interpreter truncates float32 -> bf16 where the GPU rounds to nearest
        act = (act.view(torch.int32) & -65536).view(torch.float32)
    torch.testing.assert_close(part.sum(0), act @ weight.float().T, atol=1e-4, rtol=1e-4)
    eager = F.linear(F.silu(gate) * up, weight).float()  # two roundings and a bf16 output: close, not equal
    torch.testing.assert_close(part.sum(0), eager, atol=5e-2, rtol=5e-2)


@needs_kernel
def test_bad_shapes_are_refused() -> None:
    gate, up, weight = _case(4, 32, 16, EXACT)
    with pytest.raises(ValueError, match="silu_down expects"):
        mk.silu_down_triton(gate, up[:, :16], weight)
    with pytest.raises(ValueError, match="silu_down expects"):
        mk.silu_down_triton(gate, up, weight.to(torch.float64))


@needs_kernel
def test_op_passes_opcheck_and_compiles_fullgraph() -> None:
    gate, up, weight = _case(6, 32, 16, EXACT, seed=4)
    op = torch.ops.hybridflow.silu_down.default
    torch.library.opcheck(op, (gate, up, weight))

    def mlp(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return op(gate * 2, up, weight).sum(0) + 1

    compiled = torch.compile(mlp, fullgraph=True, backend="aot_eager")  # dynamo must not trace the launch
    torch.testing.assert_close(compiled(gate, up), mlp(gate, up))


@needs_kernel
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_runner_decode_with_the_fused_down_equals_the_torch_mlp(arch: str) -> None:
    model = build_tiny_model(arch, vocab_size=64, hidden_size=64, num_attention_heads=4, seed=2).to(DEVICE)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    runner = LlamaRunner(model, dtype=dtype)
    ids = torch.randint(1, 64, (3, 9), device=DEVICE)
    lengths = torch.tensor([9, 4, 1])
    logits = {}
    for fused in (False, True):
        runner.fused_down = fused
        cache = runner.make_cache(4, 24)
        first = runner.prefill(ids, lengths, torch.arange(3), torch.zeros(3, dtype=torch.long), cache)
        token = torch.tensor([5, 6, 7], device=DEVICE)
        logits[fused] = [first, runner.decode(token, lengths.to(DEVICE), cache)]
    torch.testing.assert_close(logits[True][0], logits[False][0], atol=0, rtol=0)  # prefill unchanged
    tol = dict(atol=3e-2, rtol=3e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[True][1], logits[False][1], **tol)


def test_fused_down_is_refused_in_float32_on_cuda_only() -> None:
    runner = LlamaRunner(build_tiny_model("qwen2", vocab_size=64, hidden_size=64, seed=2))
    if not mk.available():
        with pytest.raises(ValueError, match="needs triton"):
            runner.fused_down = True
        return
    runner.fused_down = True  # CPU float32: allowed (the interpreter runs it)
    assert runner.fused_down and runner._decode_dims.fused_down and not runner.dims.fused_down
    runner.fused_down = False
    assert not runner._decode_dims.fused_down
    if torch.cuda.is_available():  # compiled float32 dots would be TF32: refused on CUDA
        on_gpu = LlamaRunner(build_tiny_model("qwen2", vocab_size=64, hidden_size=64, seed=2).cuda())
        with pytest.raises(ValueError, match="bf16 or fp16"):
            on_gpu.fused_down = True
        assert not on_gpu.fused_down
