"""The model shapes the GPU benchmarks share (Qwen2.5-0.5B / 1.5B, Qwen2-7B, a tiny CPU one) and their builders."""

from __future__ import annotations

import torch

PEAK_FLOPS = 790e12  # bf16 dense GEMM, measured on one H200 (DESIGN.md section 8)

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
