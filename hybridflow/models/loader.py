"""Load Hugging Face causal LMs and tokenizers from local directories (no hub access, ever)."""

from __future__ import annotations

import json
import logging
import os
import pickle
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import SafetensorError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from hybridflow.models.moe import install_moe, moe_blocks
from hybridflow.models.vision import is_vision_language
from hybridflow.utils.errors import UserError
from hybridflow.utils.paths import check_local_dir

logger = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

# Tokenizer paths whose missing pad token was already reported, so repeated loads stay quiet.
_PAD_DEFAULT_LOGGED: set[str] = set()


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Turn ``"float32" | "bfloat16" | "float16"`` (or fp32/bf16/fp16, or a torch.dtype) into a dtype."""
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise UserError(
                f"dtype must be a floating-point dtype, got {dtype}; use one of {_valid_dtypes()}"
            )
        return dtype
    if not isinstance(dtype, str):
        raise TypeError(f"dtype must be a string or torch.dtype, got {type(dtype).__name__}")
    key = dtype.strip().lower().removeprefix("torch.")
    if key not in _DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; use one of {_valid_dtypes()}")
    return _DTYPES[key]


def _valid_dtypes() -> str:
    return ", ".join(repr(name) for name in _DTYPES)


def resolve_local_dir(path: str | os.PathLike, need: tuple[str, ...] = ("config.json",)) -> Path:
    """Check that ``path`` is a local directory holding one of the files in ``need``; return it."""
    return check_local_dir(path, need)


def apply_override_config(config: PretrainedConfig, overrides: dict[str, Any] | None) -> PretrainedConfig:
    """Set ``overrides`` on ``config`` in place; a key the config lacks raises ValueError.

    A dict value merges into a dict or sub-config attribute. ``rope_theta`` also reaches
    ``rope_parameters["rope_theta"]``, where transformers 5 keeps it.
    """
    if not overrides:
        return config
    if not isinstance(overrides, dict):
        raise TypeError(f"override_config must be a dict, got {type(overrides).__name__}")
    for key, value in overrides.items():
        _override_one(config, key, value, prefix="")
    return config


def _override_one(config: PretrainedConfig, key: str, value: Any, prefix: str) -> None:
    rope = getattr(config, "rope_parameters", None)
    if not hasattr(config, key):
        if isinstance(rope, dict) and key in rope:
            rope[key] = value
            return
        raise UserError(
            f"override_config key {prefix + key!r} is not a field of the {type(config).__name__} "
            f"(model_type={getattr(config, 'model_type', '?')!r}); check the spelling against the model's "
            "config.json"
        )
    current = getattr(config, key)
    if isinstance(value, dict) and isinstance(current, PretrainedConfig):
        for sub_key, sub_value in value.items():
            _override_one(current, sub_key, sub_value, prefix=f"{prefix}{key}.")
    elif isinstance(value, dict) and isinstance(current, dict):
        current.update(value)
    else:
        setattr(config, key, value)


def load_config(
    path: str | os.PathLike,
    trust_remote_code: bool = False,
    override_config: dict[str, Any] | None = None,
    **kwargs: Any,
) -> PretrainedConfig:
    """Load a model config from a local directory and apply ``override_config``."""
    model_dir = resolve_local_dir(path)
    raw = read_config_json(model_dir)
    try:
        config = AutoConfig.from_pretrained(
            model_dir, trust_remote_code=trust_remote_code, local_files_only=True, **kwargs
        )
    except (ValueError, KeyError) as exc:
        if "model_type" in raw and "auto_map" not in raw:
            raise UserError(
                f"{model_dir / 'config.json'}: model_type {raw['model_type']!r} is not an architecture "
                f"transformers {transformers.__version__} knows; upgrade transformers (pip install -U "
                "transformers), or for a model that ships its own code set model.trust_remote_code=true"
            ) from None
        raise UserError(f"{model_dir / 'config.json'} cannot be used as a model config: {exc}") from None
    return apply_override_config(config, override_config)


def read_config_json(model_dir: Path) -> dict[str, Any]:
    """A model directory's config.json as a dict; a ``UserError`` naming the file and line when it is not."""
    file = model_dir / "config.json"
    if not file.is_file():
        return {}
    try:
        raw = json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise UserError(f"{file} is not UTF-8 text (byte {exc.start}); re-save the model's config") from None
    except json.JSONDecodeError as exc:
        raise UserError(
            f"{file} is not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno}); fix the file or "
            "re-save the model (save_pretrained writes it)"
        ) from None
    if not isinstance(raw, dict):
        raise UserError(
            f"{file} holds a JSON {type(raw).__name__}, not an object; re-save the model's config"
        )
    return raw


# Encoder models that transformers can run as a decoder only when their config says is_decoder=True.
_ENCODER_TYPES = {
    "bert",
    "roberta",
    "xlm-roberta",
    "xlm-roberta-xl",
    "electra",
    "ernie",
    "camembert",
    "data2vec-text",
    "rembert",
    "roformer",
    "megatron-bert",
    "xmod",
    "big_bird",
    "bert-generation",
}


def check_causal_lm(config: PretrainedConfig, model_dir: Path) -> None:
    """Refuse a model that is not a causal (decoder-only) LM: an encoder (BERT) or an encoder-decoder (T5)."""
    model_type = getattr(config, "model_type", "?")
    archs = list(getattr(config, "architectures", None) or [])
    if is_vision_language(config):  # Qwen2-VL family: a causal LM over text and image tokens
        return
    causal_arch = any("CausalLM" in a or "LMHeadModel" in a for a in archs)
    encoder = model_type in _ENCODER_TYPES and not getattr(config, "is_decoder", False)
    if getattr(config, "is_encoder_decoder", False):
        kind = "an encoder-decoder model"
    elif encoder or (archs and not causal_arch and not getattr(config, "auto_map", None)):
        kind = "an encoder-only model" if encoder or model_type in _ENCODER_TYPES else "not a causal LM"
    else:
        return
    named = f" ({', '.join(archs)})" if archs else ""
    raise UserError(
        f"the model in {model_dir} is {kind} (model_type={model_type!r}{named}); hybridflow trains and "
        "generates with causal (decoder-only) language models such as Qwen2, Llama or GPT-2: point "
        "model.path to one"
    )


def _weights_error(model_dir: Path, exc: BaseException) -> UserError:
    """A load failure of the weight files as a user error naming the file and the fix."""
    files = sorted(p.name for p in model_dir.glob("*.safetensors")) or sorted(
        p.name for p in model_dir.glob("*.bin")
    )
    if not files:
        return UserError(
            f"{model_dir} has no weights file (model.safetensors, model-*-of-*.safetensors or pytorch_model.bin); "
            "copy the model's weight files next to its config.json"
        )
    first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
    return UserError(
        f"the weights in {model_dir} ({', '.join(files)}) cannot be read: {first}. A file is damaged or "
        "truncated (an interrupted download or copy?); download or copy the model again"
    )


def from_pretrained_kwargs(
    dtype: str | torch.dtype, attn_implementation: str | None, trust_remote_code: bool
) -> dict[str, Any]:
    """Keyword arguments shared by every ``from_pretrained`` call of this package."""
    # transformers renamed `torch_dtype` to `dtype` in 4.56; accept both generations.
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    dtype_key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    kwargs: dict[str, Any] = {
        dtype_key: resolve_dtype(dtype),
        "trust_remote_code": trust_remote_code,
        "local_files_only": True,
    }
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    return kwargs


def load_causal_lm(
    path: str | os.PathLike,
    dtype: str | torch.dtype = "float32",
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    override_config: dict[str, Any] | None = None,
) -> PreTrainedModel:
    """Load a causal LM (any architecture ``AutoModelForCausalLM`` knows) from a local directory.

    A Qwen2-VL-family directory loads as its vision-language class (``Qwen2_5_VLForConditionalGeneration``),
    vision tower included; its processor comes from ``vision_tower.load_vision_processor``.
    """
    config = load_config(path, trust_remote_code=trust_remote_code, override_config=override_config)
    model_dir = Path(path).expanduser()
    check_causal_lm(config, model_dir)
    kwargs = from_pretrained_kwargs(dtype, attn_implementation, trust_remote_code)
    try:
        auto = AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM
        model, info = auto.from_pretrained(model_dir, config=config, output_loading_info=True, **kwargs)
    except (SafetensorError, OSError, EOFError, pickle.UnpicklingError) as exc:
        raise _weights_error(model_dir, exc) from None
    except RuntimeError as exc:  # torch.load of a damaged pytorch_model.bin
        if "zip archive" not in str(exc) and "PytorchStreamReader" not in str(exc):
            raise
        raise _weights_error(model_dir, exc) from None
    if install_moe(model):  # the shared routing and grouped experts in place of HF's loop (same names)
        logger.info(
            "mixture of experts: %d sparse blocks run through hybridflow.models.moe", len(moe_blocks(model))
        )
    if info.get("missing_keys"):
        # transformers does not list tied weights here, so every missing key was randomly initialised.
        logger.warning(
            "weights missing from %s (randomly initialised): %s", path, sorted(info["missing_keys"])
        )
    logger.info(
        "loaded %s from %s: dtype=%s, attn=%s, %.1fM parameters",
        type(model).__name__,
        path,
        model.dtype,
        model.config._attn_implementation,
        sum(p.numel() for p in model.parameters()) / 1e6,
    )
    return model


# Files that hold a tokenizer's vocabulary: the fast tokenizer, BPE/WordPiece vocabularies, and (by suffix)
# sentencepiece models (tokenizer.model, spiece.model, ...) and tiktoken files.
_VOCAB_FILES = ("tokenizer.json", "vocab.json", "vocab.txt")
_VOCAB_SUFFIXES = ("*.model", "*.tiktoken")
# Class names meaning "the tokenizers library's own tokenizer, exactly as tokenizer.json defines it".
_GENERIC_FAST = ("PreTrainedTokenizerFast", "TokenizersBackend")
# Encoded right after loading: every usable tokenizer gives at least one id for some of these characters
# (letters, digits, operators), so an empty result means the vocabulary did not load.
_PROBE = "Hello world. 12 + 3 = 15"


def load_tokenizer(
    path: str | os.PathLike,
    trust_remote_code: bool = False,
    fix_option: str = "model.tokenizer_path",
    **kwargs: Any,
) -> PreTrainedTokenizerBase:
    """Load a tokenizer from a local directory; one without a pad token gets pad = eos.

    ``fix_option`` is the setting that points at another tokenizer directory, named in errors.
    """
    tok_dir = resolve_local_dir(path, need=("tokenizer_config.json", "tokenizer.json", "config.json"))
    tok_config = _read_tokenizer_config(tok_dir)
    _check_tokenizer_files(tok_dir, tok_config, fix_option)
    cls = _tokenizer_class(tok_dir, tok_config)
    try:
        tokenizer = cls.from_pretrained(
            tok_dir, trust_remote_code=trust_remote_code, local_files_only=True, **kwargs
        )
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:  # a damaged or unreadable file
        first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise UserError(
            f"the tokenizer in {tok_dir} cannot be loaded: {first}; copy the model's tokenizer files again, "
            f"or set {fix_option}=DIR to a directory that has them"
        ) from None
    _check_encodes_text(tokenizer, tok_dir)
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise UserError(
                f"tokenizer at {str(path)!r} has neither a pad nor an eos token; pass one explicitly, "
                "e.g. load_tokenizer(path, pad_token='<pad>')"
            )
        tokenizer.pad_token = tokenizer.eos_token
        key = str(tok_dir.resolve())
        if key not in _PAD_DEFAULT_LOGGED:
            _PAD_DEFAULT_LOGGED.add(key)
            logger.warning("tokenizer at %s has no pad token; using eos %r as pad", path, tokenizer.eos_token)
    return tokenizer


def _read_tokenizer_config(tok_dir: Path) -> dict[str, Any]:
    """tokenizer_config.json as a dict ({} when the file is absent)."""
    file = tok_dir / "tokenizer_config.json"
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{file} is not valid JSON ({exc.msg}); re-save the tokenizer") from None
    return config if isinstance(config, dict) else {}


def _check_tokenizer_files(tok_dir: Path, tok_config: dict[str, Any], fix_option: str) -> None:
    """Refuse a directory without a vocabulary: transformers would quietly build an empty tokenizer."""
    if "auto_map" in tok_config:
        return  # remote-code tokenizers name their own vocabulary files; the probe checks what loads
    if any((tok_dir / name).is_file() for name in _VOCAB_FILES):
        return
    if any(f.is_file() for pattern in _VOCAB_SUFFIXES for f in tok_dir.glob(pattern)):
        return
    has_config = (tok_dir / "tokenizer_config.json").is_file()
    what = (
        "tokenizer_config.json but no vocabulary"
        if has_config
        else "no tokenizer files (no tokenizer.json or tokenizer_config.json)"
    )
    raise UserError(
        f"{tok_dir} has {what}: it needs tokenizer.json, or a vocabulary file "
        "(vocab.json + merges.txt, tokenizer.model or vocab.txt), next to tokenizer_config.json. Copy the "
        f"tokenizer files of the model into {tok_dir}, or set {fix_option}=DIR to a directory that has them"
    )


def _tokenizer_class(tok_dir: Path, tok_config: dict[str, Any]) -> type:
    """The class to load: the one tokenizer_config.json names when it is the generic fast tokenizer.

    transformers 5's AutoTokenizer overrides a generic ``tokenizer_class`` (or its absence) with the model
    type's own class, e.g. Qwen2Tokenizer next to a qwen2 config.json, which rebuilds tokenizer.json as a
    byte-level BPE: a WordLevel vocabulary then encodes every prompt to nothing. Specific class names and
    remote code stay with AutoTokenizer, which also corrects known mislabelled hub tokenizers.
    """
    named = tok_config.get("tokenizer_class")
    if "auto_map" in tok_config:
        return AutoTokenizer
    if named in _GENERIC_FAST or (named is None and (tok_dir / "tokenizer.json").is_file()):
        return PreTrainedTokenizerFast
    return AutoTokenizer


def _check_encodes_text(tokenizer: PreTrainedTokenizerBase, tok_dir: Path) -> None:
    """Refuse a tokenizer that turns non-empty text into no tokens (its vocabulary did not load)."""
    try:
        ids = tokenizer.encode(_PROBE, add_special_tokens=False)
    except Exception:  # e.g. a WordLevel vocabulary without [UNK]: real prompts will report their own error
        logger.debug("tokenizer probe %r failed for %s", _PROBE, tok_dir, exc_info=True)
        return
    if ids:
        return
    name = type(tokenizer).__name__
    raise UserError(
        f"the tokenizer in {tok_dir} loaded as {name} and turns text into no tokens (it encodes "
        f"{_PROBE!r} to []), so every prompt would be empty. If tokenizer.json is a custom tokenizer, set "
        f'"tokenizer_class": "PreTrainedTokenizerFast" in {tok_dir / "tokenizer_config.json"}; otherwise '
        "copy the model's own tokenizer files into the directory"
    )
