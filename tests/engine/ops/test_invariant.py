"""The batch-invariant kernels of exact mode on the CPU: a row's result equals itself computed in any other
call (more or fewer rows, another place in the call, other neighbours, other strides), gradients flow, and the
switch is scoped."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from hybridflow.engine.ops.invariant import (
    exact_kernels,
    exact_on,
    rope_table,
    token_log_probs,
)
from hybridflow.models import build_tiny_model

DTYPES = [torch.float32, torch.bfloat16]


def rows(m: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_linear_rows_result_does_not_depend_on_the_rest_of_the_call(dtype: torch.dtype) -> None:
    lin = torch.nn.Linear(96, 200).to(dtype)
    x = rows(300, 96, dtype)
    with exact_kernels():
        whole = lin(x)  # (300, 200)
        for a, b in [(0, 1), (5, 9), (17, 48), (290, 300)]:
            assert torch.equal(lin(x[a:b]), whole[a:b])
        mixed = torch.cat([rows(7, 96, dtype, seed=1), x[40:41], rows(30, 96, dtype, seed=2)])
        assert torch.equal(lin(mixed)[7], whole[40])  # another place, other neighbours
        assert torch.equal(lin(x.t().contiguous().t()[3:4]), whole[3:4])  # a column-major input
        batched = lin(x.view(3, 100, 96))  # (3, 100, 200): a 3D input goes through the same matmul
        assert torch.equal(batched.view(300, 200), whole)
    if dtype == torch.float32:  # torch's own float32 matmul does depend on the call
        plain = lin(x)
        assert not all(torch.equal(lin(x[a : a + 1]), plain[a : a + 1]) for a in range(0, 300, 7))


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_means_softmaxes_and_gates_do_not_depend_on_the_call(dtype: torch.dtype) -> None:
    x = rows(70, 333, dtype)  # an odd row length: CPU kernels would run a scalar tail
    with exact_kernels():
        for fn in (
            lambda t: t.float().pow(2).mean(-1, keepdim=True),
            lambda t: torch.log_softmax(t.float(), -1),
            lambda t: torch.softmax(t.float(), -1),
            torch.sigmoid,
            F.silu,
        ):
            whole = fn(x)
            for a, b in [(0, 1), (3, 10), (69, 70)]:
                assert torch.equal(fn(x[a:b]), whole[a:b])
        assert torch.equal(x.float().mean(0), x.float().sum(0) / 70)  # another dim: a plain mean


def test_exact_kernels_compute_what_torch_computes_and_train() -> None:
    x = rows(40, 64, torch.float32).requires_grad_()
    w = rows(32, 64, torch.float32, seed=3).requires_grad_()
    with exact_kernels():
        y = F.linear(x, w)
        lp = torch.log_softmax(y, -1)
        lp[:, 0].sum().backward()
    torch.testing.assert_close(y, x @ w.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lp, torch.log_softmax(x @ w.t(), -1), rtol=1e-5, atol=1e-5)
    assert x.grad is not None and w.grad is not None and x.grad.abs().sum() > 0


def test_the_switch_is_scoped_and_nests() -> None:
    assert not exact_on()
    with exact_kernels():
        with exact_kernels():
            assert exact_on()
        assert exact_on()
    assert not exact_on()


def test_enabling_for_the_process_survives_collection_of_any_context() -> None:
    code = (
        "import gc; from hybridflow.engine.ops.invariant import enable_exact_kernels, exact_kernels, exact_on\n"
        "enable_exact_kernels(); gc.collect()\n"
        "with exact_kernels(): pass\n"
        "assert exact_on()\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_rope_table_holds_hf_values_and_one_table_per_inv_freq() -> None:
    model = build_tiny_model("qwen2", vocab_size=64, hidden_size=64, num_hidden_layers=1, seed=0)
    rotary = model.model.rotary_emb
    positions = torch.tensor([[0, 3, 17, 1000, 2047]])
    want_cos, want_sin = rotary(torch.zeros(1, dtype=torch.float32), positions)  # (1, 5, D)
    cos, sin = rope_table(rotary.inv_freq, rotary.attention_scaling, 2048)
    torch.testing.assert_close(cos[positions], want_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin[positions], want_sin, rtol=0, atol=1e-6)
    again = rope_table(rotary.inv_freq, rotary.attention_scaling, 100)
    assert again[0] is cos  # kept on the tensor, long enough already


def test_token_log_probs_is_the_log_softmax_at_the_temperature() -> None:
    logits = rows(6, 50, torch.bfloat16)
    tokens = torch.tensor([0, 5, 49, 3, 3, 17])
    want = torch.log_softmax(logits.float() / 0.7, -1).gather(1, tokens[:, None])[:, 0]
    torch.testing.assert_close(token_log_probs(logits, tokens, 0.7), want, rtol=0, atol=1e-6)
