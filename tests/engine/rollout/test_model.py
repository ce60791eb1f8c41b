"""The Llama-family runner and its paged KV cache against HF forward / generate on tiny float32 models."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from support.dist_util import run_world_kept as run_world
from support.row_cache import RowCache
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from hybridflow.engine.rollout.engine import PagedEngine
from hybridflow.engine.rollout.model import LlamaRunner
from hybridflow.engine.rollout.sampling import SamplingParams
from hybridflow.engine.rollout.support import check_supported, supports
from hybridflow.models import build_tiny_model
from hybridflow.utils.errors import UserError

VOCAB = 96
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
HEADS = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
NO_SPECIAL = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _build(model_cls: type, config: object) -> torch.nn.Module:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        return model_cls(config).eval()


@functools.cache
def tiny(arch: str) -> torch.nn.Module:
    """Shared tiny float32 models; tests that change weights deep-copy them first."""
    if arch in ("qwen2", "llama"):
        return build_tiny_model(arch, seed=1, **SMALL, **HEADS)
    if arch == "qwen3":  # q/k norm, head_dim (16) decoupled from hidden / heads (8), untied
        return _build(Qwen3ForCausalLM, Qwen3Config(**SMALL, **HEADS, **NO_SPECIAL, head_dim=16))
    if arch == "llama3_rope":  # llama3 rope scaling with an original context short enough to matter
        rope = dict(
            rope_type="llama3",
            factor=4.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=16,
            rope_theta=500000.0,
        )
        config = LlamaConfig(
            **SMALL, **HEADS, **NO_SPECIAL, rope_parameters=rope, attention_bias=True, mlp_bias=True
        )
        return _build(LlamaForCausalLM, config)
    if arch == "qwen2_yarn":  # yarn: attention_scaling != 1 multiplies cos/sin
        rope = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, rope_theta=10000.0)
        return _build(Qwen2ForCausalLM, Qwen2Config(**SMALL, **HEADS, **NO_SPECIAL, rope_parameters=rope))
    if arch == "mistral":
        return _build(MistralForCausalLM, MistralConfig(**SMALL, **HEADS, **NO_SPECIAL, sliding_window=None))
    raise AssertionError(arch)


ARCHS = ["qwen2", "llama", "qwen3", "llama3_rope", "qwen2_yarn", "mistral"]


def prompts(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=gen) for n in lengths]


def right_pad(seqs: list[torch.Tensor], width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad with a token that is not 0, so any leak of the padding into valid rows shows."""
    width = width or max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), 5, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
    return ids, torch.tensor([len(s) for s in seqs])


@torch.no_grad()
def hf_last_logits(model: torch.nn.Module, seq: torch.Tensor) -> torch.Tensor:
    return model(seq[None]).logits[0, -1].float()


def longs(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


# ---- prefill / decode against HF ------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_hf_forward(arch: str) -> None:
    model = tiny(arch)
    rows = RowCache(LlamaRunner(model), rows=4, max_len=32)
    seqs = prompts([9, 5, 1, 20])
    ids, lengths = right_pad(seqs)
    order = [2, 0, 3, 1]  # the call's rows go to other rows of the cache
    logits = rows.prefill(ids, lengths, order)
    assert logits.dtype == torch.float32 and logits.shape == (4, VOCAB)
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(logits[i], hf_last_logits(model, seq), atol=1e-4, rtol=0)
    # Only valid positions were written: the rest of each row is still the zeros it was allocated with.
    for i, row in enumerate(order):
        n = int(lengths[i])
        (k, _), (_, v) = rows.kv(0, row), rows.kv(rows.runner.num_layers - 1, row)
        assert k[:n].abs().sum() > 0 and v[:n].abs().sum() > 0
        assert not k[n:].any() and not v[n:].any()


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama3_rope"])
def test_prefill_in_two_chunks_equals_one_chunk(arch: str) -> None:
    runner = LlamaRunner(tiny(arch))
    seqs = prompts([12, 9], seed=1)
    whole = RowCache(runner, 2, 24)
    ids, lengths = right_pad(seqs)
    one = whole.prefill(ids, lengths)

    chunked = RowCache(runner, 2, 24)
    # First chunks of 5 and 9 (the second prompt is complete after it), then the rest of the first prompt
    # together with nothing else; then both again in one mixed call: a continuation row and a fresh row.
    chunked.prefill(*right_pad([seqs[0][:5], seqs[1]]))
    rest = chunked.prefill(*right_pad([seqs[0][5:]]), [0], [5])
    torch.testing.assert_close(rest[0], one[0], atol=1e-5, rtol=0)
    for layer in range(runner.num_layers):
        for row, n in ((0, 12), (1, 9)):
            for got, want in zip(chunked.kv(layer, row), whole.kv(layer, row)):
                torch.testing.assert_close(got[:n], want[:n], atol=1e-5, rtol=0)

    mixed = RowCache(runner, 3, 24)
    mixed.prefill(*right_pad([seqs[0][:7]]), [2])
    both = mixed.prefill(*right_pad([seqs[0][7:], seqs[1]]), [2, 0], [7, 0])
    torch.testing.assert_close(both, one, atol=1e-5, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3", "llama3_rope"])  # q/k norms; biases on every projection
def test_compiled_prefill_equals_eager_and_settles_on_dynamic_shapes(arch: str) -> None:
    torch._dynamo.reset()
    graphs = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    eager = LlamaRunner(tiny(arch))
    compiled = LlamaRunner(tiny(arch))
    compiled.compile_prefill(backend=backend)
    for n, lengths in enumerate(([9, 5, 1, 20], [3, 7], [11, 2, 6])):
        ids, lens = right_pad(prompts(lengths, seed=n))
        caches = [RowCache(r, len(lengths), 24) for r in (eager, compiled)]
        want = caches[0].prefill(ids, lens)
        torch.testing.assert_close(caches[1].prefill(ids, lens), want, atol=1e-5, rtol=0)
        torch.testing.assert_close(caches[1].cache.storage, caches[0].cache.storage, atol=1e-5, rtol=0)
        # One graph for all layers: static for the first shape, dynamic for the second, reused by the third.
        assert len(graphs) == (1 if n == 0 else 2)
    # Chunked prefill: the continuation attends to its row's cached prefix (the other graph variant).
    seqs = prompts([13, 4], seed=7)
    caches = [RowCache(r, 3, 24) for r in (eager, compiled)]
    outs = []
    for cache in caches:
        cache.prefill(*right_pad([seqs[0][:8], seqs[1]]), [2, 0])
        outs.append(cache.prefill(*right_pad([seqs[0][8:]]), [2], [8]))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(caches[1].cache.storage, caches[0].cache.storage, atol=1e-5, rtol=0)


def test_compiled_sdpa_decode_equals_eager_and_writes_the_callers_cache() -> None:
    # aot_eager functionalizes the graph as inductor does: the cache write must reach the cache tensor the
    # caller holds, and the step must trace whole (fullgraph).
    runner = LlamaRunner(tiny("qwen2"))
    ids, lens = right_pad(prompts([6, 3], seed=4))
    caches = [RowCache(runner, 2, 16) for _ in range(2)]
    for cache in caches:
        cache.prefill(ids, lens)
    tables = caches[0].tables.clone()  # the same layout in both caches
    compiled = torch.compile(runner.decode_paged, fullgraph=True, backend="aot_eager")
    token = longs(3, 4)
    want = runner.decode_paged(token, lens, caches[0].cache, tables)
    torch.testing.assert_close(compiled(token, lens, caches[1].cache, tables), want, atol=1e-6, rtol=0)
    torch.testing.assert_close(caches[1].cache.storage, caches[0].cache.storage, atol=1e-6, rtol=0)
    k, _ = caches[1].kv(0, 1)
    assert k[3].abs().sum() > 0  # the step's k/v landed at position 3 of row 1


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3", "llama3_rope"])
def test_greedy_prefill_and_batched_decode_reproduce_hf_generate(arch: str) -> None:
    model = tiny(arch)
    steps = 10
    seqs = prompts([7, 3, 11], seed=2)
    expected = []
    for seq in seqs:
        out = model.generate(
            seq[None], do_sample=False, max_new_tokens=steps, min_new_tokens=steps, pad_token_id=0
        )
        assert out.shape[1] == len(seq) + steps
        expected.append(out[0, len(seq) :].tolist())

    rows = RowCache(LlamaRunner(model), 3, 32)
    ids, lengths = right_pad(seqs)
    logits = rows.prefill(ids, lengths)
    positions = lengths.clone()  # each row continues at its own position
    got = []
    for _ in range(steps):
        token = logits.argmax(-1)
        got.append(token)
        logits = rows.decode(token, positions)
        positions += 1
    assert torch.stack(got, 1).tolist() == expected


# ---- weights: zero copy, cast buffers, refresh ----------------------------------------------------------


def _param_ptrs(model: torch.nn.Module) -> set[int]:
    return {p.data_ptr() for p in model.parameters()}


def test_same_dtype_binds_the_parameters_themselves() -> None:
    model = copy.deepcopy(tiny("qwen2"))
    runner = LlamaRunner(model)
    assert {t.data_ptr() for t in runner.weight_tensors()} == _param_ptrs(model)
    assert runner.lm_head is runner.embed  # tied embeddings are bound once
    assert len(runner.layers[0].qkv) == 3  # no fused copy on the zero-copy path
    ids = prompts([6], seed=5)[0][None]
    before = RowCache(runner, 1, 8).prefill(ids, longs(6))
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(2.0)
    after = RowCache(runner, 1, 8).prefill(ids, longs(6))
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after[0], hf_last_logits(model, ids[0]), atol=1e-4, rtol=0)


def test_bf16_cast_buffers_are_refreshed_in_place() -> None:
    model = copy.deepcopy(tiny("llama3_rope"))  # untied, with q/k/v and MLP biases
    runner = LlamaRunner(model, dtype=torch.bfloat16)
    tensors = runner.weight_tensors()
    ptrs = [t.data_ptr() for t in tensors]
    assert all(t.dtype == torch.bfloat16 for t in tensors)
    assert not set(ptrs) & _param_ptrs(model)
    assert len(runner.layers[0].qkv) == 1 and len(runner.layers[0].qkv_bias) == 1  # fused into the cast

    ids = prompts([10], seed=6)[0][None]
    cache = RowCache(runner, 1, 16)
    assert cache.cache.storage.dtype == torch.bfloat16

    def run() -> torch.Tensor:
        return cache.prefill(ids, longs(10))

    before = run()
    ref_bf16 = hf_last_logits(copy.deepcopy(model).to(torch.bfloat16), ids[0])
    assert (before[0] - ref_bf16).abs().max() < 0.05  # same bf16 math, up to rounding order

    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.bias.add_(0.5)
        model.lm_head.weight.mul_(-1.0)
    torch.testing.assert_close(run(), before, atol=0, rtol=0)  # buffers are copies until refreshed
    assert runner.refresh() is False
    assert [t.data_ptr() for t in runner.weight_tensors()] == ptrs
    refreshed = run()
    fresh = RowCache(LlamaRunner(model, dtype=torch.bfloat16), 1, 16).prefill(ids, longs(10))
    torch.testing.assert_close(refreshed, fresh, atol=0, rtol=0)
    assert not torch.allclose(refreshed, before, atol=1e-2)


def test_refresh_rebinds_when_parameter_storage_moves() -> None:
    model = copy.deepcopy(tiny("llama"))
    runner = LlamaRunner(model)
    weight = model.model.layers[0].mlp.up_proj.weight
    weight.data = weight.data * 3.0  # new storage, as an offload/reload round trip would give
    assert runner.refresh() is True
    ids = prompts([5], seed=7)[0][None]
    got = RowCache(runner, 1, 8).prefill(ids, longs(5))
    torch.testing.assert_close(got[0], hf_last_logits(model, ids[0]), atol=1e-4, rtol=0)


def _fsdp_world(rank: int) -> dict[str, float | bool]:
    from torch.distributed.tensor import DTensor

    from hybridflow.engine.parallel.fsdp import shard_model

    torch.manual_seed(0)
    model = build_tiny_model("qwen2", seed=1, **SMALL, **HEADS)
    ids = torch.randint(1, VOCAB, (2, 9))
    with torch.no_grad():
        ref = model(ids).logits[:, -1]
    shard_model(model, list(model.model.layers), torch.device("cpu"))
    is_dtensor = isinstance(model.model.layers[0].self_attn.q_proj.weight, DTensor)
    same, cast = LlamaRunner(model), LlamaRunner(model, dtype=torch.bfloat16)

    def last(runner: LlamaRunner) -> torch.Tensor:
        return RowCache(runner, 2, 16).prefill(ids, longs(9, 9))

    err_before = float((last(same) - ref).abs().max())
    # One training step through FSDP2 changes the sharded parameters in place.
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model(ids).logits.float().pow(2).mean().backward()
    opt.step()
    with torch.no_grad():
        ref_after = model(ids).logits[:, -1]
    same.refresh()
    cast.refresh()
    return {
        "is_dtensor": is_dtensor,
        "err_before": err_before,
        "err_after": float((last(same) - ref_after).abs().max()),
        "moved": float((ref_after - ref).abs().max()),
        "cast_vs_fresh": float((last(cast) - last(LlamaRunner(model, dtype=torch.bfloat16))).abs().max()),
    }


@pytest.mark.slow
def test_runner_reads_fsdp2_parameters_at_world_size_1() -> None:
    (res,) = run_world(1, _fsdp_world)
    assert res["is_dtensor"]
    assert res["err_before"] < 1e-4
    assert res["moved"] > 1e-3  # the step really changed the model
    assert res["err_after"] < 1e-4
    assert res["cast_vs_fresh"] == 0.0


# ---- what the fast path refuses -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config,match",
    [
        (GPT2Config(), "'gpt2' is not a Llama-style decoder"),
        (Phi3Config(), "'phi3' has no entry in models/family.py"),  # a family without an entry
        (Qwen2Config(use_sliding_window=True), "sliding-window"),
        (Qwen3Config(use_sliding_window=True), "sliding-window"),
        (MistralConfig(sliding_window=64), "sliding window of 64"),
        (LlamaConfig(hidden_act="gelu"), "hidden_act"),
        (LlamaConfig(rope_parameters=dict(rope_type="dynamic", factor=2.0, rope_theta=1e4)), "rope type"),
    ],
)
def test_unsupported_configs_raise_a_clear_error(config: object, match: str) -> None:
    with pytest.raises(ValueError, match=match) as err:
        check_supported(config)
    assert "rollout.engine=hf" in str(err.value)


def test_supports_and_the_mistral_window_bound() -> None:
    assert supports(tiny("qwen2")) and supports(tiny("qwen3"))
    assert not supports(tiny("qwen2").model)  # the base model has no lm_head
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=VOCAB, n_positions=32))
    assert not supports(gpt2)
    with pytest.raises(ValueError, match="not a Llama-style decoder"):
        LlamaRunner(gpt2)

    windowed = _build(MistralForCausalLM, MistralConfig(**SMALL, **HEADS, **NO_SPECIAL, sliding_window=16))
    check_supported(windowed.config, max_len=16)  # no sequence can outgrow the window: exact
    assert not supports(windowed)
    with pytest.raises(ValueError, match="sliding window of 16"):
        LlamaRunner(windowed)
    with pytest.raises(ValueError, match="sliding window of 16"):
        PagedEngine(windowed)
    engine = PagedEngine(windowed, max_model_len=16, block_size=4)  # the engine keeps every sequence in it
    with pytest.raises(UserError, match="within the context of 16 tokens"):
        engine.add(list(range(1, 17)), SamplingParams(max_new_tokens=4))
    params = SamplingParams(max_new_tokens=20, temperature=0.0, do_sample=False, ignore_eos=True)
    ((out,),) = engine.generate([list(range(1, 11))], params)
    assert len(out.token_ids) == 6 and out.finish_reason == "length"  # 10 + 6 = the window


# ---- GPU: CUDA-graph capture of decode (run with ``pytest -m gpu``) ---------------------------------------


@pytest.mark.gpu
def test_decode_replays_from_a_cuda_graph_without_host_syncs() -> None:
    model = copy.deepcopy(tiny("qwen3")).cuda()
    runner = LlamaRunner(model, dtype=torch.bfloat16)
    rows = RowCache(runner, 4, 32)
    ids, lengths = right_pad(prompts([7, 3, 11, 5], seed=8))
    rows.prefill(ids.cuda(), lengths)
    tokens, positions, tables = longs(1, 2, 3, 4).cuda(), lengths.cuda(), rows.tables.cuda()
    cache, eager_cache = rows.cache, copy.deepcopy(rows.cache)
    torch.cuda.set_sync_debug_mode("error")  # any host sync inside decode raises
    try:
        expected = runner.decode_paged(tokens, positions, eager_cache, tables)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as capture requires
        runner.decode_paged(tokens, positions, copy.deepcopy(cache), tables)
    torch.cuda.current_stream().wait_stream(stream)
    static_tokens, static_pos = tokens.clone(), positions.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_logits = runner.decode_paged(static_tokens, static_pos, cache, tables)
    # Capture only records: the cache is written at replay. Replay with the same inputs gives eager's result.
    graph.replay()
    torch.testing.assert_close(static_logits, expected, atol=0, rtol=0)
    torch.testing.assert_close(cache.storage, eager_cache.storage, atol=0, rtol=0)
