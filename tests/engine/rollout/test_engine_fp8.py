"""The paged engine with an FP8 KV cache (``kv_cache_dtype="fp8"``), on CPU (the torch reference path).

Several prompts of different lengths, two samples each, with EOS: the run completes, and the log-probs of
what it sampled, recomputed by the float model (as the trainer does), are close to the engine's. The scales
are set by the first prefill after a weight refresh (a session's start, ``resume(weights_changed=True)``),
stay as they are for later prefills and decode steps in between, and live in one tensor filled in place.
"""

from __future__ import annotations

import logging

import pytest
import torch

from hybridflow.engine.rollout.engine import PagedEngine
from hybridflow.engine.rollout.factory import make_rollout
from hybridflow.engine.rollout.sampling import SamplingParams
from hybridflow.models import build_tiny_model
from hybridflow.utils.errors import UserError

PROMPTS = [
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
    [8, 9, 10, 11, 12, 3, 14],
    [4, 5],
    list(range(20, 51)),
]


def _model() -> torch.nn.Module:
    return build_tiny_model("qwen2", vocab_size=64, hidden_size=64, num_hidden_layers=2, seed=2).eval()


def _params(**kw) -> SamplingParams:
    return SamplingParams(
        **{"temperature": 1.0, "max_new_tokens": 14, "seed": 3, "n": 2, "eos_token_ids": [7], **kw}
    )


def _recomputed(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    """The float model's log-probs of ``response`` after ``prompt`` (temperature 1): the trainer's."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logp = model(ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)  # (R, V)
    return logp.gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_generate_with_an_fp8_cache_samples_what_the_float_model_scores_alike(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = _model()
    engine = PagedEngine(model, block_size=4, kv_cache_dtype="fp8")
    with caplog.at_level(logging.INFO, logger="hybridflow.engine.rollout"):
        out = engine.generate(PROMPTS, _params())
    assert "the KV cache is FP8" in caplog.text and "blocks of 4 positions" in caplog.text
    diffs, reasons = [], set()
    for prompt, samples in zip(PROMPTS, out):
        assert len(samples) == 2
        for s in samples:
            reasons.add(s.finish_reason)
            want = _recomputed(model, prompt, s.token_ids)
            diffs.append((torch.tensor(s.logprobs) - want).abs())
    d = torch.cat(diffs)
    assert reasons == {"eos", "length"}  # responses end at different places
    # e4m3 moves each cached K and V by ~2.6% (RMS): the attention outputs by a few percent, the log-probs
    # of a tiny model by a few thousandths of a nat (the float cache's: ~1e-6, summation order only).
    assert 0 < d.mean() < 0.02 and d.max() < 0.1, (d.mean(), d.max())
    float_out = PagedEngine(model, block_size=4).generate(PROMPTS, _params())
    float_d = [
        (torch.tensor(s.logprobs) - _recomputed(model, p, s.token_ids)).abs().max()
        for p, samples in zip(PROMPTS, float_out)
        for s in samples
    ]
    assert max(float_d) < 1e-4 < d.max()  # the difference is the FP8 cache's


def test_scales_are_set_after_each_weight_refresh_and_fixed_in_between() -> None:
    model = _model()
    engine = PagedEngine(model, num_blocks=64, block_size=4, kv_cache_dtype="fp8", free_cache_engine=False)
    params = _params(eos_token_ids=[], max_new_tokens=12)
    engine.add(PROMPTS[0], params)
    engine.step(max_tokens=2)
    cache = engine.session.cache
    first, ptr = cache.scales.clone(), cache.scales.data_ptr()
    assert not torch.equal(first, torch.ones_like(first))  # calibrated by the prefill
    engine.add(PROMPTS[3], params)  # a later prompt with other values: prefilled under the same scales
    engine.step(max_tokens=2)
    engine.step(max_tokens=2)
    assert torch.equal(cache.scales, first)
    engine.pause()
    with torch.no_grad():  # a training step, in place (the runner reads these very tensors)
        for p in model.parameters():
            p.mul_(1.5)
    engine.resume(weights_changed=True)
    engine.step(max_tokens=2)  # the running sequences are prefilled again under the new weights
    second = cache.scales.clone()
    assert cache.scales.data_ptr() == ptr  # filled in place: a captured CUDA graph still reads them
    assert (second > 1.2 * first).all()  # K and V grew with the weights: so did every head's scale
    while engine.has_work:
        engine.step(max_tokens=None)
    assert torch.equal(engine.kept_cache.scales, second)
    engine.generate([PROMPTS[1]], params)  # a new session after idle (the trainer may have stepped): its
    assert engine.kept_cache is cache  # prefill (another prompt) sets the kept cache's scales again
    assert cache.scales.data_ptr() == ptr and not torch.equal(cache.scales, second)


def test_kv_cache_dtypes_other_than_auto_and_fp8_are_refused() -> None:
    with pytest.raises(UserError, match=r"rollout\.kv_cache_dtype='bf16'.*auto, fp8"):
        PagedEngine(_model(), kv_cache_dtype="bf16")


def test_hf_generate_refuses_an_fp8_cache() -> None:
    with pytest.raises(UserError, match=r"rollout\.kv_cache_dtype=fp8.*set rollout\.kv_cache_dtype=auto"):
        make_rollout(_model(), "hf", kv_cache_dtype="fp8")
    assert make_rollout(_model(), "hf", kv_cache_dtype="auto") is not None
