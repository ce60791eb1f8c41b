"""The fused LM-head log-prob/entropy: values and gradients against a direct autograd computation."""

from __future__ import annotations

import pytest
import torch
from support.batches import rollout_batch
from torch import nn

from hybridflow.engine.ops.lm_head import checkpointed_log_probs, linear_log_probs, score_hidden_states

M, H, V = 7, 5, 11  # rows, hidden size, vocabulary


def reference(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor, T: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full logits, plain autograd: log p(label) and H = -sum p log p, row by row."""
    logits = hidden @ weight.T + (0 if bias is None else bias)  # (M, V)
    log_p = torch.log_softmax(logits / T, dim=-1)  # (M, V)
    logp = torch.stack([log_p[i, labels[i]] for i in range(len(labels))]) if len(labels) else log_p[:, 0]
    entropy = -(log_p.exp() * log_p).sum(-1)  # (M,)
    return logp, entropy


def leaves(dtype: torch.dtype, bias: bool, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(M, H, generator=g, dtype=dtype).requires_grad_()
    w = torch.randn(V, H, generator=g, dtype=dtype).requires_grad_()
    b = torch.randn(V, generator=g, dtype=dtype).requires_grad_() if bias else None
    labels = torch.randint(0, V, (M,), generator=g)
    return h, w, b, labels


def grads(loss: torch.Tensor, tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    present = [t for t in tensors if t is not None]
    out = iter(torch.autograd.grad(loss, present, allow_unused=True))
    return [None if t is None else next(out) for t in tensors]


@pytest.mark.parametrize("T", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_values_and_gradients_match_full_logits_in_float64(T: float, entropy_grad: bool, bias: bool) -> None:
    h, w, b, labels = leaves(torch.float64, bias)
    a = torch.linspace(-1.0, 2.0, M, dtype=torch.float64)  # upstream weights of the log-probs
    c = torch.linspace(0.5, -1.5, M, dtype=torch.float64)  # ... and of the entropies
    ref_lp, ref_ent = reference(h, w, b, labels, T)
    ref_loss = (a * ref_lp).sum() + ((c * ref_ent).sum() if entropy_grad else 0)
    lp, ent = linear_log_probs(h, w, b, labels, T, with_entropy=True, entropy_grad=entropy_grad, chunk_rows=3)
    torch.testing.assert_close(lp, ref_lp.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ent.detach(), ref_ent.detach(), rtol=1e-12, atol=1e-12)
    assert ent.requires_grad == entropy_grad
    loss = (a * lp).sum() + ((c * ent).sum() if entropy_grad else 0)
    for got, want in zip(grads(loss, [h, w, b]), grads(ref_loss, [h, w, b])):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_gradcheck_with_entropy_gradient_and_temperature() -> None:
    h, w, b, labels = leaves(torch.float64, bias=True, seed=1)

    def f(h, w, b):
        return linear_log_probs(h, w, b, labels, 0.6, with_entropy=True, entropy_grad=True, chunk_rows=2)

    assert torch.autograd.gradcheck(f, (h, w, b), fast_mode=True)


def test_entropy_gradient_is_the_derived_formula() -> None:
    """dH/dz_j = -p_j (log p_j + H), z = logits / T, checked against autograd at one row."""
    z = torch.tensor([1.0, -0.5, 2.0, 0.25], dtype=torch.float64, requires_grad=True)
    log_p = torch.log_softmax(z, -1)
    entropy = -(log_p.exp() * log_p).sum()
    (auto,) = torch.autograd.grad(entropy, z)
    p = log_p.detach().exp()
    torch.testing.assert_close(auto, -p * (log_p.detach() + entropy.detach()))


@pytest.mark.parametrize("chunk_rows", [1, 3, 7, 100])
def test_chunking_does_not_change_the_result(chunk_rows: int) -> None:
    h, w, _, labels = leaves(torch.float64, bias=False)
    lp, ent = linear_log_probs(h, w, None, labels, 0.9, True, True, chunk_rows=chunk_rows)
    gh, gw = torch.autograd.grad(lp.sum() - 0.3 * ent.sum(), [h, w])
    lp1, ent1 = linear_log_probs(h, w, None, labels, 0.9, True, True, chunk_rows=M)
    gh1, gw1 = torch.autograd.grad(lp1.sum() - 0.3 * ent1.sum(), [h, w])
    for x, y in ((lp, lp1), (ent, ent1), (gh, gh1), (gw, gw1)):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "T,with_entropy,entropy_grad", [(1.0, False, False), (0.8, True, False), (1.3, True, True)]
)
def test_fused_equals_the_checkpointed_head_in_float32(
    T: float, with_entropy: bool, entropy_grad: bool
) -> None:
    torch.manual_seed(3)
    head = nn.Linear(16, 50, bias=False)
    hidden = torch.randn(9, 16, requires_grad=True)
    labels = torch.randint(0, 50, (9,))
    out = {}
    for fused in (True, False):
        lp, ent = score_hidden_states(hidden, head, labels, T, with_entropy, 4, entropy_grad, fused=fused)
        loss = (lp * torch.arange(9.0)).sum() + (0.5 * ent.sum() if entropy_grad else 0)
        out[fused] = (lp.detach(), None if ent is None else ent.detach(), *grads(loss, [hidden, head.weight]))
    for x, y in zip(out[True], out[False]):
        if y is None:
            assert x is None
        else:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_empty_input_gives_empty_outputs_and_zero_gradients() -> None:
    w = torch.randn(V, H, requires_grad=True)
    h = torch.zeros(0, H, requires_grad=True)
    lp, ent = linear_log_probs(h, w, None, torch.zeros(0, dtype=torch.long), 0.7, True, True, chunk_rows=4)
    assert lp.shape == ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()  # a micro-batch without response tokens must still backpropagate
    assert h.grad.shape == (0, H)
    assert torch.equal(w.grad, torch.zeros(V, H))
    lp2, ent2 = checkpointed_log_probs(h, nn.Linear(H, V), torch.zeros(0, dtype=torch.long), 1.0, False)
    assert lp2.shape == (0,) and ent2 is None


def test_tied_weight_gradients_accumulate_from_embedding_and_head() -> None:
    torch.manual_seed(4)
    emb = nn.Embedding(V, H)
    head = nn.Linear(H, V, bias=False)
    head.weight = emb.weight  # tied, as in Qwen2.5-0.5B
    ids = torch.randint(0, V, (M,))
    result = {}
    for fused in (True, False):
        hidden = torch.tanh(emb(ids))  # (M, H)
        lp, _ = score_hidden_states(hidden, head, ids.roll(1), 0.9, fused=fused)
        (gw,) = torch.autograd.grad(lp.sum(), [emb.weight])
        result[fused] = gw
    torch.testing.assert_close(result[True], result[False], rtol=1e-5, atol=1e-6)


def test_other_heads_fall_back_and_bad_arguments_raise() -> None:
    head = nn.Sequential(nn.Linear(H, V))  # not an nn.Linear: the checkpointed path
    h, _, _, labels = leaves(torch.float32, bias=False)
    lp, _ = score_hidden_states(h, head, labels, 1.0)
    ref, _ = reference(h, head[0].weight, head[0].bias, labels, 1.0)
    torch.testing.assert_close(lp, ref)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        score_hidden_states(h, head, labels, 0.0)
    with pytest.raises(ValueError, match="chunk_rows must be >= 1"):
        score_hidden_states(h, head, labels, 1.0, chunk_rows=0)
    with pytest.raises(TypeError, match="must share a dtype"):
        linear_log_probs(h.double(), torch.randn(V, H), None, labels)


def test_policy_scorer_gradients_match_the_checkpointed_head_on_a_tied_model() -> None:
    """Every parameter's gradient through a tiny tied-embedding Qwen2, fused head vs checkpointed head."""
    from hybridflow.engine.ops.packed_attention import use_packed_attention
    from hybridflow.engine.ops.packing import build_scoring_inputs
    from hybridflow.engine.train.scorer import PolicyScorer
    from hybridflow.models import build_tiny_model

    # A left-padded prompt (row 1) and a short response (row 2).
    b = rollout_batch([6, 4, 6], [4, 4, 2], 4, seed=5, tokens=(1, 64))
    inputs = build_scoring_inputs(b["input_ids"], b["attention_mask"], b["position_ids"], 4, True)
    grads_by_head = {}
    for fused in (True, False):
        lm = build_tiny_model("qwen2", vocab_size=64, hidden_size=32, num_hidden_layers=2, seed=1)
        assert lm.lm_head.weight is lm.model.embed_tokens.weight
        use_packed_attention(lm)
        scorer = PolicyScorer(lm, fused_head=fused)
        lp, ent = scorer(inputs, 0.8, with_entropy=True, entropy_grad=True)
        (lp.sum() + 0.1 * ent.sum()).backward()
        grads_by_head[fused] = {n: p.grad for n, p in scorer.named_parameters()}
    for name, want in grads_by_head[False].items():
        got = grads_by_head[True][name]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * float(want.abs().max()), msg=name)
