"""L2 models: local Hugging Face loading, a critic with a scalar head, tiny models and a char tokenizer.

Everything loads from local directories; no model hub is ever contacted.
"""

from hybridflow.models.loader import (
    apply_override_config,
    load_causal_lm,
    load_config,
    load_tokenizer,
    resolve_dtype,
    resolve_local_dir,
)
from hybridflow.models.tiny import (
    CHAT_TEMPLATE,
    build_char_tokenizer,
    build_tiny_model,
    build_tiny_model_and_tokenizer,
    char_vocab_size,
)
from hybridflow.models.value_model import (
    build_value_model,
    compute_values,
    init_value_head,
    load_value_model,
    value_head,
)

__all__ = [
    "CHAT_TEMPLATE",
    "apply_override_config",
    "build_char_tokenizer",
    "build_tiny_model",
    "build_tiny_model_and_tokenizer",
    "build_value_model",
    "char_vocab_size",
    "compute_values",
    "init_value_head",
    "load_causal_lm",
    "load_config",
    "load_tokenizer",
    "load_value_model",
    "resolve_dtype",
    "resolve_local_dir",
    "value_head",
]
