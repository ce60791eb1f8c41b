"""The model shapes ``hybridflow plan --model-shape`` knows: the Hugging Face config fields that size memory."""

from __future__ import annotations

from typing import Any

# Model shapes ``hybridflow plan --model-shape`` knows (the HF config fields that size the memory).
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
    "llama-3-8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False),
    "llama-3-70b": dict(model_type="llama", hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, intermediate_size=28672, vocab_size=128256, tie_word_embeddings=False),
    # mixtures of experts: Mixtral's 32 heads / 8 KV heads split over tp = 8 (the write-ups' train tp=8, ep=2)
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2,
                         vocab_size=32000, tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, intermediate_size=6144, vocab_size=151936,
                          tie_word_embeddings=False),
}  # fmt: skip


def shape_config(name: str) -> Any:
    """The HF config of a known model shape (``MODEL_SHAPES``)."""
    from transformers import AutoConfig

    if name not in MODEL_SHAPES:
        from hybridflow.utils.errors import UserError

        raise UserError(f"unknown model shape {name!r}; use one of {', '.join(MODEL_SHAPES)}")
    kwargs = dict(MODEL_SHAPES[name])
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
