"""The rollout engine (``PagedEngine``) on CPU end to end: greedy tokens equal to HF ``generate``, a row's
tokens independent of the rest of the batch (seats, shared prompt blocks, chunked prefill, preemption on a
small pool), log-probs equal to the trainer's recomputation, finish reasons and limits, tensor-parallel
shards, the cast weights and the cache between calls, the memory figures. The step API: test_engine_steps.py."""

from __future__ import annotations

import os

import pytest
import torch
from support.batches import grouped_batch
from support.dist_util import run_world_kept as run_world

from hybridflow.engine.rollout.blocks import KSplits
from hybridflow.engine.rollout.engine import PagedEngine
from hybridflow.engine.rollout.factory import make_rollout
from hybridflow.engine.rollout.hf_fallback import HFRollout
from hybridflow.engine.rollout.sampling import SamplingParams
from hybridflow.models import build_tiny_model
from hybridflow.utils.errors import UserError

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 3, 14], [4], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]]


def lively_model(arch: str = "qwen2", seed: int = 1) -> torch.nn.Module:
    """A tiny random model with large weights, so greedy outputs vary instead of repeating one token."""
    model = build_tiny_model(arch, vocab_size=64, hidden_size=32, num_hidden_layers=2, seed=seed).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def greedy(max_new: int = 8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, do_sample=False, max_new_tokens=max_new, **kw)


def hf_greedy_left_padded(model: torch.nn.Module, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    device = next(model.parameters()).device
    out = model.generate(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[:, width:].tolist()


def all_back(engine: PagedEngine) -> None:
    assert not engine.has_work and engine.pool.num_free == len(engine.pool.blocks)


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new: int) -> list[int]:
    """HF ``generate``'s greedy continuation of one prompt (no EOS)."""
    return hf_greedy_left_padded(model, [prompt], max_new)[0]


def until_stop(tokens: list[int], stops: list[int]) -> tuple[list[int], str]:
    """A greedy run's tokens cut after the first of ``stops``, and the finish reason that gives."""
    end = next((k + 1 for k, t in enumerate(tokens) if t in stops), None)
    return (tokens, "length") if end is None else (tokens[:end], "eos")


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_greedy_matches_hf_generate_on_a_left_padded_batch(arch: str) -> None:
    model = lively_model(arch)
    expected = hf_greedy_left_padded(model, PROMPTS, 8)
    out = PagedEngine(model).generate(PROMPTS, greedy(8))
    assert [o[0].token_ids for o in out] == expected
    assert len({tuple(t) for t in expected}) == len(PROMPTS)  # the model is lively: outputs differ
    assert all(o[0].finish_reason == "length" for o in out)


def test_continuous_batching_and_prefix_sharing_change_nothing() -> None:
    model = lively_model()
    alone = [PagedEngine(model, block_size=4).generate([p], greedy(10))[0][0].token_ids for p in PROMPTS]
    # 5 seats for 4 prompts x 2 samples (seats handed on as sequences finish), shared prompt blocks, chunked
    # prefill (budget 4), and a pool of 12 blocks of 4 positions for up to 4 x 21 positions: preemption.
    kw = dict(max_num_seqs=5, max_num_batched_tokens=4, sync_interval=2, block_size=4, num_blocks=12)
    engine = PagedEngine(model, **kw)
    together = engine.generate(PROMPTS, greedy(10, n=2, eos_token_ids=[7, 19]))
    assert engine.last_stats.preemptions > 0 and engine.pool.stats.forked_blocks > 0
    for p, samples in enumerate(together):
        for s in samples:
            stop = next((k for k, t in enumerate(alone[p]) if t in (7, 19)), None)
            want = alone[p] if stop is None else alone[p][: stop + 1]
            assert s.token_ids == want
            assert s.finish_reason == ("length" if stop is None else "eos")


def test_finish_reasons_stop_tokens_ignore_eos_and_seeds() -> None:
    model = lively_model()
    engine = PagedEngine(model, block_size=4)
    base = engine.generate(PROMPTS, greedy(8))
    first = base[1][0].token_ids[2]
    out = engine.generate(PROMPTS, greedy(8, stop_token_ids=[first]))
    assert out[1][0].token_ids == base[1][0].token_ids[: base[1][0].token_ids.index(first) + 1]
    assert out[1][0].finish_reason == "stop"
    ignored = engine.generate(PROMPTS, greedy(8, eos_token_ids=[first], ignore_eos=True))
    assert [o[0].token_ids for o in ignored] == [o[0].token_ids for o in base]
    sampled = SamplingParams(n=3, max_new_tokens=6, temperature=1.0, seed=11)
    a = PagedEngine(model, max_num_seqs=5, block_size=4).generate(PROMPTS, sampled)
    b = PagedEngine(model, max_num_seqs=5, block_size=4).generate(PROMPTS, sampled)
    assert [[s.token_ids for s in g] for g in a] == [[s.token_ids for s in g] for g in b]
    assert len({tuple(s.token_ids) for g in a for s in g}) > 6  # samples differ from each other


def test_bad_inputs_get_clear_errors() -> None:
    engine = PagedEngine(lively_model())
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1, 2], []], greedy())
    with pytest.raises(UserError, match="leaves no room to generate"):
        PagedEngine(lively_model(), max_model_len=8).generate([list(range(1, 9))], greedy())
    with pytest.raises(ValueError, match="n"):
        SamplingParams(n=0)
    with pytest.raises(ValueError, match="unknown rollout engine"):
        make_rollout(lively_model(), "vllm")


def test_hf_engine_gives_the_same_greedy_tokens() -> None:
    model = lively_model()
    native = PagedEngine(model, block_size=4).generate(PROMPTS, greedy(6, n=2))
    hf = make_rollout(model, "hf").generate(PROMPTS, greedy(6, n=2))
    assert isinstance(make_rollout(model, "hf"), HFRollout)
    assert [[s.token_ids for s in g] for g in native] == [[s.token_ids for s in g] for g in hf]


def rollout_then_score(rank: int, temperature: float) -> float:
    """Sample on the FSDP2-wrapped actor's own weights, then recompute log-probs with the training engine."""
    # The acceptance check is float32 on the CPU. On a GPU host the trainer would compute in bf16 (fsdp
    # param_dtype auto) against float32 generation; test_engine_gpu.py covers that pairing. This process
    # has not touched CUDA yet, so hiding the devices here keeps it on the CPU.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    from hybridflow.config.schema import ActorConfig
    from hybridflow.engine.roles.actor import ActorEngine

    actor = ActorEngine(lively_model(), ActorConfig(), use_remove_padding=True, trainable=False)
    rollout = PagedEngine(actor.module.lm, block_size=4)
    params = SamplingParams(n=2, max_new_tokens=6, temperature=temperature, seed=0, eos_token_ids=[9])
    outs = [s for g in rollout.generate(PROMPTS, params) for s in g]
    batch = grouped_batch(PROMPTS, [o.token_ids for o in outs], 6)  # each prompt's 2 samples in a row
    recomputed = actor.compute_log_prob(batch, temperature=temperature)["log_probs"]
    worst = 0.0
    for i, o in enumerate(outs):
        diff = (recomputed[i, : len(o.logprobs)] - torch.tensor(o.logprobs)).abs().max()
        worst = max(worst, float(diff))
    return worst


def test_sampled_logprobs_equal_the_trainers_recomputation() -> None:
    assert run_world(1, rollout_then_score, 0.7)[0] < 1e-5


def recording_backend() -> tuple[list, object]:
    """A fresh dynamo state and a torch.compile backend that records each graph it gets and runs it as is."""
    torch._dynamo.reset()
    graphs = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    return graphs, backend


def test_compiled_bookkeeping_equals_eager_and_is_reused_by_the_next_call() -> None:
    # The engine compiles DecodeState.record per bucket; each generate call makes a new DecodeState. The
    # graph must not guard on the object (a recompile would then run at graph capture).
    from hybridflow.engine.rollout.decode_loop import compiled_per_bucket
    from hybridflow.engine.rollout.state import DecodeState

    graphs, backend = recording_backend()
    record = compiled_per_bucket(DecodeState.record, num_buckets=12, backend=backend)
    for call in range(2):
        states = [DecodeState(4, 5, stop_ids=[3], eos_ids=[2], device=torch.device("cpu")) for _ in range(2)]
        for state in states:
            state.begin(torch.arange(4), torch.tensor([1, 2, 3, 4]), torch.tensor([5, 4, 3, 2]))
        for step, tokens in enumerate(([2, 3, 7, 8], [9, 9, 9, 9], [5, 6, 7, 8])):
            tokens, logprobs = torch.tensor(tokens), torch.full((4,), -0.5 - step - call)
            record(states[0], slice(0, 4), tokens, logprobs, True)
            states[1].record(slice(0, 4), tokens, logprobs, advance=True)
        for name in ("last_token", "position", "gen_len", "done", "reason", "tokens", "logprobs"):
            torch.testing.assert_close(getattr(states[0], name), getattr(states[1], name), msg=name)
        assert states[0].reason.tolist() == [1, 2, 3, 3]  # eos, stop, then length (limits 3 and 2)
    assert len(graphs) == 1


def test_compiled_decode_gets_a_graph_for_every_bucket_past_dynamos_default_limit() -> None:
    from hybridflow.engine.rollout.decode_loop import compiled_per_bucket

    graphs, backend = recording_backend()

    def step(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    decode = compiled_per_bucket(step, num_buckets=12, backend=backend)
    for b in range(1, 13):  # 12 static shapes: one graph each, none left to run uncompiled
        torch.testing.assert_close(decode(torch.ones(b)), torch.full((b,), 3.0))
    assert len(graphs) == 12
    assert torch._dynamo.config.recompile_limit == 8  # only raised around the calls


def test_compile_decode_builds_on_cpu_and_keeps_the_single_down_projection():
    """compile_decode is accepted off CUDA; the split down projection is for CUDA bf16/fp16 only."""
    engine = PagedEngine(lively_model(), compile_decode=True)
    assert engine.device.type == "cpu"
    assert engine.runner.k_splits == KSplits()


def test_generate_reports_prefill_and_decode_work() -> None:
    """last_stats counts each prompt's prefill once (samples share it) and one decode token per running
    sequence and step; with ignore_eos every sample runs to max_new, so the counts are exact."""
    engine = PagedEngine(lively_model(), max_num_seqs=4, block_size=4)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, ignore_eos=True, seed=0)
    out = engine.generate(PROMPTS, params)
    stats = engine.last_stats
    assert stats.prefill_tokens == sum(map(len, PROMPTS))
    generated = sum(len(s.token_ids) for group in out for s in group)
    assert generated == len(PROMPTS) * 2 * 6
    assert stats.decode_tokens == generated - len(PROMPTS) * 2  # the first token of each sample: prefill
    assert stats.slots == 4 and stats.decode_steps >= 5 * 2  # 8 samples in 4 seats: two groups at a time
    assert stats.prefill_s > 0 and stats.decode_s > 0
    assert stats.decode_tokens_per_s == pytest.approx(stats.decode_tokens / stats.decode_s)
    # With early stops, only the tokens kept count (not the steps a stopped sequence rode along).
    first = out[0][0].token_ids[1]  # a token that does get sampled: some samples stop on it
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=6, eos_token_ids=[first], seed=0)
    engine = PagedEngine(lively_model(), max_num_seqs=4, sync_interval=4, block_size=4)
    out = engine.generate(PROMPTS, params)
    lengths = [len(s.token_ids) for group in out for s in group]
    assert min(lengths) < 6  # the premise: some sample stopped early
    assert engine.last_stats.decode_tokens == sum(lengths) - len(lengths)


def cast_bytes(engine: PagedEngine) -> int:
    """Bytes the runner's cast weight buffers hold right now."""
    return sum(t.untyped_storage().nbytes() for t in engine.runner.weight_tensors())


def test_free_cache_engine_releases_the_cast_weights_until_the_next_call() -> None:
    model = lively_model(
        "llama"
    )  # untied; float32 masters, generation in bf16: every weight is a cast buffer
    engine = PagedEngine(model, dtype=torch.bfloat16, block_size=4)
    held = cast_bytes(engine)
    assert held > 0
    first = [[s.token_ids for s in g] for g in engine.generate(PROMPTS, greedy(6))]
    assert cast_bytes(engine) == 0  # nothing of the rollout's weights outlives the call
    again = [[s.token_ids for s in g] for g in engine.generate(PROMPTS, greedy(6))]
    assert again == first  # re-allocated and re-filled from the masters
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)  # a "training step" between two generations
    stepped = [[s.token_ids for s in g] for g in engine.generate(PROMPTS, greedy(6))]
    fresh = PagedEngine(model, dtype=torch.bfloat16, block_size=4).generate(PROMPTS, greedy(6))
    assert stepped == [[s.token_ids for s in g] for g in fresh]
    assert stepped != first


def test_without_free_cache_engine_the_cache_and_weights_stay_for_the_next_call() -> None:
    model = lively_model()
    engine = PagedEngine(model, dtype=torch.bfloat16, block_size=4, free_cache_engine=False)
    held = cast_bytes(engine)
    first = [[s.token_ids for s in g] for g in engine.generate(PROMPTS, greedy(6))]
    cache = engine.kept_cache
    assert cache is not None and cast_bytes(engine) == held
    again = [[s.token_ids for s in g] for g in engine.generate(PROMPTS, greedy(6))]
    assert engine.kept_cache is cache and again == first  # same pool: the kept cache is reused
    engine.generate(PROMPTS[:1], greedy(3))  # another pool size: a new cache
    assert engine.kept_cache is not None and engine.kept_cache is not cache


def test_the_memory_shortfall_is_what_a_pool_holding_every_sequence_at_once_needs(monkeypatch) -> None:
    """``optimizer_offload=auto`` frees memory until ``memory_shortfall`` is 0: the pool a session then sizes
    must hold every sequence at full length at once (with the seats' growth headroom, the scratch block and
    the decode step's workspace), and a byte less must not. A GPU of 2**30 bytes with 3 MiB in use, given to
    the engine's memory figures (no CUDA here); on CPU the pool is sized from the work, not from memory."""
    from hybridflow.engine.rollout import session as session_module
    from hybridflow.engine.rollout.session import Session

    engine = PagedEngine(lively_model(), block_size=4, max_num_seqs=6)
    cuda, total = torch.device("cuda"), 2**30
    monkeypatch.setattr(engine, "device", cuda)
    monkeypatch.setattr(engine.runner, "device", cuda)
    monkeypatch.setattr(session_module, "gpu_memory_limit", lambda _: total)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda _: 3 * 2**20)
    params = greedy(10, n=2)  # 8 sequences of up to 11 + 10 positions in 6 seats
    demand = 8 * -(-21 // 4) + 6  # every sequence at full length, and a block per seat
    sizing = Session.__new__(Session)  # the pool's sizing alone (a session would allocate on the GPU)
    sizing.runner, sizing.engine = engine.runner, engine
    engine.cfg.gpu_memory_utilization = 0.0
    everything = engine.memory_shortfall(PROMPTS, params)  # the pool and all the memory in use
    engine.cfg.gpu_memory_utilization = everything / total
    assert engine.memory_shortfall(PROMPTS, params) == 0
    assert sizing._blocks_for_memory(demand, 6) == demand
    engine.cfg.gpu_memory_utilization = (everything - 1) / total
    assert engine.memory_shortfall(PROMPTS, params) == 1
    assert sizing._blocks_for_memory(demand, 6) < demand


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
def test_greedy_generations_equal_hf(arch: str) -> None:
    model = lively_model(arch)
    free = hf_greedy_left_padded(model, PROMPTS, 10)
    stops = [free[0][3], free[2][6]]  # EOS ids that end samples at different places
    params = greedy(10, n=2, eos_token_ids=stops)
    engine = PagedEngine(model, num_blocks=64, block_size=4)
    got = engine.generate(PROMPTS, params)
    assert [[(s.token_ids, s.finish_reason) for s in g] for g in got] == [
        [until_stop(f, stops)] * 2 for f in free
    ]
    assert {s.finish_reason for g in got for s in g} == {"eos", "length"}
    all_back(engine)


def test_a_pool_too_small_for_the_batch_completes_through_preemption() -> None:
    model = lively_model("qwen2")
    params = greedy(12, n=2)
    want = hf_greedy_left_padded(model, PROMPTS, 12)
    engine = PagedEngine(model, num_blocks=12, block_size=4)  # 8 sequences of up to 23 tokens: ~40 blocks
    got = engine.generate(PROMPTS, params)
    assert [[s.token_ids for s in g] for g in got] == [[w, w] for w in want]
    assert engine.preemptions > 0 and engine.pool.stats.peak_used == 12
    stats = engine.stats()
    assert stats["rollout/kv_blocks_used"] == 1.0 and stats["rollout/preemptions"] == engine.preemptions
    assert 1 <= stats["rollout/concurrent_seqs_mean"] <= stats["rollout/concurrent_seqs_peak"] <= 8
    all_back(engine)


def test_sampled_log_probs_equal_hf_forward_at_the_temperature() -> None:
    model = lively_model("qwen3").float()
    engine = PagedEngine(model, num_blocks=64, block_size=4)
    params = SamplingParams(temperature=0.7, max_new_tokens=9, n=3, seed=11)
    out = engine.generate(PROMPTS, params)
    assert len({tuple(s.token_ids) for s in out[1]}) > 1  # the samples differ
    for prompt, samples in zip(PROMPTS, out):
        for s in samples:
            ids = torch.tensor([prompt + s.token_ids])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / 0.7  # (R, V)
            want = torch.log_softmax(logits, -1).gather(1, torch.tensor(s.token_ids)[:, None])[:, 0]
            torch.testing.assert_close(torch.tensor(s.logprobs), want, rtol=0, atol=1e-5)
    all_back(engine)


def paged_on_ranks(rank: int, world: int) -> dict:
    """Rollout tensor-parallel shards (the hybrid engine's generation view at tp = world) on the paged engine."""
    import copy

    import torch.distributed as dist

    from hybridflow.engine.hybrid.switch import RolloutShard
    from hybridflow.engine.parallel.fsdp import shard_model
    from hybridflow.engine.parallel.layout import follow_rollout_shards
    from hybridflow.engine.parallel.rollout_group import RolloutGroup
    from hybridflow.engine.parallel.view import GenerateView
    from hybridflow.engine.rollout.tp import RolloutTP

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    view = GenerateView(world, world)
    group = RolloutGroup(view, rank)
    out = {}
    for arch in ("qwen3", "llama"):
        lm = lively_model(arch)
        full = copy.deepcopy(lm)
        follow_rollout_shards(lm, world, world)
        shard_model(lm, list(lm.model.layers), torch.device("cpu"))
        shard = RolloutShard(lm, view, rank, torch.float32, torch.device("cpu"), bucket_bytes=4096)
        shard.sync(lm)
        engine = PagedEngine(
            shard.module, num_blocks=16, block_size=4, dtype=torch.float32, tp=RolloutTP(group.group, 64)
        )
        params = greedy(10, n=2)
        got = engine.generate(PROMPTS, params)
        want = PagedEngine(full, num_blocks=64, block_size=4).generate(PROMPTS, params)
        out[arch] = {
            "equal": [[s.token_ids for s in g] for g in got] == [[s.token_ids for s in g] for g in want],
            "gap": max(
                abs(u - v)
                for g, h in zip(got, want)
                for x, y in zip(g, h)
                for u, v in zip(x.logprobs, y.logprobs)
            ),
            "preempted": engine.preemptions,
            "back": engine.pool.num_free == 16,
        }
    return out


def test_tensor_parallel_shards_generate_what_one_process_does() -> None:
    """tp = 2 on gloo processes, a pool small enough to preempt: the tokens and log-probs of one process."""
    for rank, by_arch in enumerate(run_world(2, paged_on_ranks, 2)):
        for arch, r in by_arch.items():
            assert r["equal"] and r["gap"] < 1e-5 and r["back"], (rank, arch, r)
            assert r["preempted"] > 0, (rank, arch)


def test_prompts_that_cannot_run_are_refused_naming_the_limit() -> None:
    engine = PagedEngine(lively_model("qwen2"), num_blocks=8, block_size=4)
    limit = engine.runner.max_position_embeddings
    with pytest.raises(UserError, match=f"leaves no room to generate within the context of {limit} tokens"):
        engine.add([5] * limit, greedy(1))
    (sid,) = engine.add([5] * (limit - 3), greedy(10))  # the response stops at the context's end
    (seq,) = engine.waiting[0]
    assert seq.budget_end == limit
    engine.abort([sid])
    with pytest.raises(ValueError, match="at least one token"):
        engine.add([], greedy(1))
    with pytest.raises(ValueError, match="n=3 samples cannot run at once with max_num_seqs=2"):
        PagedEngine(lively_model("qwen2"), num_blocks=8, block_size=4, max_num_seqs=2).add(
            [5], greedy(1, n=3)
        )
    with pytest.raises(ValueError, match="cannot hold the next sequence"):
        engine.generate([[5] * 40], greedy(2))  # 40 tokens: 10 blocks, the pool has 8
    engine.abort([s.id for g in engine.waiting for s in g])
    all_back(engine)


def test_per_sample_lengths_end_each_sample_where_asked() -> None:
    """``generate(lengths=)`` (the long-tail benchmark's drawn lengths): each sample stops at its own limit,
    with the tokens an unbounded run gives up to there."""
    model = lively_model("qwen2")
    lengths = [[3, 7], [1, 9], [5, 5], [8, 2]]  # ties within a prompt and samples that differ
    full = hf_greedy_left_padded(model, PROMPTS, 9)
    engine = PagedEngine(model, block_size=4)
    got = engine.generate(PROMPTS, greedy(9, n=2), lengths=lengths)
    assert [[len(s.token_ids) for s in g] for g in got] == lengths
    assert [[s.token_ids for s in g] for g in got] == [[f[:n] for n in row] for f, row in zip(full, lengths)]
    with pytest.raises(ValueError, match="lengths must give each of the 4 prompts' 2 samples a limit"):
        engine.generate(PROMPTS, greedy(9, n=2), lengths=[[3, 10]] * 4)
    all_back(engine)


def test_the_stats_name_the_trainers_metrics() -> None:
    engine = PagedEngine(lively_model("qwen2"), block_size=4)
    engine.generate(PROMPTS[:2] * 2, greedy(5, n=2))  # the same prompts twice: their full blocks are found
    stats = engine.stats()
    assert stats["rollout/prefix_cache_hit_rate"] > 0 and stats["rollout/preemptions"] == 0
    assert 0 < stats["rollout/kv_blocks_used"] < 1 and stats["rollout/concurrent_seqs_peak"] == 8
    last = engine.last_stats
    assert last.slots == 8 and last.decode_tokens == 8 * 4 and last.prefill_tokens > 0
