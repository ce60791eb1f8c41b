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
    # DeepSeek-V3 (671B, 37B active): 61 layers, the first 3 dense (intermediate 18432), then 256 routed experts
    # of intermediate 2048 (8 per token) and 1 shared expert of the same size; vocabulary 129280, untied head.
    # Its multi-head latent attention (MLA: q through a rank-1536 bottleneck, k/v through a rank-512 latent
    # with 64 rotary dims) has no shard rule in hybridflow, so the shape is a Qwen2-MoE (shared expert, dense
    # first layers, the same expert layout) whose grouped-query attention has MLA's parameter count: 128 heads
    # of 96 dims with 8 KV heads give 7168 x 96 x (2 x 128 + 2 x 8) = 187,170,816 weights a layer against MLA's
    # 187,107,328 (+0.03%, plus q/k/v biases of 13,824), 671.03B parameters in all as DeepSeek-V3's (without
    # its multi-token-prediction layer). Approximate: the KV cache (8 x 96 x 2 = 1536 values a token a layer,
    # where MLA caches a 576-value latent on every rank) and the activations; exact: the experts, the dense
    # layers, the embeddings, so the weights, the training state and the switch's bytes.
    "deepseek-v3-671b": dict(model_type="qwen2_moe", hidden_size=7168, num_hidden_layers=61,
                             num_attention_heads=128, num_key_value_heads=8, head_dim=96, num_experts=256,
                             num_experts_per_tok=8, moe_intermediate_size=2048, shared_expert_intermediate_size=2048,
                             mlp_only_layers=[0, 1, 2], intermediate_size=18432, vocab_size=129280,
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
