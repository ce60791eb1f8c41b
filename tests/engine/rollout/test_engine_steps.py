"""The rollout engine's step API on CPU (issue 41): ``extend`` (a tool's output, also while preempted, up to
the budget), ``pause`` / weight refresh / ``resume``, ``abort``, requests in flight together, seats after a
refresh, and a next turn that finds the blocks of the turn before it; every block back in the pool after each
test."""

from __future__ import annotations

import math

import pytest
import torch
from test_engine import PROMPTS, all_back, greedy, hf_greedy, lively_model

from hybridflow.engine.rollout.engine import PagedEngine
from hybridflow.engine.rollout.sampling import SamplingParams


def test_extend_then_step_equals_generating_from_the_whole_prompt() -> None:
    model = lively_model("qwen3")
    engine = PagedEngine(model, num_blocks=32, block_size=4)
    prompt, tool = PROMPTS[1], [40, 41, 42, 43, 44]  # a tool's output, five tokens
    (sid,) = engine.add(prompt, greedy(3 + len(tool) + 6))
    for _ in range(3):
        engine.step()
    (seq,) = [s for s in engine.running if s.id == sid]
    first = list(seq.response)
    engine.extend(sid, tool)
    while engine.has_work:
        engine.step()
    assert 3 <= len(first) < 14 - len(tool)  # a step prefills and decodes: a new sequence gets two tokens
    rest = 14 - len(first) - len(tool)
    want = hf_greedy(model, prompt + first + tool, rest)
    assert seq.response == first + tool + want
    k = len(first)
    assert seq.trainable == [True] * k + [False] * 5 + [True] * rest
    assert all(math.isnan(x) for x in seq.logprobs[k : k + 5])
    assert not any(math.isnan(x) for x in seq.logprobs[:k] + seq.logprobs[k + 5 :])
    all_back(engine)


def test_pause_refresh_resume_continues_under_the_new_weights() -> None:
    model = lively_model("llama")
    engine = PagedEngine(model, num_blocks=48, block_size=4)
    ids = [engine.add(p, greedy(9)) for p in PROMPTS[:3]]
    for _ in range(4):
        engine.step()
    engine.pause()
    with torch.no_grad():  # the trainer's update, in place: the runner reads these very tensors
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(-1.0)
    assert engine.step() == []  # paused: nothing moves
    seqs = {s.id: s for s in engine.running}
    before = {i: list(seqs[i].response) for (i,) in ids}
    engine.resume()
    while engine.has_work:
        engine.step()
    for (i,), prompt in zip(ids, PROMPTS[:3]):
        s = seqs[i]
        fresh = hf_greedy(model, prompt + before[i], 9 - len(before[i]))
        assert s.response == before[i] + fresh
        assert s.versions == [0] * len(before[i]) + [1] * len(fresh)
    all_back(engine)


def test_abort_returns_exactly_what_was_sampled_so_far() -> None:
    model = lively_model("qwen2")
    full = PagedEngine(model, num_blocks=32, block_size=4).generate(PROMPTS[:2], greedy(10, n=2))
    engine = PagedEngine(model, num_blocks=32, block_size=4)
    first = engine.add(PROMPTS[0], greedy(10, n=2))
    second = engine.add(PROMPTS[1], greedy(10, n=2))
    for _ in range(4):
        engine.step()
    aborted = {s.id: s for s in engine.abort([first[1], second[0]])}
    assert {s.finish_reason for s in aborted.values()} == {"abort"}
    for sid, want in ((first[1], full[0][1]), (second[0], full[1][0])):
        got = aborted[sid]
        assert 0 < len(got.response) < 10 and got.response == want.token_ids[: len(got.response)]
        assert got.logprobs == pytest.approx(want.logprobs[: len(got.response)], abs=1e-6)
    while engine.has_work:
        engine.step()
    all_back(engine)


def test_extend_on_a_preempted_sequence_waits_for_its_next_prefill() -> None:
    """A tool's output arriving while its sequence is preempted joins the tokens prefilled when it comes back."""
    model = lively_model("qwen2")
    engine = PagedEngine(model, num_blocks=12, block_size=4)
    ids = [engine.add(p, greedy(12)) for p in PROMPTS]
    preempted = None
    while preempted is None and engine.has_work:
        engine.step()
        preempted = next((s for s in engine.running if s.table is None and s.finish_reason is None), None)
    assert preempted is not None and len(preempted.response) < 10  # 4 sequences of up to 23 tokens, 12 blocks
    so_far = list(preempted.response)
    engine.extend(preempted.id, [40, 41])
    while engine.has_work:
        engine.step()
    prompt = PROMPTS[[i for (i,) in ids].index(preempted.id)]
    rest = 12 - len(so_far) - 2
    want = hf_greedy(model, prompt + so_far + [40, 41], rest)
    assert preempted.response == [*so_far, 40, 41, *want]
    all_back(engine)


def test_an_extension_that_spends_the_budget_ends_the_sequence() -> None:
    engine = PagedEngine(lively_model("qwen2"), num_blocks=16, block_size=4)
    (sid,) = engine.add(PROMPTS[0], greedy(5))
    engine.step()  # the prompt's prefill samples one token, one decode step another
    (seq,) = engine.running
    assert len(seq.response) == 2
    engine.extend(sid, [40, 41, 42])  # 2 sampled + 3 extended = the budget of 5
    assert (
        engine.step() == [seq] and seq.finish_reason == "length" and seq.trainable == [True] * 2 + [False] * 3
    )
    all_back(engine)


def test_requests_in_flight_share_their_sampling_settings() -> None:
    engine = PagedEngine(lively_model("qwen2"), num_blocks=16, block_size=4)
    first = engine.add(PROMPTS[0], greedy(6, n=2))
    engine.step()
    engine.add(PROMPTS[1], greedy(4, n=3))  # n and a smaller budget may differ
    with pytest.raises(ValueError, match="sampling settings must equal those of the requests in flight"):
        engine.add(PROMPTS[1], SamplingParams(temperature=0.7, max_new_tokens=4, seed=1))
    with pytest.raises(ValueError, match="max_new_tokens up to 6"):
        engine.add(PROMPTS[1], greedy(7))
    with pytest.raises(ValueError, match="generate needs an idle engine"):
        engine.generate(PROMPTS, greedy(2))
    while engine.has_work:
        engine.step(max_tokens=None)
    assert engine.session is None and first  # the session closed with the last sequence
    engine.add(PROMPTS[1], SamplingParams(temperature=0.7, max_new_tokens=4, seed=1))  # idle: any settings
    engine.abort([s.id for g in engine.waiting for s in g])
    all_back(engine)


def test_a_next_turn_finds_the_blocks_of_the_turn_before_it() -> None:
    """While the engine is busy (other episodes in flight), a finished turn's blocks stay cached: the next
    request, the conversation so far plus a new message, prefills only what is not cached and generates what
    a run from the whole conversation does. (A session ends when the engine goes idle: the weights may change
    before the next one, so nothing cached outlives it.)"""
    model = lively_model("qwen3")
    engine = PagedEngine(model, num_blocks=64, block_size=4)
    engine.add(PROMPTS[1], greedy(40))  # another episode, still running when the first turn ends
    (turn1,) = engine.add(PROMPTS[3], greedy(9))
    first = None
    while first is None:
        first = next((s for s in engine.step() if s.id == turn1 and s.finish_reason is not None), None)
    turn2 = [*PROMPTS[3], *first.response, 40, 41, 42]  # 11 + 9 + 3 tokens
    before = engine.session.counts.prefill_tokens
    (turn2_id,) = engine.add(turn2, greedy(5))
    engine.step()
    assert engine.pool.stats.hit_blocks == 4  # the first turn's full blocks whose positions were all written
    assert engine.session.counts.prefill_tokens - before == len(turn2) - 16
    (second,) = [s for s in _drain(engine) if s.id == turn2_id]
    assert second.response == hf_greedy(model, turn2, 5)
    all_back(engine)


def _drain(engine: PagedEngine) -> list:
    """Step until idle; the sequences that finished."""
    done = []
    while engine.has_work:
        done += [s for s in engine.step(max_tokens=None) if s.finish_reason is not None]
    return done


def test_catch_ups_and_admissions_never_take_more_seats_than_there_are() -> None:
    """After a weight refresh every running sequence needs a catch-up prefill at once, with new prompts
    waiting: a round seats only as many as ``max_num_seqs``, the rest on later rounds."""
    model = lively_model("qwen2")
    engine = PagedEngine(model, num_blocks=64, block_size=4, max_num_seqs=4)
    for p in PROMPTS:
        engine.add(p, greedy(8, n=2))
    engine.step()
    engine.pause()
    engine.resume()  # both running pairs must be prefilled again; two more pairs wait for seats
    while engine.has_work:
        engine.step()
        assert engine.session is None or engine.session.seats.num_used <= 4
    all_back(engine)


def test_a_next_turn_after_a_sample_ended_early_continues_exactly() -> None:
    """A sample that ends before the round's last decode step rides along until the sync, feeding its last
    token at its last fed position again: that position's block must not be found by the next turn."""
    model = lively_model("qwen2")
    prompt, other = [5, 6], [30, 31, 32]
    free = PagedEngine(model, num_blocks=64, block_size=4).generate([prompt], greedy(12))[0][0].token_ids
    stop = free[2]  # 2 + 3 - 1 = 4: the block of position 3 is full when the sample ends
    assert stop not in free[:2]
    params = greedy(30, eos_token_ids=[stop])
    long = PagedEngine(model, num_blocks=64, block_size=4).generate([other], params)[0][0]
    assert long.finish_reason == "length"  # it keeps the session (and its prefix cache) open
    engine = PagedEngine(model, num_blocks=64, block_size=4, sync_interval=16)
    (first,) = engine.add(prompt, params)
    engine.add(other, params)
    ended = None
    while ended is None:
        ended = next((s for s in engine.step(max_tokens=None) if s.id == first and s.finish_reason), None)
    assert ended.response == free[:3] and ended.finish_reason == "eos"
    turn = prompt + ended.response + [40, 41]
    (second,) = engine.add(turn, greedy(6, eos_token_ids=[stop]))
    got = None
    while got is None:
        got = next((s for s in engine.step(max_tokens=None) if s.id == second and s.finish_reason), None)
    want = PagedEngine(model, num_blocks=64, block_size=4).generate([turn], greedy(6, eos_token_ids=[stop]))[
        0
    ][0]
    assert got.response == want.token_ids
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    while engine.has_work:
        engine.step()
