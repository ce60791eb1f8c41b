"""Partial rollouts (asynchronous RL's colocate mode) on the paged engine: a phase stops once enough groups are
done, the unfinished samples keep their tokens, log-probs and versions, and continue in a later phase under
newer weights; every token's log-prob is its own version's (the trainer's recomputation, float32, 1e-5)."""

from __future__ import annotations

import pytest
import torch
from test_engine import PROMPTS, lively_model
from test_moe_rollout import lively_moe

from hybridflow.engine.rollout.engine import PagedEngine
from hybridflow.engine.rollout.partial import new_group, roll_partial
from hybridflow.engine.rollout.sampling import SamplingParams


def token_logprobs(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log p(response[j] | prompt + response[:j]) under ``model``, float32 (R,)."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # (R, V)
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(response)[:, None])[:, 0]


def policy(arch: str) -> torch.nn.Module:
    """A lively tiny model of ``arch`` (a mixture of experts' routers drawn so that tokens spread)."""
    return lively_moe(arch, scale=0.2) if arch.endswith("moe") else lively_model(arch)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama", "qwen3_moe"])
def test_samples_continue_across_a_weight_change_with_every_tokens_version_and_logprob(arch: str) -> None:
    model = policy(arch)
    old = {k: v.clone() for k, v in model.state_dict().items()}
    engine = PagedEngine(model, num_blocks=64, block_size=4, sync_interval=2)
    params = SamplingParams(
        n=2, temperature=1.0, max_new_tokens=24, eos_token_ids=list(range(24, 40)), seed=11
    )
    groups = [new_group(k, p, 2) for k, p in enumerate(PROMPTS)]
    roll_partial(engine, groups, params, quota=1, version=4)
    assert not engine.has_work and engine.pool.num_free == len(engine.pool.blocks)
    done = [g for g in groups if g.done]
    assert 1 <= len(done) < len(groups)  # the phase stopped early: some groups carry on
    assert any(g.started and not g.done for g in groups)
    first = {(g.key, i): len(s.tokens) for g in groups for i, s in enumerate(g.samples)}
    with torch.no_grad():  # the update: new weights in place
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    new = {k: v.clone() for k, v in model.state_dict().items()}
    roll_partial(engine, groups, params, quota=len(groups), version=5)
    assert all(g.done for g in groups)
    mixed = 0
    for g in groups:
        for i, s in enumerate(g.samples):
            k = first[(g.key, i)]
            assert s.versions == [4] * k + [5] * (len(s.tokens) - k), (g.key, i)
            assert len(s.logprobs) == len(s.tokens) <= params.max_new_tokens
            assert s.finish_reason in ("eos", "length")
            mixed += 0 < k < len(s.tokens)
            for state, lo, hi in ((old, 0, k), (new, k, len(s.tokens))):
                if lo == hi:
                    continue
                model.load_state_dict(state)
                want = token_logprobs(model, g.prompt, s.tokens)[lo:hi]
                assert (torch.tensor(s.logprobs[lo:hi]) - want).abs().max() < 1e-5, (g.key, i, lo, hi)
            model.load_state_dict(new)
    assert mixed > 0  # some sample spans both versions


def test_a_phase_waits_for_the_groups_it_must_finish() -> None:
    model = lively_model("qwen3")
    engine = PagedEngine(model, num_blocks=64, block_size=4, sync_interval=2)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=16, eos_token_ids=[13, 35], seed=5)
    groups = [new_group(k, p, 2) for k, p in enumerate(PROMPTS)]
    roll_partial(engine, groups, params, quota=1, version=0)
    open_keys = frozenset(g.key for g in groups if not g.done)
    assert open_keys
    roll_partial(engine, groups, params, quota=0, version=1, finish=open_keys)
    assert all(g.done for g in groups)  # quota 0, but the named groups had to finish
    assert all(len(s.tokens) <= 16 for g in groups for s in g.samples)


def test_partial_rollouts_refuse_a_vision_language_model() -> None:
    from support.vlm_cases import lively_vl_model, prompts

    from hybridflow.utils.errors import UserError

    model, processor = lively_vl_model()
    ids, _ = prompts(processor)
    groups = [new_group(k, p, 2) for k, p in enumerate(ids)]
    with pytest.raises(UserError, match=r"trainer\.async_mode=sync"):
        roll_partial(PagedEngine(model, block_size=8), groups, SamplingParams(n=2, max_new_tokens=4), 1, 0)
