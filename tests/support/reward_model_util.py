"""Shared by the reward-model tests: a tiny sequence-classification reward model saved to a directory."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForSequenceClassification


def save_reward_model(path: Path, vocab_size: int) -> Qwen2ForSequenceClassification:
    """A random one-layer Qwen2 scorer (one label) over ``vocab_size`` tokens, saved under ``path``."""
    torch.manual_seed(3)
    cfg = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=1,
        pad_token_id=0,
    )
    model = Qwen2ForSequenceClassification(cfg).eval()
    model.save_pretrained(path)
    return model
