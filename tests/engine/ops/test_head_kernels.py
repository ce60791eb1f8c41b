"""The LM head's Triton kernels (CPU interpreter or CUDA) against PyTorch: log-probs, entropy, gradients."""

from __future__ import annotations

import pytest
import torch

from hybridflow.engine.ops import head_kernels, lm_head
from hybridflow.engine.ops.lm_head import linear_log_probs

pytestmark = pytest.mark.skipif(head_kernels.triton is None, reason="needs triton (pip install triton)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lm_head, "fused_head_available", lambda t: False)


def kernel_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lm_head, "fused_head_available", lambda t: True)  # the interpreter runs CPU tensors


def leaves(M: int, H: int, V: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(M, H, generator=g) * 2).to(DEVICE, dtype).requires_grad_()
    w = torch.randn(V, H, generator=g).to(DEVICE, dtype).requires_grad_()
    b = torch.randn(V, generator=g).to(DEVICE, dtype).requires_grad_() if bias else None
    return h, w, b, torch.randint(0, V, (M,), generator=g).to(DEVICE)


def run(monkeypatch, use_kernels: bool, args, T: float, entropy_grad: bool, chunk_rows: int = 4):
    """(log-probs, entropy, grads of h, w, b) of one weighted loss through linear_log_probs."""
    (kernel_path if use_kernels else torch_path)(monkeypatch)
    h, w, b, labels = args
    lp, ent = linear_log_probs(h, w, b, labels, T, True, entropy_grad, chunk_rows)
    a = torch.linspace(-1.0, 2.0, len(lp), device=DEVICE)
    c = torch.linspace(0.5, -1.5, len(lp), device=DEVICE)
    loss = (a * lp).sum() + ((c * ent).sum() if entropy_grad else 0)
    present = [t for t in (h, w, b) if t is not None]
    return lp.detach(), ent.detach(), torch.autograd.grad(loss, present)


@pytest.mark.parametrize("V", [300, 9000])  # one partial block; several blocks and a tail
@pytest.mark.parametrize(
    ("T", "entropy_grad", "bias"), [(1.0, True, True), (0.7, False, False), (0.7, True, False)]
)
def test_kernels_match_the_pytorch_path_in_float32(
    monkeypatch, V: int, T: float, entropy_grad: bool, bias: bool
) -> None:
    args = leaves(6, 8, V, torch.float32, bias, seed=V)
    want = run(monkeypatch, False, args, T, entropy_grad)
    got = run(monkeypatch, True, args, T, entropy_grad)
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    for g_got, g_want in zip(got[2], want[2]):
        torch.testing.assert_close(g_got, g_want, rtol=1e-4, atol=1e-5)


def test_entropy_has_no_cancellation_for_large_logits() -> None:
    logits = torch.full((2, 5000), -300.0, device=DEVICE)
    logits[0, 7] = 300.0  # one certain token: entropy 0, log p = 0
    logits[1, :2] = 250.0  # two equally likely tokens: entropy log 2
    logp, ent, lse = head_kernels.head_stats(logits, torch.tensor([7, 1], device=DEVICE), 1.0, True)
    torch.testing.assert_close(ent.cpu(), torch.tensor([0.0, 0.6931472]), atol=1e-6, rtol=0)
    torch.testing.assert_close(logp.cpu(), torch.tensor([0.0, -0.6931472]), atol=1e-5, rtol=0)
    torch.testing.assert_close(lse.cpu(), torch.tensor([300.0, 250.6931472]), atol=1e-4, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_kernels_track_the_pytorch_path_at_qwen_vocab(monkeypatch) -> None:
    args = leaves(96, 64, 151936, torch.bfloat16, bias=False, seed=1)
    want = run(monkeypatch, False, args, 0.8, True, chunk_rows=32)
    got = run(monkeypatch, True, args, 0.8, True, chunk_rows=32)
    assert (got[0] - want[0]).abs().max() < 1e-3 and (got[1] - want[1]).abs().max() < 1e-3
    for g_got, g_want in zip(got[2], want[2]):
        err = (g_got.float() - g_want.float()).abs().mean() / g_want.float().abs().mean()
        assert err < 1e-2, f"relative gradient error {err:.2e}"
