"""The planner's KV-cache bytes with ``rollout.kv_cache_dtype=fp8``: one byte an element, half of bf16's, so the
generate phase's cache estimate halves (what the engine's pool gets: twice the blocks in the same memory)."""

from __future__ import annotations

from transformers import Qwen2Config

from hybridflow.config import load_config
from hybridflow.plan.memory import _kv_bytes, estimate_phases, kv_bytes_per_token
from hybridflow.plan.search import meta_model
from hybridflow.trainer.oom import run_layout

# The Qwen2.5-0.5B shape: 24 layers, 2 KV heads of 64.
SHAPE = Qwen2Config(
    vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
    num_key_value_heads=2, max_position_embeddings=4096,
)  # fmt: skip


def test_an_fp8_kv_cache_halves_the_planned_cache_bytes() -> None:
    base = ["data.max_prompt_length=512", "data.max_response_length=1024", "trainer.device=cpu"]
    bf16, fp8 = load_config(None, base), load_config(None, [*base, "rollout.kv_cache_dtype=fp8"])
    layout = run_layout(bf16)
    assert kv_bytes_per_token(bf16, SHAPE, layout) == 24 * 2 * 2 * 64 * 2  # layers, K and V, heads, dim, bf16
    assert kv_bytes_per_token(fp8, SHAPE, layout) * 2 == kv_bytes_per_token(bf16, SHAPE, layout)
    model = meta_model(SHAPE)
    gen_bf16 = estimate_phases(bf16, SHAPE, model, layout)["generate"]
    gen_fp8 = estimate_phases(fp8, SHAPE, model, layout)["generate"]
    cache_bf16 = _kv_bytes(bf16, SHAPE, layout)
    assert gen_bf16 - gen_fp8 > 0.4 * cache_bf16  # the cache part halves (the logits rows stay)
