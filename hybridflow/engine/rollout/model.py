"""A Llama-family forward (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, and the mixtures of experts Qwen2-MoE,
Qwen3-MoE and Mixtral) that runs on a Hugging Face module's weights.

The runner loads nothing of its own: it binds the HF module's parameters by reference (``binding``), so the
rollout engine generates with exactly the weights the trainer holds; where the generation dtype differs from
the parameters' they are cast into buffers that ``refresh()`` fills in place and ``release()`` frees between
generations.

The math follows transformers' modeling_llama / modeling_qwen2 / modeling_qwen3 op for op (the layer's
pieces around attention are in ``blocks``): RoPE tables computed in float32 from the module's own
``rotary_emb`` (which carries rope scaling such as llama3's or yarn's ``attention_scaling``) and cast to the
compute dtype, attention through SDPA with ``enable_gqa=True`` so K/V are never repeated. Prefill and decode
run over the paged KV cache (``forward``).
Decode attention on CUDA in bf16/fp16 uses the split-K Triton kernel of ``decode_attention`` instead, which
reads each sequence's blocks only up to its own position and also applies RoPE and writes the step's k and v.

A sparse layer routes with ``hybridflow.models.moe`` (``blocks.moe_mlp``). With a routing store on the paged
cache (``PagedKVCache.routing``) prefill and decode write each token's experts beside its K and V, in its block
at its offset (``write_routing``), inside the step: no host sync, graph-safe.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow.engine.ops.invariant import exact_on, rope_table
from hybridflow.engine.rollout import blocks
from hybridflow.engine.rollout.binding import WeightBinding
from hybridflow.engine.rollout.blocks import ActQuant, KSplits, LayerDims, LayerWeights
from hybridflow.engine.rollout.expert_exchange import ExpertExchange, check_device, serve_layers
from hybridflow.engine.rollout.forward import PagedForward, Sink
from hybridflow.engine.rollout.support import check_structure, check_supported, text_base
from hybridflow.engine.rollout.tp import RolloutTP
from hybridflow.engine.rollout.weights import local_tensor
from hybridflow.models.moe import grouped_experts, router_spec
from hybridflow.models.vision import is_vision_language, text_config

logger = logging.getLogger(__name__)

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _pick_decode_attention(device: torch.device, dtype: torch.dtype) -> str:
    """Decode attention backend: triton when the kernel can run (CUDA, bf16/fp16, triton imports), else sdpa."""
    fits = device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
    return "triton" if fits and _decode_kernel_available() else "sdpa"


def _decode_kernel_available() -> bool:
    """Whether triton imports; importing the module registers the op (lazily: CPU runs never load it)."""
    from hybridflow.engine.rollout import decode_attention

    return decode_attention.available()


class LlamaRunner(PagedForward):
    """Prefill and decode for a Llama-family HF causal LM, on its own parameters, over a paged KV cache.

    Weights: when a parameter already has the generation ``dtype`` the runner uses the parameter's tensor
    itself (zero copies). Otherwise it casts into buffers made once here; q/k/v and gate/up are then fused
    into one buffer each (the cast copies anyway, so fusing is free and saves two GEMM launches per layer),
    while the zero-copy path keeps them separate (fusing there would cost a full weight copy). Call
    ``refresh()`` after every optimizer step, before generating.
    """

    def __init__(
        self,
        hf_model: nn.Module,
        dtype: torch.dtype | None = None,
        max_len: int | None = None,
        device: torch.device | None = None,
        tp: RolloutTP | None = None,
        ep: ExpertExchange | None = None,
    ) -> None:
        """``tp``: ``hf_model`` is this rank's tensor-parallel shard (``engine.rollout.tp``), and
        the runner adds the group's collectives: vocabulary-parallel embedding and logits, and an all-reduce
        after the o and down projections. ``ep``: its experts are split across rollout groups (ep > tp), whose
        tokens meet at every MoE layer (``expert_exchange``); ``settle()`` after the work."""
        check_supported(hf_model.config, max_len)
        check_structure(hf_model)
        # A vision-language model: the language model's config and layers; the vision tower runs at prefill.
        config = text_config(hf_model.config)
        self.tp, self.ep = tp, ep
        self.visual = hf_model.model.visual if is_vision_language(hf_model.config) else None
        self.image_token_id = None if self.visual is None else int(hf_model.config.image_token_id)
        self.merge_size = None if self.visual is None else int(self.visual.spatial_merge_size)
        rope = getattr(config, "rope_parameters", None) or {}
        # M-RoPE's (time, height, width) split of the rotary pairs: prefill picks each pair's row of the
        # (3, b, t) positions; decode is plain RoPE at index + delta.
        self.mrope_section = list(rope["mrope_section"]) if self.visual is not None else None
        self.config = config
        self._model = hf_model
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.vocab_size = config.vocab_size if tp is None else tp.vocab_size  # the whole vocabulary
        self.max_position_embeddings = config.max_position_embeddings
        self.eps = config.rms_norm_eps
        self.scaling = self.head_dim**-0.5
        embed = local_tensor(text_base(hf_model).embed_tokens.weight)
        self.dtype = embed.dtype if dtype is None else dtype
        # The model's own device unless told: a trainer whose parameters are offloaded between phases
        # (fsdp.param_offload) generates on its GPU from cast buffers filled from the host copies.
        self.device = embed.device if device is None else torch.device(device)
        self.decode_attention = _pick_decode_attention(self.device, self.dtype)
        # False: prefill/decode return logits in the compute dtype, for a consumer that upcasts as it reads
        # (the rollout engine's fused sampler); saves a float32 copy of (B, V) per step.
        self.float_logits = True
        self._prefill_paged_layers = self._prefill_paged_hidden  # compile_prefill() swaps in a compiled one
        self.dims = LayerDims(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.eps,
            qkv_splits=tuple(
                d * self.head_dim for d in (self.num_heads, self.num_kv_heads, self.num_kv_heads)
            ),
            mlp_splits=(config.intermediate_size,) * 2,
        )
        expert_rank = ep.expert_rank if ep is not None else 0 if tp is None else tp.rank
        if ep is not None:
            check_device(self.device, 1 if tp is None else tp.size)
        self.weights = WeightBinding(hf_model, self.dtype, self.device, self.dims, expert_rank, ep)
        self.act_pending = False  # the next paged prefill calibrates the static activation scales
        self.router = router_spec(config)  # None: dense
        # Decode's projections as batched GEMMs over slices of K whose float32 partials the next fused kernel
        # sums (blocks.split_linear); all 1 leaves them to cuBLAS. Worth it only under torch.compile.
        self.k_splits = KSplits()

    # ---- weights (``binding.WeightBinding``) -----------------------------------------------------------

    @property
    def embed(self) -> torch.Tensor:
        """The bound embedding (V, hidden), or this rank's vocabulary slice."""
        return self.weights.embed

    @property
    def layers(self) -> list[LayerWeights]:
        """Each decoder layer's bound weights."""
        return self.weights.layers

    @property
    def norm(self) -> torch.Tensor:
        """The final norm's weight."""
        return self.weights.norm

    @property
    def lm_head(self) -> torch.Tensor:
        """The LM head (the embedding itself when tied)."""
        return self.weights.lm_head

    @property
    def routing_shape(self) -> tuple[int, int] | None:
        """(sparse layers, experts per token) of a mixture of experts (its routing records), None if dense."""
        return None if self.router is None else (self.weights.num_sparse, self.router.top_k)

    @property
    def graph_safe(self) -> bool:
        """Whether a decode step has fixed shapes and no host sync (CUDA graphs): dense, or experts run as
        grouped GEMMs here (``moe.grouped_mm_fits``: CPU, or CUDA bf16 on SM90+; else the loop over experts)."""
        fns = (getattr(w.moe.experts, "func", w.moe.experts) for w in self.layers if w.moe is not None)
        return all(fn is grouped_experts for fn in fns)  # a partial: an expert-parallel rank's experts

    def settle(self) -> int:
        """After this rank's work: serve the other rollout groups' MoE layers with no tokens until every group
        of the expert group is done (``ExpertExchange.settle``; nothing without an exchange). Rounds served."""
        if self.ep is None:
            return 0
        layers = [w.moe for w in self.layers if w.moe is not None]
        serve = serve_layers(self.ep, layers, self.config.hidden_size, self.dtype, self.device)
        return self.ep.settle(serve, len(layers))

    def refresh(self) -> bool:
        """Copy the module's current weights into the cast buffers (``WeightBinding.refresh``); True when the
        parameters moved and the runner rebound them (any captured CUDA graph must be re-captured)."""
        return self.weights.refresh()

    def calibrate_activations(self) -> None:
        """Have the next paged prefill set the FP8 projections' static activation scales from its tokens (in
        place), as after every weight refresh; a no-op without FP8 weights."""
        self.act_pending = bool(self.weights.act_scales)

    def release(self) -> int:
        """Free the cast buffers until the next ``refresh()``; returns the bytes freed."""
        return self.weights.release()

    def pending_bytes(self) -> int:
        """Bytes the next ``refresh()`` allocates."""
        return self.weights.pending_bytes()

    def weight_tensors(self) -> list[torch.Tensor]:
        """Every distinct tensor the forward reads (for checks: data pointers, memory)."""
        return self.weights.weight_tensors()

    @property
    def decode_attention(self) -> str:
        """Decode attention backend: "triton" (the split-K kernel, reads each row up to its position) or "sdpa".

        "sdpa" gathers each row's blocks and runs masked SDPA over them (CPU, float32, or no triton). Settable,
        so benchmarks and tests can compare the two on one runner.
        """
        return self._decode_attention

    @decode_attention.setter
    def decode_attention(self, backend: str) -> None:
        if backend not in ("triton", "sdpa"):
            raise ValueError(f"decode_attention must be 'triton' or 'sdpa', got {backend!r}")
        if backend == "triton" and not _decode_kernel_available():
            raise ValueError("decode_attention='triton' needs triton (pip install triton)")
        self._decode_attention = backend

    @property
    def k_splits(self) -> KSplits:
        """How decode splits its projections over K (``blocks.KSplits``); settable."""
        return self._decode_dims.k_splits

    @k_splits.setter
    def k_splits(self, value: KSplits) -> None:
        # Built here, not in the traced decode: dynamo (torch 2.11) cannot trace dataclasses.replace.
        self._decode_dims = dataclasses.replace(self.dims, k_splits=value)

    # ---- forward -------------------------------------------------------------------------------------

    def compile_prefill(self, backend: str | Callable = "inductor") -> None:
        """Run prefill's layers through ``torch.compile`` as one graph (GPU): fused elementwise chains, and one
        call from Python per chunk instead of dozens per layer.

        Shapes are left to dynamo's automatic dynamic: the first chunk shape compiles static, a second one
        recompiles with dynamic sizes, and later shapes reuse it. Decode is not affected (the engine compiles
        the whole decode step instead).
        """
        self._prefill_paged_layers = torch.compile(
            self._prefill_paged_hidden, fullgraph=True, backend=backend
        )

    def embed_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The (b, t, hidden) embeddings of (b, t) ids (a tensor-parallel rank's slice summed over the group)."""
        if self.tp is None:
            return F.embedding(input_ids, self.embed)
        return self.tp.embed(input_ids, self.embed)

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (b, 1, t, D) for (b, t) positions, exactly as HF: float32 angles, then the dtype.

        (3, b, t) positions are M-RoPE's: rotary pair j takes its angle from the row of its section (time,
        height, width), as HF's Qwen2.5-VL rotary embedding recomposes them."""
        if exact_on():  # one table for the trainer and the rollout (``invariant.rope_table``)
            cos, sin = rope_table(self.weights.inv_freq, self.weights.attention_scaling, self.max_position_embeddings)
            return cos[positions].to(self.dtype)[:, None], sin[positions].to(self.dtype)[:, None]
        freqs = positions[..., None].float() * self.weights.inv_freq  # (b, t, D/2) or (3, b, t, D/2)
        if positions.dim() == 3:
            parts = freqs.split(self.mrope_section, dim=-1)
            freqs = torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1)  # (b, t, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (b, t, D)
        cos = (emb.cos() * self.weights.attention_scaling).to(self.dtype)[:, None]  # (b, 1, t, D)
        sin = (emb.sin() * self.weights.attention_scaling).to(self.dtype)[:, None]
        return cos, sin

    def _forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attend: Attend,
        rope: bool = True,
        dims: LayerDims | None = None,
        sink: Sink | None = None,
        embeds: torch.Tensor | None = None,
        calib: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Embed (b, t) ids at (b, t) positions and run all layers; returns pre-norm hidden (b, t, hidden).

        Each layer is ``attention_inputs``, ``attend`` (writes the cache, runs attention), then
        ``attention_output_and_mlp`` (or ``attention_output_and_moe`` for a sparse layer, bound so: no
        branch on values). ``rope=False`` hands q and k to ``attend`` before RoPE (the fused decode kernel
        applies it); ``dims`` defaults to ``self.dims`` (decode passes its own); ``sink`` takes each
        sparse layer's chosen experts; ``embeds`` (b, t, hidden) replaces the embedding of ``input_ids``
        (a prompt's image features inserted, ``embed_ids``). Positions may be M-RoPE's (3, b, t).
        ``calib`` (b, t) bool: set the FP8 projections' static activation scales from these tokens; once set,
        later forwards quantise with them (``blocks.ActQuant``).
        """
        dims = self.dims if dims is None else dims
        h = self.embed_ids(input_ids) if embeds is None else embeds  # (b, t, hidden)
        reduce = None if self.tp is None else self.tp.reduce
        # A calibrating forward reads no calibration state (``calib`` first: short-circuited), so a compiled
        # prefill keeps one graph for it across sessions instead of a guard on act_calibrated recompiling it.
        static = calib is None and self.weights.act_calibrated
        act = ActQuant(static, calib, None if self.tp is None else self.tp.reduce_max)
        cos, sin = self._rope_tables(positions)
        for idx, w in enumerate(self.layers):
            q, k, v = blocks.attention_inputs(h, w, cos, sin, dims, rope, act)
            if w.moe is None:
                h = blocks.attention_output_and_mlp(h, attend(idx, q, k, v), w, dims, reduce, act)
                continue
            h, ids = blocks.attention_output_and_moe(h, attend(idx, q, k, v), w, dims, reduce, act)
            if sink is not None:
                sink(w.moe.index, ids)
        return h

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head on (b, hidden) -> logits (b, V): float32, or the compute dtype (float_logits)."""
        logits = F.linear(blocks.rms_norm(h, self.norm, self.eps), self.lm_head)  # (b, V) or (b, V / tp)
        if self.tp is not None:
            logits = self.tp.gather_logits(logits)  # (b, V), identical on every rank of the group
        return logits.float() if self.float_logits else logits
