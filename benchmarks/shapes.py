"""The model shapes the GPU benchmarks share (Qwen2.5-0.5B / 1.5B, Qwen2-7B, a tiny CPU one) and their builders."""

from __future__ import annotations

import torch

PEAK_FLOPS = 790e12  # bf16 dense GEMM, measured on one H200 (RESULTS.md, measured anchors)

# Qwen2.5-0.5B / 1.5B shapes (tied embeddings, q/k/v biases) and Qwen2-7B's (the HybridFlow write-ups' model:
# untied embeddings, 152064-word vocabulary); "tiny" is for a CPU smoke run. Embeddings are tied unless the
# shape says ``tie_word_embeddings=False``.
SHAPES = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=256, vocab_size=1024),
    "0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936),
    "1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                 intermediate_size=8960, vocab_size=151936),
    "7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
               intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
}  # fmt: skip


def model_config(size: str, attn: str = "sdpa"):
    """The Qwen2Config of a shape (``SHAPES``; tied embeddings unless the shape unties them)."""
    from transformers import Qwen2Config

    shape = dict(SHAPES[size])
    tied = shape.pop("tie_word_embeddings", True)
    return Qwen2Config(
        **shape,
        tie_word_embeddings=tied,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        attn_implementation=attn,
    )


def build_model(size: str, attn: str, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised Qwen2ForCausalLM of the given shape, created directly on ``device`` in fp32."""
    from transformers import Qwen2ForCausalLM

    config = model_config(size, attn)
    torch.manual_seed(seed)
    with device:  # init on the GPU: random init of 0.5B parameters on the host takes tens of seconds
        return Qwen2ForCausalLM(config)


def count_params(model: torch.nn.Module) -> tuple[int, int]:
    """(all parameters with tied weights counted once, non-embedding parameters)."""
    total = sum(p.numel() for p in model.parameters())  # parameters() already de-duplicates tied weights
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    embedding = emb.numel() + (0 if head is emb else head.numel())
    return total, total - embedding


# Qwen3-30B-A3B's layer (hidden 2048, 32 query / 4 KV heads of 128, 128 experts of 768, 8 per token) in a few
# layers, and a dense Qwen3 of the same active size per token (an MLP of 8 x 768 = 6144); "qwen3moe-tiny" and
# its dense twin for a CPU smoke run. For benchmarks/rollout.py's --model.
MOE_SHAPES = {
    "qwen3moe-small": dict(hidden_size=2048, num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4,
                           head_dim=128, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                           intermediate_size=6144, vocab_size=151936),
    "qwen3moe-small-dense": dict(hidden_size=2048, num_hidden_layers=4, num_attention_heads=32,
                                 num_key_value_heads=4, head_dim=128, intermediate_size=6144, vocab_size=151936),
    "qwen3moe-tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                          intermediate_size=64, vocab_size=1024),
    "qwen3moe-tiny-dense": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                head_dim=16, intermediate_size=64, vocab_size=1024),
}  # fmt: skip


def build_moe_shape(size: str, device: torch.device, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised Qwen3-MoE (or its dense twin, Qwen3) of ``MOE_SHAPES``, on ``device`` in fp32.

    The routers are drawn N(0, 0.02) whatever the transformers version initialises them to (some start at
    zero, where every token would pick the same experts and the benchmark would flatter the grouped GEMMs)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    shape = dict(MOE_SHAPES[size])
    moe = "num_experts" in shape
    config_cls, model_cls = (Qwen3MoeConfig, Qwen3MoeForCausalLM) if moe else (Qwen3Config, Qwen3ForCausalLM)
    extra = dict(norm_topk_prob=True) if moe else {}  # Qwen3-30B-A3B renormalises its top-8 weights
    config = config_cls(
        **shape,
        **extra,
        tie_word_embeddings=False,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    with device:
        model = model_cls(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.02)
    return model
