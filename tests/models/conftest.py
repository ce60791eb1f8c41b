"""Shared tiny checkpoints for the models tests (built once per session, saved to a temp dir)."""

from __future__ import annotations

import pytest

from hybridflow.models import build_tiny_model_and_tokenizer


@pytest.fixture(scope="session", params=["qwen2", "llama"])
def tiny_dir(request, tmp_path_factory):
    """(arch, directory) of a saved tiny causal LM plus its char tokenizer; qwen2 ties embeddings, llama not."""
    out = tmp_path_factory.mktemp(f"tiny_{request.param}")
    build_tiny_model_and_tokenizer(out, arch=request.param, seed=1)
    return request.param, out
