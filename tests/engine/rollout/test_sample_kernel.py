"""The fused Triton sampler: log-probs, greedy ties, the sampled distribution, seeds and steps, -inf logits.

Without CUDA the kernels run in Triton's CPU interpreter (tests/conftest.py sets TRITON_INTERPRET before
triton is imported). The interpreter runs each program in Python (~10 ms), so row counts stay small.
"""

from __future__ import annotations

import math

import pytest
import torch
from support.triton_util import needs_kernels

from hybridflow.engine.rollout import sample_kernel as sk
from hybridflow.engine.rollout.engine import PagedEngine
from hybridflow.engine.rollout.sampling import SamplingParams
from hybridflow.models import build_tiny_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


needs_kernel = needs_kernels(sk)
pytestmark = needs_kernel


def _run(logits: torch.Tensor, seed: int = 0, temperature: float = 1.0, greedy: bool = False, **kw):
    """(tokens, logprobs, rng) of one fused call from a fresh RNG state."""
    rng = sk.make_rng_state(seed, logits.device)
    tokens, logprobs = sk.fused_sample_triton(logits, rng, 1.0 / temperature, greedy, True, **kw)
    return tokens, logprobs, rng


def _log_softmax_at(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, tokens[:, None]).squeeze(-1)


@pytest.mark.parametrize(("dtype", "temperature"), [(torch.float32, 1.0), (torch.bfloat16, 0.7)])
def test_logprobs_are_log_softmax_at_temperature_and_greedy_is_argmax(
    dtype: torch.dtype, temperature: float
) -> None:
    # V = 1000 with 32-column chunks: three splits of 384 columns, a masked tail in the last one.
    logits = (torch.randn(6, 1000) * 3).to(DEVICE, dtype)
    tokens, logprobs, rng = _run(logits, seed=1, temperature=temperature, block=32, num_splits=3)
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32 and tokens.shape == (6,)
    torch.testing.assert_close(logprobs, _log_softmax_at(logits, tokens, temperature), atol=2e-5, rtol=0)
    assert rng.tolist() == [1, 1]  # the step advanced on the device
    # The draws depend on (seed, step, row, column) only, not on how the vocabulary is split.
    again, _, _ = _run(logits, seed=1, temperature=temperature, block=32, num_splits=1)
    assert torch.equal(again, tokens)
    best, best_lp, rng = _run(logits, temperature=temperature, greedy=True, block=32, num_splits=3)
    assert torch.equal(best, logits.argmax(dim=-1))
    torch.testing.assert_close(best_lp, _log_softmax_at(logits, best, temperature), atol=2e-5, rtol=0)
    assert rng.tolist() == [0, 0]  # greedy draws nothing


def test_greedy_takes_the_first_index_on_ties_across_chunks_and_splits() -> None:
    logits = torch.zeros(3, 300, device=DEVICE)
    logits[0, [7, 250]] = 5.0  # tie across splits
    logits[1, [140, 141, 299]] = 2.0  # tie inside one split, and with the last column
    logits[2] = -1.0  # every column ties
    tokens, _, _ = _run(logits, greedy=True, block=16, num_splits=4)
    assert tokens.tolist() == [7, 140, 0]
    assert tokens.tolist() == logits.argmax(dim=-1).tolist()


def test_frequencies_match_softmax_at_temperature() -> None:
    # Wrong temperatures (T -> 1, T^2) or a biased noise (-log u, logistic) shift these frequencies by far
    # more than the threshold: their expected chi-square is 35-290 for 800 draws.
    row, temperature, draws = [1.0, 0.0, 2.0, -0.5, 0.7, -1.0], 0.7, 800
    logits = torch.tensor(row, device=DEVICE).repeat(draws, 1)  # (draws, 6)
    rng = sk.make_rng_state(3, DEVICE)
    tokens, _ = sk.fused_sample_triton(logits, rng, 1.0 / temperature, False, False)
    counts = torch.bincount(tokens.cpu(), minlength=6).tolist()
    probs = torch.softmax(torch.tensor(row) / temperature, 0).tolist()
    chi2 = sum((c - draws * p) ** 2 / (draws * p) for c, p in zip(counts, probs))
    assert chi2 < 20.52, (counts, [round(draws * p) for p in probs])  # 5 degrees of freedom, p = 0.001


def test_frequencies_match_softmax_across_splits() -> None:
    # 48 columns in three splits of 16 with different maxima: the draw picks a split by its mass, then a
    # column inside it in that split's own frame. Bins are half-splits, so both choices are checked.
    g = torch.Generator().manual_seed(0)
    row = torch.randn(48, generator=g) * 0.5 + torch.tensor([0.0, 1.5, -1.0]).repeat_interleave(16)
    row[40:] += 2.0  # the last split's second half holds most of its mass
    draws = 600
    logits = row.to(DEVICE).repeat(draws, 1)  # (draws, 48)
    tokens, _ = sk.fused_sample_triton(
        logits, sk.make_rng_state(11, DEVICE), 1.0, False, False, block=16, num_splits=3
    )
    counts = torch.bincount(tokens.cpu() // 8, minlength=6).tolist()
    probs = torch.softmax(row, 0).view(6, 8).sum(-1).tolist()
    chi2 = sum((c - draws * p) ** 2 / (draws * p) for c, p in zip(counts, probs))
    assert chi2 < 20.52, (counts, [round(draws * p) for p in probs])  # 5 degrees of freedom, p = 0.001


def test_seed_and_step_decide_the_draws() -> None:
    logits = torch.randn(12, 40, device=DEVICE)  # (B, V): 12 draws over 40 roughly even tokens
    first, _, rng = _run(logits, seed=5)
    same, _, _ = _run(logits, seed=5)
    other, _, _ = _run(logits, seed=6)
    assert torch.equal(first, same)
    assert not torch.equal(first, other)
    nxt, _ = sk.fused_sample_triton(logits, rng, 1.0, False, True)  # step 1
    assert not torch.equal(first, nxt)
    assert rng.tolist() == [5, 2]
    rng[1] = 1  # rewinding the step replays its draws
    assert torch.equal(sk.fused_sample_triton(logits, rng, 1.0, False, True)[0], nxt)


def test_minus_inf_logits_are_never_drawn() -> None:
    logits = torch.randn(16, 200, device=DEVICE)
    logits[:, :150] = float("-inf")  # the first two of three splits hold nothing but -inf
    logits[::2, 150:190] = float("-inf")  # even rows: ten finite tokens left
    tokens, logprobs, _ = _run(logits, seed=2, block=16, num_splits=3)
    assert bool((tokens >= 150).all()) and bool((tokens[::2] >= 190).all())
    assert bool(torch.isfinite(logprobs).all())
    torch.testing.assert_close(logprobs, _log_softmax_at(logits, tokens, 1.0), atol=2e-5, rtol=0)


def test_fused_sample_follows_params() -> None:
    logits = torch.randn(4, 50, device=DEVICE)
    rng = sk.make_rng_state(0, DEVICE)
    tokens, logprobs = sk.fused_sample(logits, SamplingParams(do_sample=False, logprobs=False), rng)
    assert torch.equal(tokens, logits.argmax(-1)) and not bool(logprobs.any())
    greedy_at_0 = SamplingParams(do_sample=False, temperature=0.0)  # log-probs at T = 1
    tokens, logprobs = sk.fused_sample(logits, greedy_at_0, rng)
    torch.testing.assert_close(logprobs, _log_softmax_at(logits, tokens, 1.0), atol=2e-5, rtol=0)
    assert sk.applies(SamplingParams(top_k=5, do_sample=False)) and not sk.applies(SamplingParams(top_k=5))
    with pytest.raises(ValueError, match="greedy and unfiltered"):
        sk.fused_sample(logits, SamplingParams(top_p=0.9), rng)
    torch.manual_seed(4)
    drawn = sk.make_rng_state(None, DEVICE)
    torch.manual_seed(4)
    assert torch.equal(drawn, sk.make_rng_state(None, DEVICE))  # seed=None: torch's global RNG


def test_custom_op_passes_opcheck_and_compiles_fullgraph() -> None:
    logits = torch.randn(3, 70, device=DEVICE)
    rng = sk.make_rng_state(0, DEVICE)
    op = torch.ops.hybridflow.fused_sample.default
    torch.library.opcheck(op, (logits, rng, 1.0, True, True))  # greedy: repeated calls agree

    def step(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens, logprobs = op(x * 2, rng, 0.5, True, True)
        return tokens + 1, logprobs

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")  # dynamo must not trace the launch
    for got, want in zip(compiled(logits), step(logits)):
        torch.testing.assert_close(got, want)


def _lively_model() -> torch.nn.Module:
    model = build_tiny_model("qwen2", vocab_size=64, hidden_size=32, num_hidden_layers=2, seed=1).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


@pytest.mark.skipif(DEVICE == "cuda", reason="the CUDA engine tests are in test_engine_gpu.py")
def test_engine_with_the_fused_sampler_in_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _lively_model()
    prompts = [[5, 6, 7], [8, 9, 10, 11], [4]]
    calls = []
    fused = sk.fused_sample
    monkeypatch.setattr(sk, "fused_sample", lambda *a, **kw: calls.append(1) or fused(*a, **kw))

    def run(fused: bool, params: SamplingParams) -> list[list]:
        engine = PagedEngine(model, max_num_seqs=4, sync_interval=2, block_size=4)
        engine.fused_sampler = fused
        return [[(s.token_ids, s.logprobs) for s in g] for g in engine.generate(prompts, params)]

    greedy = SamplingParams(n=2, max_new_tokens=5, temperature=0.0, do_sample=False, eos_token_ids=[7])
    assert [[t for t, _ in g] for g in run(True, greedy)] == [[t for t, _ in g] for g in run(False, greedy)]
    assert len(calls) >= 5  # prefill and decode steps went through the kernel
    sampled = SamplingParams(n=2, max_new_tokens=5, temperature=0.8, seed=3)
    out = run(True, sampled)
    assert out == run(True, sampled)  # same seed, same tokens through seats handed on as samples finish
    assert len({tuple(t) for g in out for t, _ in g}) > 3
    with torch.no_grad():
        for prompt, samples in zip(prompts, out):
            for tokens, logprobs in samples:
                ids = torch.tensor([prompt + tokens])
                logp = torch.log_softmax(model(ids).logits[0] / 0.8, -1)[len(prompt) - 1 : -1]
                want = logp.gather(-1, ids[0, len(prompt) :, None]).squeeze(-1)
                torch.testing.assert_close(torch.tensor(logprobs), want, atol=1e-5, rtol=0)


@pytest.mark.gpu
def test_full_vocab_on_gpu_in_bf16_and_in_a_graph() -> None:
    # The Qwen2.5 vocabulary: default chunks and splits, bf16 logits as the LM head writes them.
    logits = (torch.randn(64, 151936, device="cuda") * 2).to(torch.bfloat16)
    rng = sk.make_rng_state(7, "cuda")
    params = SamplingParams(temperature=0.9)
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside the sampler raises
    try:
        eager = [sk.fused_sample(logits, params, rng) for _ in range(2)]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for tokens, logprobs in eager:
        torch.testing.assert_close(logprobs, _log_softmax_at(logits, tokens, 0.9), atol=1e-4, rtol=0)
    assert not torch.equal(eager[0][0], eager[1][0])
    rng.copy_(torch.tensor([7, 0]))
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        captured = sk.fused_sample(logits, params, rng)
    for tokens, _ in eager:  # each replay advances the step on the device: the eager draws, in order
        graph.replay()
        assert torch.equal(captured[0], tokens)
    assert rng.tolist() == [7, 2]
    best, best_lp = sk.fused_sample(logits, SamplingParams(do_sample=False), rng)
    assert torch.equal(best, logits.argmax(-1))
    assert math.isfinite(float(best_lp.sum()))
