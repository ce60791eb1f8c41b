"""Next-token sampling: greedy, the exponential race, top-k / top-p / min-p and their log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from hybridflow.engine.rollout.sampling import SamplingParams, make_generator, sample


def _log_softmax_loop(row: list[float], temperature: float) -> list[float]:
    """Reference log-softmax of ``row / temperature`` in plain Python floats."""
    scaled = [x / temperature for x in row]
    top = max(scaled)
    log_z = top + math.log(sum(math.exp(x - top) for x in scaled))
    return [x - log_z for x in scaled]


def _repeat(row: list[float], rows: int) -> torch.Tensor:
    return torch.tensor(row, dtype=torch.float32).repeat(rows, 1)  # (rows, V)


def _counts(tokens: torch.Tensor, vocab: int) -> list[int]:
    return torch.bincount(tokens, minlength=vocab).tolist()


# --- greedy -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.0, 0.5])
def test_greedy_is_argmax_with_unfiltered_logprob(temperature: float) -> None:
    logits = torch.randn(6, 13)
    params = SamplingParams(do_sample=False, temperature=temperature, top_k=2, top_p=0.3)
    tokens, logprobs = sample(logits, params, make_generator(1, "cpu"))
    assert tokens.dtype == torch.int64 and logprobs.dtype == torch.float32
    assert tokens.shape == logprobs.shape == (6,)
    t_lp = temperature if temperature > 0 else 1.0  # greedy log-probs at temperature 1 when it is 0
    for b, row in enumerate(logits.tolist()):
        best = max(range(13), key=lambda v, row=row: row[v])
        assert tokens[b].item() == best
        # Filters are ignored for greedy: the log-prob is over the whole vocabulary.
        assert logprobs[b].item() == pytest.approx(_log_softmax_loop(row, t_lp)[best], abs=1e-6)


def test_greedy_bf16_logits() -> None:
    logits = torch.tensor([[0.5, 2.0, -1.0], [3.0, 0.0, 1.0]], dtype=torch.bfloat16)
    tokens, logprobs = sample(logits, SamplingParams(do_sample=False))
    assert tokens.tolist() == [1, 0]
    assert logprobs.dtype == torch.float32
    assert logprobs[0].item() == pytest.approx(_log_softmax_loop([0.5, 2.0, -1.0], 1.0)[1], abs=1e-6)


# --- unfiltered sampling ------------------------------------------------------------------------------


def test_sampling_reproducible_with_seeded_generator() -> None:
    logits = torch.randn(64, 50)
    params = SamplingParams(temperature=1.0)
    first = sample(logits, params, make_generator(123, "cpu"))
    again = sample(logits, params, make_generator(123, "cpu"))
    other = sample(logits, params, make_generator(124, "cpu"))
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], other[0])  # 64 draws over ~50 tokens: equal only by a fluke


def test_sampling_frequencies_match_softmax() -> None:
    row, temperature, draws = [1.0, 0.0, 2.0, -0.5, 0.7], 0.7, 40_000
    tokens, _ = sample(_repeat(row, draws), SamplingParams(temperature=temperature), make_generator(0, "cpu"))
    expected = [math.exp(lp) * draws for lp in _log_softmax_loop(row, temperature)]
    chi2 = sum((c - e) ** 2 / e for c, e in zip(_counts(tokens, 5), expected))
    assert chi2 < 18.47  # chi-square, 4 degrees of freedom, p = 0.001


def test_unfiltered_logprob_is_log_softmax_at_temperature() -> None:
    logits = torch.randn(32, 17) * 3
    temperature = 1.3
    tokens, logprobs = sample(logits, SamplingParams(temperature=temperature), make_generator(5, "cpu"))
    for b, row in enumerate(logits.tolist()):
        expected = _log_softmax_loop(row, temperature)[tokens[b].item()]
        assert logprobs[b].item() == pytest.approx(expected, abs=1e-5)


def test_bf16_logits_at_temperature_one() -> None:
    logits = (torch.randn(16, 40) * 2).to(torch.bfloat16)
    tokens, logprobs = sample(logits, SamplingParams(), make_generator(9, "cpu"))
    assert logprobs.dtype == torch.float32
    for b, row in enumerate(logits.float().tolist()):
        assert logprobs[b].item() == pytest.approx(_log_softmax_loop(row, 1.0)[tokens[b].item()], abs=1e-5)


@pytest.mark.parametrize("kwargs", [{}, {"do_sample": False}, {"top_k": 3}])
def test_logprobs_off_gives_zeros_and_same_tokens(kwargs: dict) -> None:
    logits = torch.randn(8, 20)
    with_lp = sample(logits, SamplingParams(**kwargs), make_generator(4, "cpu"))
    without = sample(logits, SamplingParams(logprobs=False, **kwargs), make_generator(4, "cpu"))
    assert torch.equal(with_lp[0], without[0])
    assert without[1].dtype == torch.float32 and torch.equal(without[1], torch.zeros(8))
    assert (with_lp[1] < 0).all()


def test_sample_leaves_float32_logits_untouched() -> None:
    logits = torch.randn(4, 9)
    before = logits.clone()
    for params in (
        SamplingParams(),
        SamplingParams(top_k=3, top_p=0.8, min_p=0.1),
        SamplingParams(min_p=0.2),
    ):
        sample(logits, params, make_generator(0, "cpu"))
    assert torch.equal(logits, before)


def test_minus_inf_logits_never_sampled() -> None:
    row = [0.0, float("-inf"), 0.0, float("-inf")]
    tokens, logprobs = sample(_repeat(row, 2000), SamplingParams(), make_generator(3, "cpu"))
    assert set(tokens.tolist()) == {0, 2}
    assert torch.allclose(logprobs, torch.full_like(logprobs, math.log(0.5)))


def test_global_rng_when_no_generator() -> None:
    logits = torch.randn(16, 30)
    torch.manual_seed(7)
    first, _ = sample(logits, SamplingParams())
    torch.manual_seed(7)
    again, _ = sample(logits, SamplingParams())
    assert torch.equal(first, again)
    assert make_generator(None, "cpu") is None


# --- filters ------------------------------------------------------------------------------------------


def test_top_k_stays_in_top_k_with_renormalised_logprobs() -> None:
    row = [1.0, 3.0, 0.5, 2.0, -1.0]  # top-2: tokens 1 (logit 3) and 3 (logit 2)
    tokens, logprobs = sample(_repeat(row, 4000), SamplingParams(top_k=2), make_generator(0, "cpu"))
    assert set(tokens.tolist()) == {1, 3}
    # Renormalised over {3, 2}: p(1) = 1 / (1 + e^-1), p(3) = 1 / (1 + e).
    expected = {1: -math.log(1 + math.exp(-1)), 3: -math.log(1 + math.e)}
    for tok, lp in zip(tokens.tolist(), logprobs.tolist()):
        assert lp == pytest.approx(expected[tok], abs=1e-6)
    share = _counts(tokens, 5)[1] / 4000
    assert share == pytest.approx(1 / (1 + math.exp(-1)), abs=0.03)  # 0.731; std ~0.007


def _logits_for(probs: list[float]) -> list[float]:
    return [math.log(p) for p in probs]


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    probs = [0.15, 0.5, 0.05, 0.3]  # sorted: 0.5 (tok 1), 0.3 (tok 3), 0.15 (tok 0), 0.05 (tok 2)
    logits = _repeat(_logits_for(probs), 3000)
    gen = make_generator(0, "cpu")
    # 0.5 < 0.7 <= 0.5 + 0.3: keep {1, 3}, renormalised by 0.8.
    tokens, logprobs = sample(logits, SamplingParams(top_p=0.7), gen)
    assert set(tokens.tolist()) == {1, 3}
    for tok, lp in zip(tokens.tolist(), logprobs.tolist()):
        assert lp == pytest.approx(math.log(probs[tok] / 0.8), abs=1e-5)
    # 0.8 < 0.85 <= 0.95: keep {1, 3, 0}.
    tokens, logprobs = sample(logits, SamplingParams(top_p=0.85), gen)
    assert set(tokens.tolist()) == {0, 1, 3}
    for tok, lp in zip(tokens.tolist(), logprobs.tolist()):
        assert lp == pytest.approx(math.log(probs[tok] / 0.95), abs=1e-5)
    # 0.45 <= 0.5: the top token alone, with probability 1.
    tokens, logprobs = sample(logits[:50], SamplingParams(top_p=0.45), gen)
    assert set(tokens.tolist()) == {1}
    assert torch.allclose(logprobs, torch.zeros(50), atol=1e-6)


def test_top_p_runs_over_renormalised_top_k_survivors() -> None:
    probs = [0.1, 0.4, 0.2, 0.3]
    logits = _repeat(_logits_for(probs), 500)
    # Survivors of top-2: 0.4, 0.3 -> renormalised 4/7 = 0.571 >= 0.55, so top-p keeps token 1 alone.
    # Over the full distribution 0.4 < 0.55 would have kept two tokens.
    tokens, logprobs = sample(logits, SamplingParams(top_k=2, top_p=0.55), make_generator(0, "cpu"))
    assert set(tokens.tolist()) == {1}
    assert torch.allclose(logprobs, torch.zeros(500), atol=1e-6)


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    probs = [0.3, 0.05, 0.5, 0.15]
    logits = _repeat(_logits_for(probs), 3000)
    # Threshold 0.2 * 0.5 = 0.1: token 1 (0.05) goes; the others are renormalised by 0.95.
    tokens, logprobs = sample(logits, SamplingParams(min_p=0.2), make_generator(0, "cpu"))
    assert set(tokens.tolist()) == {0, 2, 3}
    for tok, lp in zip(tokens.tolist(), logprobs.tolist()):
        assert lp == pytest.approx(math.log(probs[tok] / 0.95), abs=1e-5)
    # With top-k=2 first (0.5, 0.3 renormalised to 0.625, 0.375) and min_p=0.7: 0.375 < 0.7 * 0.625.
    tokens, logprobs = sample(logits[:100], SamplingParams(top_k=2, min_p=0.7), make_generator(1, "cpu"))
    assert set(tokens.tolist()) == {2}
    assert torch.allclose(logprobs, torch.zeros(100), atol=1e-6)


def test_filtered_frequencies_match_renormalised_distribution() -> None:
    probs = [0.1, 0.4, 0.2, 0.3]
    draws = 20_000
    tokens, _ = sample(
        _repeat(_logits_for(probs), draws), SamplingParams(top_k=3, top_p=0.99), make_generator(2, "cpu")
    )
    counts = _counts(tokens, 4)
    assert counts[0] == 0
    expected = [0.0, 0.4 / 0.9 * draws, 0.2 / 0.9 * draws, 0.3 / 0.9 * draws]
    chi2 = sum((counts[v] - expected[v]) ** 2 / expected[v] for v in (1, 2, 3))
    assert chi2 < 13.82  # chi-square, 2 degrees of freedom, p = 0.001


def test_top_k_at_least_vocab_is_plain_sampling() -> None:
    logits = torch.randn(8, 6)
    tokens, logprobs = sample(logits, SamplingParams(top_k=6), make_generator(0, "cpu"))
    for b, row in enumerate(logits.tolist()):
        assert logprobs[b].item() == pytest.approx(_log_softmax_loop(row, 1.0)[tokens[b].item()], abs=1e-6)


def test_full_vocab_rows() -> None:
    vocab = 151_936
    logits = torch.randn(2, vocab, dtype=torch.bfloat16) * 4
    gen = make_generator(0, "cpu")
    tokens, logprobs = sample(logits, SamplingParams(temperature=0.9), gen)
    assert tokens.shape == (2,) and ((tokens >= 0) & (tokens < vocab)).all()
    assert torch.isfinite(logprobs).all() and (logprobs <= 0).all()
    tokens, logprobs = sample(logits, SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.05), gen)
    top50 = torch.topk(logits.float(), 50, dim=-1).indices  # (2, 50)
    assert (top50 == tokens[:, None]).any(dim=-1).all()
    assert torch.isfinite(logprobs).all() and (logprobs <= 0).all()
    tokens, _ = sample(logits, SamplingParams(top_p=0.5), gen)  # sort over the whole vocabulary
    assert ((tokens >= 0) & (tokens < vocab)).all()


# --- parameters ---------------------------------------------------------------------------------------


def test_params_defaults_and_properties() -> None:
    params = SamplingParams()
    assert params.n == 1 and params.top_k == -1 and params.top_p == 1.0 and params.min_p == 0.0
    assert params.do_sample and not params.greedy and not params.filtered and params.logprobs
    assert SamplingParams(do_sample=False, temperature=0.0).greedy
    assert SamplingParams(do_sample=False, temperature=0.0).logprob_temperature == 1.0
    assert SamplingParams(top_k=0).filtered is False and SamplingParams(top_k=5).filtered
    assert SamplingParams(top_p=0.9).filtered and SamplingParams(min_p=0.1).filtered
    assert not SamplingParams(do_sample=False, top_k=5).filtered
    assert SamplingParams(eos_token_ids=7).eos_token_ids == [7]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"n": 0}, ValueError, "n must be >= 1"),
        ({"n": 2.0}, TypeError, "n must be an int"),
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens"),
        ({"temperature": -0.1}, ValueError, "temperature"),
        ({"temperature": float("nan")}, ValueError, "temperature"),
        ({"temperature": 0.0}, ValueError, "set do_sample=false for greedy or temperature > 0"),
        ({"top_k": -2}, ValueError, "top_k"),
        ({"top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, ValueError, "top_p"),
        ({"min_p": 1.0}, ValueError, r"min_p must be in \[0, 1\)"),
        ({"min_p": -0.1}, ValueError, "min_p"),
        ({"eos_token_ids": [-1]}, ValueError, "eos_token_ids"),
        ({"stop_token_ids": ["a"]}, ValueError, "stop_token_ids"),
        ({"seed": 1.5}, TypeError, "seed"),
        ({"do_sample": "yes"}, TypeError, "do_sample"),
    ],
)
def test_params_validation(kwargs: dict, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


def test_sample_rejects_wrong_rank() -> None:
    with pytest.raises(ValueError, match=r"\(B, V\)"):
        sample(torch.randn(2, 3, 4), SamplingParams())
