"""Shared fixtures for the data tests: the char tokenizer (one token per ASCII char, ChatML template)."""

from __future__ import annotations

import pytest

from hybridflow.models import build_char_tokenizer


@pytest.fixture(scope="session")
def tok():
    """The char-level tokenizer with a chat template."""
    return build_char_tokenizer()


@pytest.fixture(scope="session")
def vl_processor():
    """The tiny Qwen2.5-VL's processor (PIL image processor + char tokenizer with the vision tokens)."""
    from hybridflow.models.vision import build_tiny_vl_model_and_processor

    return build_tiny_vl_model_and_processor()[1]
