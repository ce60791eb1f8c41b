"""FP8 projections with static activation scales (``scaled_mm_static``, ``triton_w8a8``) on CUDA, bf16 compute: CUDA graphs
(captured once the first prefill has set the scales) give the eager tokens, a compiled decode (the quantisation
fused into the RMSNorm / SiLU-mul by inductor) stays close, the scale buffers are the same tensors across
sessions and refreshes while their values follow the weights, and the sampled log-probs are as close to the
bf16 model's as the per-token path's."""

from __future__ import annotations

import copy

import pytest
import torch

from hybridflow.engine.ops.fp8 import current_kernel, quantise_module, use_kernel
from hybridflow.engine.rollout.engine import PagedEngine
from hybridflow.engine.rollout.sampling import SamplingParams
from hybridflow.models import build_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 3, 14], [4], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]]


@pytest.fixture
def kernel():
    before = current_kernel()
    yield use_kernel
    use_kernel(before)


def _models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the bf16 model, its FP8 copy as the switch delivers it)."""
    bf16 = build_tiny_model("qwen2", vocab_size=64, hidden_size=64, num_hidden_layers=2, seed=4)
    bf16 = bf16.cuda().to(torch.bfloat16).eval()
    fp8 = copy.deepcopy(bf16)
    quantise_module(fp8)
    return bf16, fp8


def _tokens(out) -> list[list[list[int]]]:
    return [[s.token_ids for s in g] for g in out]


def _gap(model: torch.nn.Module, out) -> float:
    """Mean |engine log-prob - ``model``'s log-prob| of the sampled tokens."""
    gaps = []
    for prompt, group in zip(PROMPTS, out):
        for s in group:
            ids = torch.tensor([prompt + s.token_ids], device="cuda")
            with torch.no_grad():
                logp = model(ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
            want = logp.gather(-1, ids[0, len(prompt) :, None])[:, 0].cpu()
            gaps.append((want - torch.tensor(s.logprobs)).abs().mean())
    return float(torch.stack(gaps).mean())


@pytest.mark.parametrize("static_kernel", ["scaled_mm_static", "triton_w8a8"])
def test_graphs_and_a_compiled_decode_over_static_scales(static_kernel: str, kernel) -> None:
    kernel(static_kernel)
    _, fp8 = _models()
    params = SamplingParams(n=2, max_new_tokens=12, seed=5)
    want = PagedEngine(fp8, block_size=4, enforce_eager=True).generate(PROMPTS, params)
    graphs = PagedEngine(fp8, block_size=4, free_cache_engine=False)
    assert _tokens(graphs.generate(PROMPTS, params)) == _tokens(want)
    scales = list(graphs.runner.weights.act_scales)
    first = torch.cat(scales).clone()
    with torch.no_grad():  # a weight update, in place, as the switch fills the FP8 weights' scales
        for module in fp8.modules():
            if hasattr(module, "weight_scale"):
                module.weight_scale.mul_(1.25)
    graphs.generate(PROMPTS, params)  # a new session: refreshed, recalibrated, graphs replayed on the buffers
    assert all(a is b for a, b in zip(graphs.runner.weights.act_scales, scales))
    assert not torch.equal(torch.cat(scales), first)
    compiled = PagedEngine(fp8, block_size=4, compile_decode=True).generate(PROMPTS, params)
    eager_now = PagedEngine(fp8, block_size=4, enforce_eager=True).generate(PROMPTS, params)
    # inductor computes the fused norm and quantisation without the intermediate bf16 rounding, so a few
    # activations round to the neighbouring e4m3 value: tokens may differ, the log-probs stay close
    ref = fp8_reference(fp8)
    assert abs(_gap(ref, compiled) - _gap(ref, eager_now)) < 0.05


def fp8_reference(fp8: torch.nn.Module) -> torch.nn.Module:
    """An HF model of the FP8 model's dequantised weights (bf16), to score log-probs with."""
    from hybridflow.engine.ops.fp8 import Fp8Weight, dequantise

    ref = copy.deepcopy(fp8)
    for module in ref.modules():
        if hasattr(module, "weight_scale"):
            w = dequantise(Fp8Weight(module.weight.data, module.weight_scale), torch.bfloat16)
            module.weight = torch.nn.Parameter(w, requires_grad=False)
            del module.weight_scale
    return ref


def test_static_scales_sample_as_close_to_the_bf16_model_as_per_token_scales(kernel) -> None:
    bf16, fp8 = _models()
    params = SamplingParams(n=2, max_new_tokens=12, seed=3)
    gaps = {}
    for name in ("scaled_mm", "scaled_mm_static", "triton_w8a8"):
        kernel(name)
        gaps[name] = _gap(bf16, PagedEngine(fp8, block_size=4).generate(PROMPTS, params))
    # all carry FP8's weight and activation rounding; a broken static path (a wrong scale, a stale buffer)
    # moves log-probs by whole units
    assert 0 < gaps["scaled_mm"] < 0.2, gaps
    assert max(gaps["scaled_mm_static"], gaps["triton_w8a8"]) < 2 * gaps["scaled_mm"] + 0.02, gaps
