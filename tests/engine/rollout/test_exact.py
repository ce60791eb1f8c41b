"""``rollout.exact`` on the paged engine: every sampled token's log-prob is bitwise the trainer's
recomputation, whatever the batch around it (the sequences packed in another order, or alone), for dense and
MoE families, single-turn and multi-turn, on the CPU (bf16 and float32) and on the GPU (bf16)."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_agent_loop import END, EchoTools

from hybridflow.engine.ops.exact_model import prepare_exact
from hybridflow.engine.ops.invariant import exact_kernels, token_log_probs
from hybridflow.engine.ops.packed_attention import BOUNDS_KWARG, packed_mask_placeholder
from hybridflow.engine.rollout.agent_loop import AgentLoop, LoopLimits
from hybridflow.engine.rollout.engine import PagedEngine
from hybridflow.engine.rollout.sampling import SamplingParams
from hybridflow.models.moe import install_moe
from hybridflow.models.tiny import build_tiny_model

PROMPTS = [[5, 9, 3, 7, 2, 11, 4], [8, 1], [6, 6, 6, 12, 3, 3, 9, 1, 2, 5, 7], [3, 14, 9]]
FAMILIES = ["qwen2", "qwen3", "llama", "qwen3_moe", "mixtral"]


def policy(arch: str, dtype: torch.dtype, device: str = "cpu", hidden: int = 64) -> torch.nn.Module:
    """A tiny model as the trainer holds it in exact mode (MoE blocks installed, then prepared)."""
    model = build_tiny_model(arch, vocab_size=64, hidden_size=hidden, num_hidden_layers=2, seed=3)
    with torch.no_grad():  # larger weights: peaked distributions, so rounding would show
        for p in model.parameters():
            p.mul_(3.0)
    install_moe(model)
    prepare_exact(model)
    return model.to(device, dtype).eval()


@torch.no_grad()
def recompute(model: torch.nn.Module, seqs: list[tuple[list[int], list[int]]], temperature: float) -> list:
    """The trainer's log-probs of each (prompt, response) from ONE packed forward of all of them."""
    ids = torch.tensor([[t for p, r in seqs for t in p + r]], device=model.device)
    bounds = [0, *itertools.accumulate(len(p) + len(r) for p, r in seqs)]
    positions = torch.cat([torch.arange(len(p) + len(r)) for p, r in seqs])[None].to(model.device)
    mask = packed_mask_placeholder(model.device)
    extra = {BOUNDS_KWARG: torch.tensor(bounds)}
    h = model.model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=False, **extra)
    logits = model.lm_head(h.last_hidden_state[0])  # (S, V)
    out = []
    for (p, r), b in zip(seqs, bounds):
        rows = logits[b + len(p) - 1 : b + len(p) + len(r) - 1]
        out.append(token_log_probs(rows, torch.tensor(r, device=model.device), temperature).cpu())
    return out


def check_single_turn(arch: str, dtype: torch.dtype, device: str, max_new: int) -> None:
    with exact_kernels():
        model = policy(arch, dtype, device)
        params = SamplingParams(temperature=0.8, max_new_tokens=max_new, n=3, seed=11, eos_token_ids=[0, 1])
        out = PagedEngine(model, num_blocks=512, block_size=16, dtype=dtype).generate(PROMPTS, params)
        seqs = [(p, s.token_ids) for p, g in zip(PROMPTS, out) for s in g]
        got = [torch.tensor(s.logprobs) for g in out for s in g]
        assert len({len(r) for _, r in seqs}) > 1  # responses end at different places
        reverse = recompute(model, seqs[::-1], 0.8)[::-1]  # the trainer's batch: other rows, other order
        alone = [recompute(model, [x], 0.8)[0] for x in seqs[:4]]  # a micro-batch of one
    for g, want in zip(got, reverse):
        assert torch.equal(g, want), (g - want).abs().max()
    assert all(torch.equal(g, want) for g, want in zip(got, alone))


@pytest.mark.parametrize("arch", FAMILIES)
def test_sampled_log_probs_are_the_trainers_bitwise_in_bf16(arch: str) -> None:
    check_single_turn(arch, torch.bfloat16, "cpu", 24)


def test_sampled_log_probs_are_the_trainers_bitwise_in_float32() -> None:
    check_single_turn("qwen2", torch.float32, "cpu", 24)


def test_without_exact_mode_they_are_not() -> None:
    # the same run without the switch: the engine's decode and the packed forward round differently
    model = policy("qwen2", torch.bfloat16)
    params = SamplingParams(temperature=0.8, max_new_tokens=24, n=3, seed=11)
    out = PagedEngine(model, num_blocks=512, block_size=16, dtype=torch.bfloat16).generate(PROMPTS, params)
    seqs = [(p, s.token_ids) for p, g in zip(PROMPTS, out) for s in g]
    got = [torch.tensor(s.logprobs) for g in out for s in g]
    assert not all(torch.equal(g, w) for g, w in zip(got, recompute(model, seqs, 0.8)))


@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe"])
def test_a_three_turn_episode_is_the_trainers_bitwise(arch: str) -> None:
    with exact_kernels():
        model = policy(arch, torch.bfloat16, hidden=32)
        engine = PagedEngine(model, num_blocks=256, block_size=4, sync_interval=2, dtype=torch.bfloat16)
        params = SamplingParams(n=2, temperature=1.0, max_new_tokens=60, eos_token_ids=END, seed=3)
        loop = AgentLoop(engine, EchoTools(), LoopLimits(max_assistant_turns=3, max_response_length=60))
        episodes = [e for g in loop.run(PROMPTS, params) for e in g]
        assert max(e.turns for e in episodes) == 3 and any(e.tool_calls for e in episodes)
        wants = recompute(model, [(e.prompt, e.tokens) for e in episodes], 1.0)
    for e, want in zip(episodes, wants):
        sampled = torch.tensor(e.mask, dtype=torch.bool)
        assert torch.equal(torch.tensor(e.logprobs)[sampled], want[sampled])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama", "qwen3_moe"])
def test_on_the_gpu_256_sampled_tokens_are_the_trainers_bitwise(arch: str) -> None:
    check_single_turn(arch, torch.bfloat16, "cuda", 256)
