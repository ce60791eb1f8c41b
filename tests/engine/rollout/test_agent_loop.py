"""The multi-turn agent loop on the paged engine: an episode is what the policy sampled and the environment's
tokens in order, the mask is zero exactly on the environment's tokens, every sampled token's log-prob is the
trainer's recomputation over the whole episode (float32, 1e-5), and a slow answer holds only its episode."""

from __future__ import annotations

import math
import threading
import time

import pytest
import torch
from test_engine import PROMPTS, lively_model
from test_partial_rollout import token_logprobs

from hybridflow.engine.rollout.agent_loop import AgentLoop, Episode, LoopLimits, ToolTurn
from hybridflow.engine.rollout.engine import PagedEngine
from hybridflow.engine.rollout.sampling import SamplingParams
from hybridflow.models.tiny import build_tiny_model

END = [13, 35]  # stop tokens (an assistant turn ends with one of them)


class EchoTools:
    """An environment: a turn that ends with token 13 "calls a tool", answered with a header (60), the turn's
    three tokens before its last, and 61; a turn ending with 35 ends the episode. ``slow_s``: answers of the
    first prompt's episodes (or, ``all_slow``, of every episode) take that long; ``most_at_once`` counts the
    answers that were being computed at the same moment."""

    def __init__(self, slow_s: float = 0.0, all_slow: bool = False) -> None:
        self.slow_s, self.all_slow, self.calls = slow_s, all_slow, []
        self.lock = threading.Lock()
        self.in_flight = self.most_at_once = 0
        self.others_during_slow = 0

    def respond(self, episode: Episode, turn: list[int]) -> ToolTurn | None:
        if turn[-1] != 13:
            return None
        slow = self.slow_s and (self.all_slow or episode.prompt == PROMPTS[0])
        with self.lock:
            self.in_flight += 1
            self.most_at_once = max(self.most_at_once, self.in_flight)
            self.calls.append(list(turn))
        if slow:
            before = len(self.calls)
            time.sleep(self.slow_s)
            with self.lock:
                self.others_during_slow += len(self.calls) - before
        with self.lock:
            self.in_flight -= 1
        return ToolTurn([60, *turn[-4:-1], 61], calls=1)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama", "mixtral"])
def test_episodes_interleave_sampled_turns_and_tool_tokens_with_exact_logprobs(arch: str) -> None:
    # A tiny model at its own initialisation (the lively ones' large logits leave float32 rounding of ~1e-5
    # between a chunked prefill and one whole-episode forward); its turns end anywhere, on 13 or 35 alike.
    model = build_tiny_model(arch, vocab_size=64, hidden_size=32, num_hidden_layers=2, seed=1).eval()
    engine = PagedEngine(model, num_blocks=128, block_size=4, sync_interval=2)
    env = EchoTools()
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=40, eos_token_ids=END, seed=3)
    episodes = AgentLoop(engine, env, LoopLimits(max_assistant_turns=4, max_response_length=40)).run(
        PROMPTS, params
    )
    assert not engine.has_work and engine.pool.num_free == len(engine.pool.blocks)
    flat = [e for g in episodes for e in g]
    assert len(flat) == 8 and sum(e.tool_calls for e in flat) == len(env.calls) > 0
    assert max(e.turns for e in flat) > 1
    for e in flat:
        assert len(e.tokens) == len(e.mask) == len(e.logprobs) <= 40
        # the appended runs are exactly the environment's answers, in order, with mask 0 and no log-prob
        tool_runs, i = [], 0
        while i < len(e.mask):
            if e.mask[i] == 0:
                j = i
                while j < len(e.mask) and e.mask[j] == 0:
                    j += 1
                tool_runs.append(e.tokens[i:j])
                assert all(math.isnan(p) for p in e.logprobs[i:j])
                i = j
            else:
                i += 1
        assert all(run[0] == 60 and (len(run) == 5 or i == len(e.mask)) for run in tool_runs)
        assert len(tool_runs) == e.tool_calls or (
            e.finish_reason == "length" and len(tool_runs) <= e.tool_calls
        )
        want = token_logprobs(model, e.prompt, e.tokens)
        sampled = torch.tensor(e.mask, dtype=torch.bool)
        got = torch.tensor(e.logprobs)[sampled]
        assert (got - want[sampled]).abs().max() < 1e-5
        assert e.finish_reason in ("eos", "length")


def test_a_slow_tool_holds_only_its_own_episode() -> None:
    model = lively_model("qwen2")
    engine = PagedEngine(model, num_blocks=128, block_size=4, sync_interval=2)
    env = EchoTools(slow_s=0.5)  # the first prompt's episodes answer slowly
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=30, eos_token_ids=END, seed=3)
    episodes = AgentLoop(engine, env, LoopLimits(max_assistant_turns=3, max_response_length=30)).run(
        PROMPTS, params
    )
    assert sum(e.tool_calls for e in episodes[0]) > 0
    assert env.others_during_slow > 0  # other episodes decoded and called tools while it slept
    assert all(e.finish_reason is not None for g in episodes for e in g)


def test_tool_calls_of_different_episodes_run_at_once() -> None:
    model = lively_model("qwen2")
    engine = PagedEngine(model, num_blocks=128, block_size=4, sync_interval=2)
    env = EchoTools(slow_s=0.2, all_slow=True)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=30, eos_token_ids=END, seed=3)
    AgentLoop(engine, env, LoopLimits(max_assistant_turns=2, max_response_length=30)).run(PROMPTS, params)
    assert len(env.calls) >= 4 and env.most_at_once >= 2


def agent_loop_on_ranks(rank: int, world: int) -> dict:
    """Episodes on a tensor-parallel rollout group (tp = world) against one process: greedy turns, the slow
    answers of rank 1 taken when rank 0 has them (``agree``), the same episodes everywhere."""
    import copy

    import torch.distributed as dist

    from hybridflow.engine.hybrid.switch import RolloutShard
    from hybridflow.engine.parallel.fsdp import shard_model
    from hybridflow.engine.parallel.layout import follow_rollout_shards
    from hybridflow.engine.parallel.rollout_group import RolloutGroup
    from hybridflow.engine.parallel.view import GenerateView
    from hybridflow.engine.rollout.tp import RolloutTP
    from hybridflow.workers.agent_env import group_agree

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    view = GenerateView(world, world)
    group = RolloutGroup(view, rank)
    lm = lively_model("qwen2")
    full = copy.deepcopy(lm)
    follow_rollout_shards(lm, world, world)
    shard_model(lm, list(lm.model.layers), torch.device("cpu"))
    shard = RolloutShard(lm, view, rank, torch.float32, torch.device("cpu"), bucket_bytes=4096)
    shard.sync(lm)
    engine = PagedEngine(shard.module, num_blocks=64, block_size=4, dtype=torch.float32, sync_interval=2,
                         tp=RolloutTP(group.group, 64))  # fmt: skip
    params = SamplingParams(n=2, temperature=0.0, do_sample=False, max_new_tokens=24, eos_token_ids=END)
    limits = LoopLimits(max_assistant_turns=3, max_response_length=24)
    # rank 1's answers are slow: without agreement the ranks would add continuations at different steps
    env = EchoTools(slow_s=0.05 * rank, all_slow=True)
    got = AgentLoop(engine, env, limits, agree=group_agree(group)).run(PROMPTS, params)
    want = AgentLoop(PagedEngine(full, num_blocks=64, block_size=4), EchoTools(), limits).run(PROMPTS, params)
    flat = [(e.tokens, e.mask) for g in got for e in g]
    return {
        "equal": flat == [(e.tokens, e.mask) for g in want for e in g],
        "calls": sum(e.tool_calls for g in got for e in g),
        "gap": max(
            abs(a - b)
            for g, h in zip(got, want)
            for x, y in zip(g, h)
            for a, b, m in zip(x.logprobs, y.logprobs, x.mask)
            if m
        ),
    }


def test_a_tensor_parallel_group_runs_the_same_episodes_as_one_process() -> None:
    from support.dist_util import run_world_kept

    results = run_world_kept(2, agent_loop_on_ranks, 2)
    for rank, r in enumerate(results):
        assert r["equal"] and r["gap"] < 1e-5 and r["calls"] > 0, (rank, r)
