"""One ``FamilySpec`` per model family: everything hybridflow knows about a family, in one entry.

A family is a Hugging Face ``model_type``. Its entry says where the decoder layers are, which projections are
column-parallel (q, gate, up: split on their output rows), grouped by KV head (k, v), row-parallel (o, down:
split on their input columns and all-reduced) and vocabulary-parallel (embedding, LM head), which norms are
replicated (Qwen3's per-head q/k norms among them), how a mixture of experts lays out and routes its experts,
whether a sliding window applies, whether the built-in rollout engine runs it (and, when not, the one-line
reason of the HF ``generate`` fallback), whether pipeline stages, Ulysses and LoRA take it, and the config
keywords of its tiny test model. Everything family-specific elsewhere is derived from these entries:

- the rollout's and the reshard plan's shard rules (``FamilySpec.shard_rules``, read by
  ``engine.parallel.layout.kind_of``) and the training tensor-parallel plan (``FamilySpec.train_plan``, turned
  into DTensor styles by ``engine.parallel.tp``): the same projections, written once;
- the built-in engine's support check (``engine.rollout.support``) and the fallback warning
  (``models.families.fallback_notice``);
- the MoE routing and the expert-count fields (``models.moe``), the sizes tp must divide
  (``engine.parallel.layout``) and the shard configs (``engine.rollout.tp``);
- the refusals of tensor parallelism, pipeline stages, Ulysses and LoRA (``models.families``);
- the tiny models of the tests (``models.tiny``).

This module is data only (no torch, no transformers): models (L2) and engine (L3) both read it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

# The kinds of tensor-parallel layout a parameter can have (``engine.parallel.layout.ShardLayout``).
KINDS = (
    "replicated",
    "column",
    "kv",
    "row",
    "vocab",
    "first",
    "experts_column",
    "experts_row",
    "experts_split",
)


@dataclass(frozen=True)
class Experts:
    """A mixture of experts' sparse block in transformers 5's fused layout, and its routing.

    Under ``block`` (the layer's ``mlp``): the router ``gate`` (E, H), the fused experts
    ``experts.gate_up_proj`` (E, 2I, H), gate half first, and ``experts.down_proj`` (E, H, I): the layout the
    trainer's ``moe.MoEBlock`` and the rollout's binding run. Routing fields are ``moe.RouterSpec``'s.
    """

    count: str  # config field of the number of routed experts
    size: str  # config field of one routed expert's intermediate size (Mixtral: intermediate_size)
    block: str = "mlp"
    shared: str | None = None  # the shared expert's module under the block (a dense gate/up/down MLP)
    shared_gate: str | None = None  # its sigmoid gate (Qwen2-MoE), a linear to one output
    shared_size: str | None = None  # config field of the shared expert's intermediate size
    scoring: str = "softmax"  # "softmax" or "sigmoid" (DeepSeek-V3)
    renormalize: bool = False  # renormalise the top-k weights (where ``renormalize_field`` is unset)
    renormalize_field: str | None = None  # the config field that decides it (Qwen's norm_topk_prob)
    float32_weights: bool = False  # the routing weights stay float32 (Mixtral, DeepSeek)
    float32_logits: bool = False  # the router's matmul in float32 (DeepSeek)
    grouped: bool = False  # DeepSeek's group-limited choice: n_group / topk_group
    scaling_field: str | None = None  # config field scaling the weights (DeepSeek's routed_scaling_factor)
    correction_bias: bool = False  # DeepSeek's e_score_correction_bias, added for the choice only

    @property
    def router(self) -> str:
        """The router's module, relative to a decoder layer."""
        return f"{self.block}.gate"

    @property
    def fused(self) -> tuple[str, str]:
        """The fused experts' parameters (gate/up, down), relative to a decoder layer."""
        return f"{self.block}.experts.gate_up_proj", f"{self.block}.experts.down_proj"


@dataclass(frozen=True)
class FamilySpec:
    """What hybridflow knows of one model family (see the module doc). Module names are relative to a decoder
    layer (``self_attn.q_proj``) except ``layers``, ``vocab`` and ``final_norm`` (suffixes of the model's)."""

    name: str  # the config's model_type
    title: str  # how messages and docs name it ("Llama 2/3")
    layers: str = "model.layers"  # the decoder layers' ModuleList in the causal LM
    column: tuple[str, ...] = ()  # linears split on their output rows (q, gate, up)
    kv: tuple[str, ...] = ()  # k and v: rows split by KV head, a head shared by ranks when tp > KV heads
    row: tuple[str, ...] = ()  # linears split on their input columns, all-reduced (o, down)
    vocab: tuple[str, ...] = ()  # embedding and LM head: vocabulary-parallel
    norms: tuple[str, ...] = ()  # the layers' replicated norms
    final_norm: str | None = None
    head_norms: tuple[str, ...] = ()  # norms over each head's dims (Qwen3's q_norm, k_norm): replicated
    experts: Experts | None = None  # None: dense
    sliding_window: bool = False  # the config's sliding_window applies to every layer (Mistral, Mixtral)
    # Why the built-in rollout engine does not run it, read after its name ("uses MLA ..."); None: it runs it.
    rollout: str | None = None
    tensor_parallel: bool = True  # shard rules exist (given the projections above)
    decoder: bool = True  # a Llama-style decoder: pipeline stages and Ulysses split it
    lora: bool = False  # LoRA adapters are built and tested for it
    text: str | None = None  # a vision-language model: the family of its language model (text_config)
    part_of: str | None = None  # a sub-model's config (a VLM's language model), not a causal LM of its own
    # Config keywords of the family's tiny test model beyond the shared sizes (``models.tiny``).
    tiny: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tiny", MappingProxyType(dict(self.tiny)))

    @property
    def has_shard_rules(self) -> bool:
        """Whether tensor parallelism (training and rollout) can split this family."""
        return self.tensor_parallel and bool(self.column or self.kv)

    def shard_rules(self) -> tuple[tuple[str, str], ...]:
        """(parameter-name regex, kind) of every parameter of the family: its tensor-parallel layout in the
        rollout (``ShardLayout``'s kinds). Empty without shard rules."""
        if not self.has_shard_rules:
            return ()
        rules = [(_suffix(n, "weight"), "vocab") for n in self.vocab]
        rules += [(_suffix(n, "weight", "bias"), "column") for n in self.column]
        rules += [(_suffix(n, "weight", "bias"), "kv") for n in self.kv]
        rules += [(_suffix(n, "weight"), "row") for n in self.row]
        rules += [(_suffix(n, "bias"), "first") for n in self.row]  # added once, by rank 0
        norms = (*self.norms, *self.head_norms, *([self.final_norm] if self.final_norm else []))
        rules += [(_suffix(n, "weight"), "replicated") for n in norms]
        return (*rules, *self.expert_rules())

    def expert_rules(self) -> tuple[tuple[str, str], ...]:
        """``shard_rules`` of the sparse blocks: the router (and shared-expert gate) replicated, the shared
        expert as a dense MLP, every routed expert sliced on its intermediate dim."""
        e = self.experts
        if e is None or not self.has_shard_rules:
            return ()
        gate_up, down = e.fused
        rules = [(_suffix(e.router, "weight"), "replicated")]
        rules += [(rf"\.{re.escape(gate_up)}$", "experts_column"), (rf"\.{re.escape(down)}$", "experts_row")]
        if e.shared_gate:
            rules.append((_suffix(f"{e.block}.{e.shared_gate}", "weight"), "replicated"))
        if e.shared:
            shared = f"{e.block}.{e.shared}"
            rules += [
                (_suffix(f"{shared}.{n}", "weight", "bias"), "column") for n in ("gate_proj", "up_proj")
            ]
            rules += [(_suffix(f"{shared}.down_proj", "weight"), "row")]
            rules += [(_suffix(f"{shared}.down_proj", "bias"), "first")]
        return tuple(rules)

    def train_plan(self, sparse: bool) -> dict[str, str]:
        """A decoder layer's training tensor-parallel plan: layer-relative module -> "column", "row" or
        "head_norm". ``sparse``: the layer's MLP is a sparse block, which stays whole on every tp rank (its
        input, the residual stream after o's all-reduce, is the same there), so only the attention splits."""
        block = f"{self.experts.block}." if self.experts is not None else None
        plan = {n: "column" for n in (*self.column, *self.kv)}
        plan.update({n: "row" for n in self.row})
        if sparse and block is not None:
            plan = {n: k for n, k in plan.items() if not n.startswith(block)}
        plan.update({n: "head_norm" for n in self.head_norms})
        return plan


def _suffix(module: str, *params: str) -> str:
    """The regex of a module's parameters (``module`` a suffix of the full name, on a dot boundary)."""
    names = params[0] if len(params) == 1 else f"({'|'.join(params)})"
    return rf"(^|\.){re.escape(module)}\.{names}$"


# The Llama-style layer: q/k/v/o attention, a SiLU-gated gate/up/down MLP, RMSNorm before each.
_ATTENTION = dict(column=("self_attn.q_proj",), kv=("self_attn.k_proj", "self_attn.v_proj"))
_LLAMA = dict(
    column=("self_attn.q_proj", "mlp.gate_proj", "mlp.up_proj"),
    kv=_ATTENTION["kv"],
    row=("self_attn.o_proj", "mlp.down_proj"),
    vocab=("embed_tokens", "lm_head"),
    norms=("input_layernorm", "post_attention_layernorm"),
    final_norm="norm",
)
_ATTENTION_ONLY = {**_LLAMA, "column": _ATTENTION["column"], "row": ("self_attn.o_proj",)}
_QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
_QWEN_MOE = dict(count="num_experts", size="moe_intermediate_size", renormalize_field="norm_topk_prob")

FAMILIES: dict[str, FamilySpec] = {
    s.name: s
    for s in (
        FamilySpec("llama", "Llama 2/3", **_LLAMA, lora=True),
        FamilySpec("mistral", "Mistral", **_LLAMA, sliding_window=True, lora=True),
        FamilySpec("qwen2", "Qwen2/2.5", **_LLAMA, lora=True, tiny={"tie_word_embeddings": True}),
        FamilySpec(
            "qwen3", "Qwen3", **_LLAMA, head_norms=_QK_NORMS, lora=True, tiny={"tie_word_embeddings": True}
        ),
        # Seed-OSS (ByteDance): a Llama with q/k/v biases (and optional o and MLP biases), 128-wide heads and
        # 0.1 attention and residual dropout in its released config (turned off for RL like every dropout).
        FamilySpec("seed_oss", "Seed-OSS", **_LLAMA),
        # Mixtures of experts: Llama attention, a sparse MLP (Qwen's may keep some layers dense: mlp_only_layers).
        FamilySpec(
            "qwen2_moe",
            "Qwen2-MoE",
            **_LLAMA,
            experts=Experts(
                **_QWEN_MOE,
                shared="shared_expert",
                shared_gate="shared_expert_gate",
                shared_size="shared_expert_intermediate_size",
            ),
        ),
        FamilySpec("qwen3_moe", "Qwen3-MoE", **_LLAMA, head_norms=_QK_NORMS, experts=Experts(**_QWEN_MOE)),
        FamilySpec(
            "mixtral",
            "Mixtral",
            **_ATTENTION_ONLY,  # every layer sparse
            sliding_window=True,
            experts=Experts(
                count="num_local_experts", size="intermediate_size", renormalize=True, float32_weights=True
            ),
        ),
        # Vision-language models: the built-in engine runs their Qwen2 language model (M-RoPE positions), the
        # vision tower is HF's own module; no shard rules, pipeline stages or Ulysses for them yet.
        *(
            FamilySpec(vlm, title, layers="model.language_model.layers", text=f"{vlm}_text", decoder=False)
            for vlm, title in (("qwen2_vl", "Qwen2-VL"), ("qwen2_5_vl", "Qwen2.5-VL"))
        ),
        *(
            FamilySpec(
                f"{vlm}_text",
                f"{title}'s language model",
                **{**_LLAMA, "layers": "model.language_model.layers"},  # in the VLM's causal LM
                tensor_parallel=False,
                part_of=vlm,
            )
            for vlm, title in (("qwen2_vl", "Qwen2-VL"), ("qwen2_5_vl", "Qwen2.5-VL"))
        ),
        # Outside the built-in engine: trained with FSDP2 over every rank, generated with HF generate.
        FamilySpec(
            "gpt2",
            "GPT-2",
            layers="transformer.h",
            rollout="is not a Llama-style decoder: learned positions, LayerNorm, a GELU MLP, a fused c_attn",
            decoder=False,
            tiny={"tie_word_embeddings": True},
        ),
        FamilySpec(
            "deepseek_v3",
            "DeepSeek-V3",
            rollout="uses multi-head latent attention (MLA), which the rollout engine does not implement",
            decoder=False,
            experts=Experts(
                count="n_routed_experts",
                size="moe_intermediate_size",
                shared="shared_experts",
                scoring="sigmoid",
                renormalize=True,
                renormalize_field="norm_topk_prob",
                float32_weights=True,
                float32_logits=True,
                grouped=True,
                scaling_field="routed_scaling_factor",
                correction_bias=True,
            ),
            # MLA at small sizes: 2 groups of 2 experts, one shared expert, every layer sparse
            tiny=dict(
                n_group=2,
                topk_group=1,
                n_shared_experts=1,
                first_k_dense_replace=0,
                q_lora_rank=None,
                kv_lora_rank=16,
                qk_rope_head_dim=8,
                head_dim=8,  # DeepSeek's rotary dims
                qk_nope_head_dim=8,
                v_head_dim=16,
            ),
        ),
    )
}


def family_name(config: Any) -> str:
    """The config's ``model_type`` (the family's name), or its class name when it has none."""
    return getattr(config, "model_type", None) or type(config).__name__


def family_of(config: Any) -> FamilySpec | None:
    """The ``FamilySpec`` of a model config (None: a family hybridflow has no entry for)."""
    return FAMILIES.get(getattr(config, "model_type", None) or "")


def family_names(where: Any) -> list[str]:
    """The names of the families an entry predicate holds for, e.g. ``family_names(lambda s: s.lora)``."""
    return [s.name for s in FAMILIES.values() if where(s)]


def rollout_families() -> list[str]:
    """The top-level families the built-in rollout engine runs (not the VLMs' language models)."""
    return family_names(lambda s: s.rollout is None and s.part_of is None)


def expert_fields() -> tuple[str, ...]:
    """The config fields that hold a number of routed experts, over every family."""
    return tuple(dict.fromkeys(s.experts.count for s in FAMILIES.values() if s.experts is not None))
