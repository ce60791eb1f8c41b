"""Shared fixtures for the data tests: the char tokenizer (one token per ASCII char, ChatML template)."""

from __future__ import annotations

import pytest

from hybridflow.models import build_char_tokenizer


@pytest.fixture(scope="session")
def tok():
    """The char-level tokenizer with a chat template."""
    return build_char_tokenizer()
