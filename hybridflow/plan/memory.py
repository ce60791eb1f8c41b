"""The memory per GPU the planner (``plan.search``) estimates for one layout, and this machine's memory.

``estimate_phases`` is each phase's bytes per GPU from the engine's own accounting (``engine.hybrid.memory``:
held boxes, the reshard plan's generation shard) plus activations and the KV cache; ``host_bytes`` the host
memory of one node that offload or the CPU step holds; ``gpu_memory_bytes`` and ``host_memory_bytes`` what
this machine has. A layout's levers left at None take the config's values. A
vision-language model's text model sizes the activations and the KV cache (``mc``: its config or the VLM's, whose
``text_config`` is taken); a frozen vision tower holds its bf16 weights alone (no gradients or moments).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import torch

from hybridflow.config import Config
from hybridflow.engine import (
    GRAD_BYTES,
    MASTER_BYTES,
    MOMENT_BYTES,
    LoraSpec,
    ParallelDims,
    ViewMemory,
    decoder_of,
    lora_elements,
    view_memory,
)
from hybridflow.models.families import has_shard_rules, is_moe
from hybridflow.models.family import family_of
from hybridflow.models.vision import text_config
from hybridflow.models.vision_tower import vision_tower
from hybridflow.plan.switch import GenerateSplit, generation_bytes, sliced_kind, trained_kind

# ``layout`` arguments are ``plan.search.Layout`` (not imported: that module imports this one)
Layout = Any


def group_samples(cfg: Config, layout: Layout) -> int:
    """The samples one generation group decodes in a step (its share of the batch)."""
    return -(-cfg.data.train_batch_size * cfg.rollout.n // (layout.world // layout.tp_generate))


def generation_slots(cfg: Config, mc: Any, layout: Layout) -> tuple[int, int]:
    """(sequences one generation group decodes at once, bytes of one on a GPU: its KV cache over the context
    (``kv_bytes_per_token``) and its float32 logits row)."""
    d, r = cfg.data, cfg.rollout
    per_token = kv_bytes_per_token(cfg, mc, layout)
    context = r.max_model_len or d.max_prompt_length + d.max_response_length
    slots = min(layout.value(cfg, "rollout.max_num_seqs"), group_samples(cfg, layout))
    return slots, context * per_token + mc.vocab_size * 4 // layout.tp_generate


def kv_bytes_per_token(cfg: Config, mc: Any, layout: Layout) -> int:
    """KV-cache bytes of one token on one generation rank: K and V of its KV heads in every layer, bf16 (2
    bytes an element) or, with rollout.kv_cache_dtype=fp8, one byte (the per-head scales are negligible)."""
    heads = mc.num_attention_heads
    kv = getattr(mc, "num_key_value_heads", None) or heads
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // heads
    element = 1 if cfg.rollout.kv_cache_dtype == "fp8" else 2
    return mc.num_hidden_layers * 2 * max(1, kv // layout.tp_generate) * head_dim * element


def _kv_bytes(cfg: Config, mc: Any, layout: Layout) -> int:
    """The rollout's KV cache per GPU: the sequences its group decodes at once, each of the context length."""
    slots, per_slot = generation_slots(cfg, mc, layout)
    return slots * per_slot


# Fitted on one H200 (benchmarks/plan_check.py, Qwen2.5-0.5B and 1.5B shapes, GRPO workloads W1 and W2, bf16
# with remove-padding and dynamic micro-batches): what the update's backward really keeps of the bf16 tensors a
# decoder layer could save, and the bytes per LM-head (embedding) parameter its buffers take during the update
# (growing with the micro-batch up to HEAD_FULL_TOKENS). Checked on held-out runs: a 32k-token budget (1.5B)
# within 7%; fixed micro-batches of 4 samples (0.5B) were overestimated by 30% before the head's growth term.
SAVED_SHARE = 0.57
HEAD_BYTES_PER_PARAM = 41
HEAD_FULL_TOKENS = 8192


def _micro_tokens(samples: int, length: int, dynamic: bool, budget: int, micro: int) -> int:
    """Tokens of one micro-batch: ``micro`` samples, or, by a token budget, the samples split evenly."""
    if not dynamic:
        return micro * length
    total = max(samples, 1) * length
    return -(-total // -(-total // budget))


def update_micro(cfg: Config, layout: Layout) -> tuple[int, int]:
    """The update's micro-batches per GPU per step and the tokens of one, under the layout's levers."""
    a, r, d = cfg.actor, cfg.rollout, cfg.data
    length = d.max_prompt_length + d.max_response_length
    dp = layout.world // (layout.tp_train * layout.pp)
    samples = -(-a.ppo_mini_batch_size * r.n // dp)  # one mini-batch's share of this GPU
    budget = layout.value(cfg, "actor.ppo_max_token_len_per_gpu")
    micro = layout.value(cfg, "actor.ppo_micro_batch_size_per_gpu")
    tokens = _micro_tokens(samples, length, a.use_dynamic_bsz, budget, micro)
    minis = -(-d.train_batch_size // a.ppo_mini_batch_size) * a.ppo_epochs
    return minis * -(-samples * length // max(tokens, 1)), tokens


def _activation_bytes(cfg: Config, mc: Any, layout: Layout, backward: bool) -> int:
    """One micro-batch's activations per GPU: a backward's saved tensors and head buffers, or a forward's MLP."""
    a, r, d = cfg.actor, cfg.rollout, cfg.data
    length = d.max_prompt_length + d.max_response_length
    dp = layout.world // (layout.tp_train * layout.pp)
    if backward:  # the update's micro-batch of one mini-batch
        samples = -(-a.ppo_mini_batch_size * r.n // dp)
        tokens = update_micro(cfg, layout)[1]
    else:  # the old-log-prob (and reference) pass over the whole batch
        samples = -(-d.train_batch_size * r.n // dp)
        budget, micro = r.log_prob_max_token_len_per_gpu, r.log_prob_micro_batch_size_per_gpu
        tokens = _micro_tokens(samples, length, r.log_prob_use_dynamic_bsz, budget, micro)
    tokens //= layout.sp
    h, tp = mc.hidden_size, layout.tp_train
    i = getattr(mc, "intermediate_size", None) or getattr(mc, "n_inner", None) or 4 * h  # GPT-2: n_inner
    if not backward:  # no graph kept: the MLP's gate, up and product of one layer at a time
        return tokens * 2 * 3 * i // tp
    kv_dim = (getattr(mc, "num_key_value_heads", None) or mc.num_attention_heads) * (
        h // mc.num_attention_heads
    )
    layer = int(SAVED_SHARE * tokens * 2 * (6 * h + 2 * kv_dim + 4 * i)) // tp  # one layer's saved tensors
    layers = -(-mc.num_hidden_layers // layout.pp)
    # Checkpointing per decoder layer keeps only each layer's bf16 input (tokens x hidden x 2 bytes) through
    # the forward, and rebuilds one layer's saved tensors at a time in the backward: layers x input + one layer.
    # Without it every layer keeps its saved tensors: layers x layer.
    if layout.value(cfg, "model.enable_gradient_checkpointing"):
        saved = tokens * 2 * h * layers + layer
    else:
        saved = layer * layers
    # 1F1B: the first stage holds the saved tensors of up to pp micro-batches at once
    saved *= min(layout.pp, -(-samples * length // max(tokens * layout.sp, 1)))
    head = HEAD_BYTES_PER_PARAM * mc.vocab_size * h * min(tokens, HEAD_FULL_TOKENS) // HEAD_FULL_TOKENS // tp
    return saved + head


@functools.lru_cache(maxsize=64)
def _views(model: torch.nn.Module, dims: ParallelDims, tp_generate: int, ep_generate: int = 1) -> ViewMemory:
    """The views' figures without the switch's transfers (offload does not change them): the training side
    from the engine's accounting, the generation weights from ``plan.switch`` (experts split whole over
    ep_generate ranks, across rollout groups too), and a mixture of experts' gathered layer its largest."""
    v = _training_views(model, dims, tp_generate > 1 and dims.fsdp_only)
    return dataclasses.replace(
        v,
        generate_view=str(GenerateSplit(dims.world, tp_generate, ep_generate)),
        generation_bytes=generation_bytes(model, dims.world, tp_generate, ep_generate),
        layer_bytes=gathered_layer_bytes(model, dims) if is_moe(model.config) else v.layer_bytes,
    )


@functools.lru_cache(maxsize=64)
def _training_views(model: torch.nn.Module, dims: ParallelDims, by_columns: bool) -> ViewMemory:
    """The engine's training figures of ``dims``. They depend on the generation view only where FSDP2 alone
    shards row-parallel weights on dim 1 for a tensor-parallel rollout (``by_columns``: any tp > 1 alike), so
    one call serves every generation view (the engine's accounting is the plan's slowest part)."""
    return view_memory(model, dims, 2 if by_columns else 1, switch=False)


_LAYER = re.compile(r"\.(?:layers|h)\.(\d+)\.")


@functools.lru_cache(maxsize=64)
def gathered_layer_bytes(model: torch.nn.Module, dims: ParallelDims, compute_bytes: int = 2) -> int:
    """The largest decoder layer as FSDP2 gathers it for a forward or backward, in the compute dtype: the
    rank's tensor-parallel piece of the attention (and of a dense MLP), a sparse block's router and shared
    expert whole (MoE blocks train whole on every tp rank) and its ep rank's E / ep whole experts. A mixture
    of experts' first layer may be dense (DeepSeek-V3) and a sparse one far larger: the largest counts."""
    config = text_config(model.config)
    family = family_of(model.config) if has_shard_rules(model.config) else None
    layers: dict[int, int] = {}
    for name, p in model.named_parameters():
        found = _LAYER.search(name)
        if found is None:
            continue
        kind = trained_kind(config, name, sliced_kind(name, family))
        if kind == "experts" and dims.ep > 1:
            elements = -(-p.shape[0] // dims.ep) * (p.numel() // p.shape[0])
        elif kind in ("column", "kv", "row") and dims.tp > 1:
            elements = p.numel() // dims.tp
        else:
            elements = p.numel()
        layers[int(found.group(1))] = layers.get(int(found.group(1)), 0) + elements
    return max(layers.values(), default=0) * compute_bytes


@functools.lru_cache(maxsize=16)
def _lora_elements(model: torch.nn.Module, spec: LoraSpec) -> tuple[int, int]:
    return lora_elements(list(decoder_of(model).layers), spec)


def lora_phases(
    cfg: Config, mc: Any, model: torch.nn.Module, layout: Layout, v: ViewMemory
) -> dict[str, int]:
    """Bytes per GPU of each phase with LoRA (``model.lora_rank``): the base frozen in bf16 (no masters,
    gradients or moments), the adapters' float32 masters, gradients and AdamW moments sharded over the ranks,
    no reference copy (the reference is the base); the rollout's merge buffers (bf16 adapted projections) at
    one rank, its generation shard above."""
    m = cfg.model
    adapters, adapted = _lora_elements(model, LoraSpec(m.lora_rank, m.lora_alpha, tuple(m.target_modules)))
    held, mine = v.held_elements, -(-adapters // layout.world)
    base, opt = held * 2, mine * (MASTER_BYTES + (0 if layout.optimizer_offload else MOMENT_BYTES))
    # The base is gathered one layer at a time (a frozen layer is freed after its forward, even at one rank),
    # and the root (embeddings, norm, head) for the whole pass.
    root = held * 2 - -(-mc.num_hidden_layers // layout.pp) * v.layer_bytes
    gathered = 2 * v.layer_bytes + root
    in_place = cfg.rollout.lora_merge == "in_place"  # one rank: merged into the base's storage, no buffers
    generation = (0 if in_place else adapted * 2) if layout.world == 1 else v.generation_bytes
    state = mine * (MASTER_BYTES + GRAD_BYTES + MOMENT_BYTES)
    what = f"LoRA r={m.lora_rank}: fp32 adapters, grads, AdamW moments; base {base / 1e9:.2f} GB bf16"
    layout.state = (state, what, mine, adapted * 2 if in_place else 0)  # in_place: the base's host copy
    return {
        "generate": base + opt + generation + _kv_bytes(cfg, mc, layout),
        "log_prob": base + opt + gathered + _activation_bytes(cfg, mc, layout, backward=False),
        "update_actor": base + state + gathered + _activation_bytes(cfg, mc, layout, True),
    }


@functools.lru_cache(maxsize=16)
def _tower_elements(model: torch.nn.Module, world: int) -> int:
    """The vision tower's elements the largest rank holds: FSDP2 over every rank (a VLM trains on FSDP2 alone)
    chunks each parameter's dim 0, the first chunk the largest (0 for a text model)."""
    tower = vision_tower(model)
    if tower is None:
        return 0
    return sum(
        -(-p.shape[0] // world) * (p.numel() // p.shape[0]) if p.dim() else 1 for p in tower.parameters()
    )


def estimate_phases(cfg: Config, mc: Any, model: torch.nn.Module, layout: Layout) -> dict[str, int]:
    """Bytes per GPU of each phase of a step under ``layout`` (the actor; a colocated reference added)."""
    mc = text_config(mc)
    v = _views(
        model, layout.dims(with_sp=False), layout.tp_generate, layout.ep_generate or 1
    )  # sp: no change
    layout.views, layout.params = v, v.full_elements
    if cfg.model.lora_rank > 0:
        return lora_phases(cfg, mc, model, layout, v)
    held = v.held_elements
    layout.frozen = _tower_elements(model, layout.world) if cfg.model.freeze_vision_tower else 0
    trained = held - layout.frozen  # a frozen tower keeps its compute dtype (bf16), trains nothing
    masters = trained * MASTER_BYTES + layout.frozen * 2
    moments, grads = trained * MOMENT_BYTES, trained * GRAD_BYTES
    ref = held * 2 if cfg.use_reference and not cfg.ref.fsdp.param_offload else 0
    # At one rank FSDP2 keeps the bf16 layers gathered through the micro-batches; above, two layers at once.
    gathered = held * 2 if layout.world == 1 else 2 * v.layer_bytes
    if layout.world == 1:
        generation = held * 2  # the rollout reads a bf16 cast of the masters
    else:
        generation = v.generation_bytes
    if layout.value(cfg, "actor.fsdp.optimizer_step_on_cpu"):
        # The device holds the compute-dtype (bf16) shards and their gradients; the float32 masters and the
        # moments are on the host. At one rank those shards are also the rollout's weights, each layer is
        # gathered only while it computes (``TrainEngine``), and the micro-batches' gradients accumulate
        # unsharded in the float32 reduce dtype (deferred sync; measured on the H200 with Qwen2-7B).
        weights, grads = held * 2, trained * (4 if layout.world == 1 and not layout.param_offload else 2)
        if layout.world == 1:  # two layers gathered at a time, and the root (embeddings, head) kept gathered
            root = held * 2 - mc.num_hidden_layers * v.layer_bytes
            gathered, generation = 2 * v.layer_bytes + root, 0
        return {
            "generate": weights + ref + generation + _kv_bytes(cfg, mc, layout),
            "log_prob": weights + ref + gathered + _activation_bytes(cfg, mc, layout, backward=False),
            "update_actor": weights + grads + ref + gathered + _activation_bytes(cfg, mc, layout, True),
        }
    resident = (0 if layout.param_offload else masters) + (0 if layout.optimizer_offload else moments)
    return {
        "generate": resident + ref + generation + _kv_bytes(cfg, mc, layout),
        "log_prob": masters + (0 if layout.optimizer_offload else moments) + ref + gathered
        + _activation_bytes(cfg, mc, layout, backward=False),
        "update_actor": masters + moments + grads + ref + gathered + _activation_bytes(cfg, mc, layout, True),
    }  # fmt: skip


# Host bytes per held parameter element: parameter offload keeps the float32 masters (4), optimizer offload
# the AdamW moments (8); the CPU step the masters, the moments and one pinned compute-dtype staging buffer
# that carries the gradients down and the new weights up (4 + 8 + 2; engine/train/cpu_step.py).
HOST_BYTES = {"param_offload": 4, "optimizer_offload": 8, "cpu_step": 14}


def host_bytes(cfg: Config, layout: Layout) -> int:
    """Host memory of one node the layout's offload or CPU step holds (its GPUs' shares together)."""
    per_element = HOST_BYTES["param_offload"] * bool(layout.param_offload)
    per_element += HOST_BYTES["optimizer_offload"] * bool(layout.optimizer_offload)
    per_element += HOST_BYTES["cpu_step"] * bool(layout.value(cfg, "actor.fsdp.optimizer_step_on_cpu"))
    gpus = min(cfg.trainer.n_gpus_per_node, layout.world)
    if (
        layout.state is None
    ):  # a frozen vision tower: its bf16 weights offloaded with the parameters, no state
        frozen = 2 * layout.frozen * bool(layout.param_offload)
        return (per_element * (layout.views.held_elements - layout.frozen) + frozen) * gpus
    _, _, adapters, host = layout.state  # LoRA: the adapters' state, and in_place's copy of the base
    return per_element * adapters * gpus + host * gpus


def host_memory_bytes() -> int | None:
    """This machine's host memory (physical pages), or None where the OS does not say."""
    import os

    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def gpus_here() -> int:
    """How many GPUs this machine has (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def gpu_memory_bytes(cap_gb: float | None = None) -> int | None:
    """This machine's GPU memory (the first device), at most ``cap_gb`` GB (``trainer.gpu_memory_gb``); None
    without CUDA."""
    if not torch.cuda.is_available():
        return None
    total = int(torch.cuda.get_device_properties(0).total_memory)
    return total if cap_gb is None else min(total, int(cap_gb * 1e9))
