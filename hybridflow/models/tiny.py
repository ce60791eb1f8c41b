"""Tiny models of every family and a character-level tokenizer, built locally for tests and the demo.

A family's tiny model is its config class (``AutoConfig.for_model``) at the shared small sizes plus its entry's
``tiny`` keywords (``models.family``): adding a family's entry adds its tiny model."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import AutoConfig, GenerationConfig, PreTrainedModel, PreTrainedTokenizerFast
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from hybridflow.models.family import FAMILIES, FamilySpec

logger = logging.getLogger(__name__)

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
UNK_TOKEN = "<|unk|>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, UNK_TOKEN)

# Qwen2.5-style ChatML without the default system prompt: each turn is
# "<|im_start|>{role}\n{content}<|im_end|>\n"; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TINY_EXPERTS, TINY_EXPERTS_PER_TOKEN = 4, 2


def tiny_archs() -> list[str]:
    """The families ``build_tiny_model`` builds: every causal LM with an entry in ``models.family`` (a
    vision-language model's tiny model is ``models.vision``'s)."""
    return [s.name for s in FAMILIES.values() if s.text is None and s.part_of is None]


def _family_kwargs(spec: FamilySpec, sizes: dict) -> dict:
    """The config keywords of one family's tiny model: the shared sizes the config class knows (GPT-2's own
    spellings through its attribute map, ``n_inner`` for the MLP), 4 experts, 2 per token, for a mixture of
    experts (half-size routed experts and a full-size shared one where the family sizes them apart), and the
    entry's ``tiny`` keywords."""
    config_cls = type(AutoConfig.for_model(spec.name))
    known = set(getattr(config_cls, "__dataclass_fields__", {})) | set(config_cls.attribute_map)
    if "intermediate_size" not in known and "n_inner" in known:
        sizes = {**sizes, "n_inner": sizes["intermediate_size"]}
    out = {k: v for k, v in sizes.items() if k in known}
    width = sizes["hidden_size"] // sizes["num_attention_heads"]
    if getattr(config_cls(**out), "head_dim", None) not in (None, width):  # Qwen3's, Seed-OSS's: 128 always
        out["head_dim"] = width
    e = spec.experts
    if e is not None:
        out.update({e.count: TINY_EXPERTS, "num_experts_per_tok": TINY_EXPERTS_PER_TOKEN})
        if e.size != "intermediate_size":
            out[e.size] = sizes["intermediate_size"] // 2
        if e.shared_size:
            out[e.shared_size] = sizes["intermediate_size"]
    return {**out, **spec.tiny}


def _byte_symbols() -> list[str]:
    """The 256 printable stand-ins for bytes that byte-level BPE vocabularies use (GPT-2 / Qwen2 convention).

    Bytes that are visible Latin-1 characters stand for themselves; the others (controls, space, ...)
    take the code points from 256 upwards, in byte order. So " " is "Ġ" and "\\n" is "Ċ".
    """
    visible = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    symbols, shifted = [], 0
    for byte in range(256):
        if byte in visible:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    return symbols


def _vocab_and_merges(extra_chars: str) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Specials, then one token per byte, then one merged token per new non-ASCII extra char."""
    symbols = _byte_symbols()
    vocab = {token: idx for idx, token in enumerate(SPECIAL_TOKENS)}
    for symbol in symbols:
        vocab[symbol] = len(vocab)
    merges: dict[tuple[str, str], None] = {}
    for char in dict.fromkeys(extra_chars):
        pieces = [symbols[byte] for byte in char.encode("utf-8")]
        merged = pieces[0]
        # Merges only join a lead byte (prefix) with its continuation bytes, so they never cross chars.
        for piece in pieces[1:]:
            merges[(merged, piece)] = None
            merged += piece
            vocab.setdefault(merged, len(vocab))
    return vocab, list(merges)


def char_vocab_size(extra_chars: str = "") -> int:
    """Vocabulary size of ``build_char_tokenizer(extra_chars)``."""
    return len(_vocab_and_merges(extra_chars)[0])


def build_char_tokenizer(extra_chars: str = "", model_max_length: int = 512) -> PreTrainedTokenizerFast:
    """Build a character-level tokenizer with ChatML special tokens and a Qwen-style chat template.

    Every ASCII character (and every char in ``extra_chars``) is one token; any other text falls back to
    one token per UTF-8 byte, so nothing is ever unknown and decode(encode(s)) == s for NFC text.
    It is a byte-level BPE with no merges between chars, not a WordLevel model, because transformers 5
    rebuilds the tokenizer next to a qwen2 config as a byte-level BPE from tokenizer.json's vocab and
    merges: only this form loads back through AutoTokenizer with the same ids for every architecture.
    """
    vocab, merges = _vocab_and_merges(extra_chars)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=UNK_TOKEN))
    # NFC as in Qwen2's tokenizer, so a reloaded Qwen2Tokenizer gives the same ids on any input.
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # The byte-level decoder maps symbols back to bytes and joins them: no spaces between chars.
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(tok, special=True, normalized=False) for tok in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        additional_special_tokens=[IM_START_TOKEN, IM_END_TOKEN],
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        # transformers 4 would otherwise turn " ," into "," when decoding.
        clean_up_tokenization_spaces=False,
    )


def build_tiny_model(
    arch: str = "qwen2",
    vocab_size: int | None = None,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    pad_token_id: int | None = None,
    bos_token_id: int | None = None,
    eos_token_id: int | list[int] | None = None,
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """Build a randomly initialised causal LM of ``arch`` (a family of ``tiny_archs()``) from a small config.

    ``vocab_size`` defaults to the char tokenizer's, ``intermediate_size`` to 4 * hidden_size and
    ``tie_word_embeddings`` to the family's small models (its entry's ``tiny`` keywords: True for qwen2, qwen3
    and gpt2, False for the others). GPT-2 ignores ``num_key_value_heads``; the MoE families get 4 experts, 2
    per token. The same ``seed`` gives the same weights, and the global RNG state is left untouched.
    """
    if arch not in tiny_archs():
        raise ValueError(f"unknown arch {arch!r}; use one of {sorted(tiny_archs())}")
    if hidden_size % num_attention_heads or num_attention_heads % num_key_value_heads:
        raise ValueError(
            f"hidden_size ({hidden_size}) must be divisible by num_attention_heads ({num_attention_heads}), "
            f"which must be divisible by num_key_value_heads ({num_key_value_heads})"
        )
    sizes = dict(
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size if intermediate_size is not None else 4 * hidden_size,
        max_position_embeddings=max_position_embeddings,
    )
    kwargs = _family_kwargs(FAMILIES[arch], sizes)
    if tie_word_embeddings is not None:
        kwargs["tie_word_embeddings"] = tie_word_embeddings
    config = AutoConfig.for_model(
        arch,
        vocab_size=vocab_size if vocab_size is not None else char_vocab_size(),
        tie_word_embeddings=kwargs.pop("tie_word_embeddings", False),
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id[0] if isinstance(eos_token_id, list) else eos_token_id,
        attn_implementation=attn_implementation,
        **kwargs,
    )
    model_cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    # Initialise in float32 under a forked RNG so weights depend only on `seed`, not on the dtype or on
    # whatever ran before; then cast once.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model = model.to(dtype)
    model.generation_config = GenerationConfig(
        pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id
    )
    return model.eval()


def build_tiny_model_and_tokenizer(
    out_dir: str | os.PathLike | None = None,
    arch: str = "qwen2",
    extra_chars: str = "",
    **model_kwargs,
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Build a tiny model and the char tokenizer with matching vocab and special ids; save both to ``out_dir``.

    The model config's eos is ``<|endoftext|>``; the generation config stops on it and on ``<|im_end|>``
    (as Qwen2.5-Instruct does), so chat rollouts end at the end of the assistant turn.
    """
    for key in ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id"):
        if key in model_kwargs:
            raise TypeError(
                f"{key} is set from the tokenizer; do not pass it to build_tiny_model_and_tokenizer"
            )
    max_len = model_kwargs.get("max_position_embeddings", 512)
    tokenizer = build_char_tokenizer(extra_chars, model_max_length=max_len)
    eos_ids = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END_TOKEN)]
    model = build_tiny_model(
        arch=arch,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos_ids,
        **model_kwargs,
    )
    if out_dir is not None:
        out = Path(out_dir).expanduser()
        out.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        logger.info("saved tiny %s model and char tokenizer to %s", arch, out)
    return model, tokenizer
