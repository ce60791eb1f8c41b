"""How the rollout runner holds a Hugging Face module's weights: by reference, or cast into buffers it refreshes.

Where a parameter already has the generation dtype and device the runner reads the parameter's own tensor
(zero copies; q/k/v and gate/up re-laid out in place as one buffer on CUDA, ``weights.join_in_place``).
Otherwise each weight is cast once into a buffer (q/k/v and gate/up fused: the cast copies anyway), and
``refresh()`` copies the current values in place after every optimizer step. Between generations
``release()`` frees the buffers' storage, so training never holds them beside FSDP2's own compute-dtype
parameters; the next ``refresh()`` allocates it again.

A sparse (mixture-of-experts) layer binds its router, its fused experts (E, 2I, H) and (E, H, I) and Qwen2-MoE's
shared expert the same way; HF's sparse block and the trainer's ``MoEBlock`` have the same attribute names.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from hybridflow.engine.ops.fp8 import FP8, Fp8Weight
from hybridflow.engine.ops.invariant import exact_on
from hybridflow.engine.ops.tensors import Storages
from hybridflow.engine.parallel.fsdp import reshard_fsdp
from hybridflow.engine.rollout.blocks import LayerDims, LayerWeights, MoEWeights
from hybridflow.engine.rollout.expert_exchange import ExpertExchange
from hybridflow.engine.rollout.support import text_base
from hybridflow.engine.rollout.weights import join_in_place, local_tensor
from hybridflow.models.moe import grouped_experts, grouped_mm_fits, is_sparse_block, loop_experts, router_spec
from hybridflow.models.vision import text_config

logger = logging.getLogger(__name__)


def _fill(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)``, casting on ``dst``'s device when ``src`` is an offloaded host tensor.

    A cross-device copy that also changes dtype converts on the host first (float32 -> bfloat16 through a
    pageable temporary); moving the float32 tensor over as it is, a DMA from pinned memory, then casting on
    the GPU is faster (0.5B actor offloaded, W1: see ``benchmarks/RESULTS.md``, tenth session).
    """
    if src.device != dst.device:
        src = src.to(dst.device, non_blocking=True)  # ordered on the stream before the cast below
    dst.copy_(src)


def _read(module: nn.Module, name: str) -> torch.Tensor:
    """The value the runner generates with for ``module.name``: the module's ``generation_tensor`` where it
    defines one (a LoRA linear: W + (alpha / r) B A, computed fresh), else the parameter's local tensor."""
    if _computed(module):
        return module.generation_tensor(name)
    return local_tensor(getattr(module, name))


def _computed(module: nn.Module) -> bool:
    """Whether ``module``'s weights are computed for generation (never bound by reference): a LoRA linear
    unless its merge is written into the base's own storage (``InPlaceMerge``)."""
    return getattr(module, "computed_for_generation", False)


class WeightBinding:
    """The weights of a Llama-family HF causal LM as the runner's forward reads them (see the module doc).

    ``embed``, ``layers`` (one ``LayerWeights`` each), ``norm`` and ``lm_head`` are bound tensors;
    ``inv_freq`` and ``attention_scaling`` the module's own rotary tables. ``dims`` checks the projections.
    """

    def __init__(
        self,
        hf_model: nn.Module,
        dtype: torch.dtype,
        device: torch.device,
        dims: LayerDims,
        expert_rank: int = 0,
        exchange: ExpertExchange | None = None,
    ) -> None:
        """``expert_rank``: this rank's place in an expert-parallel rollout, whose sparse blocks hold
        E / size whole experts each (``tp.split_experts``): it holds experts expert_rank * E / size onward.
        ``exchange``: those experts serve the tokens of several rollout groups (ep > tp), pooled at each layer."""
        self._model = hf_model
        self.dtype, self.device, self.dims = dtype, device, dims
        self.expert_rank, self.exchange = expert_rank, exchange
        self.bind()

    def _bind(self, parts: list[tuple[nn.Module, str]], fuse: bool | None = None) -> list[torch.Tensor]:
        """Bind parameters given as (module, name): by reference if dtype and device match, else by a cast.

        ``fuse=None`` fuses the group into one buffer when it must be copied anyway, or, for plain CUDA
        tensors already in the runner's dtype, by re-laying them out in place (``weights.join_in_place``); True
        always fuses (the biases of a fused weight group); False never fuses. Tied parameters (the same
        object) are bound once.
        """
        params = [getattr(m, n) for m, n in parts]
        key = (fuse, tuple(id(p) for p in params))
        if key not in self._memo and params[0].dtype == FP8:  # delivered in FP8 by the switch, with scales
            self._memo[key] = self._bind_fp8(params, parts, fuse)
        if key not in self._memo:
            srcs = [_read(m, n) for m, n in parts]
            cast = any(s.dtype != self.dtype or s.device != self.device for s in srcs)
            cast = cast or any(_computed(m) for m, _ in parts)  # a merge buffer per projection
            joined = None
            if not cast and fuse is not False and len(params) > 1:
                joined = join_in_place(params)
            if joined is not None:
                self._aliases += [(local_tensor(p), m, n) for p, (m, n) in zip(params, parts)]
                self._memo[key] = [joined]
            elif fuse or (fuse is None and cast):
                self._memo[key] = [self._alloc(srcs, parts)]
            elif cast:
                self._memo[key] = [self._alloc([s], [part]) for s, part in zip(srcs, parts)]
            else:
                self._aliases += [(s, m, n) for s, (m, n) in zip(srcs, parts)]
                self._memo[key] = srcs
        return self._memo[key]

    def _bind_fp8(
        self, params: list[torch.Tensor], parts: list[tuple[nn.Module, str]], fuse: bool | None
    ) -> list[Fp8Weight]:
        """A group the switch delivers in FP8, bound by reference with its rows' scales. On CUDA the group
        (q/k/v, gate/up) is re-laid out in place as one weight and one scale vector (``join_in_place``), so it
        is one FP8 GEMM: rowwise scales belong to output rows, so joining is exact. Separate, an H200 ran seven
        small FP8 GEMMs a layer at ~7.5 us each, which made FP8 decode slower than bf16's fused GEMMs."""
        # One static activation scale per group: its projections read one input (q/k/v, gate/up).
        act = torch.ones(1, dtype=torch.float32, device=self.device)
        self.act_scales.append(act)
        scales = [m.weight_scale for m, _ in parts]
        # On CPU too (unlike bf16's, whose join is for speed only): the tests then run the path CUDA runs.
        joined = join_in_place(params, cuda_only=False) if fuse is not False and len(params) > 1 else None
        joined_scale = join_in_place(scales, cuda_only=False) if joined is not None else None
        self._aliases += [(local_tensor(p), m, n) for p, (m, n) in zip(params, parts)]
        if joined is not None and joined_scale is not None:
            return [Fp8Weight(joined, joined_scale, act)]
        return [Fp8Weight(local_tensor(p), sc, act) for p, sc in zip(params, scales)]

    def _alloc(self, srcs: list[torch.Tensor], parts: list[tuple[nn.Module, str]]) -> torch.Tensor:
        """One buffer holding ``srcs`` stacked on dim 0 in the runner's dtype; remembered for refresh()."""
        rows = [s.shape[0] for s in srcs]
        buf = torch.empty((sum(rows), *srcs[0].shape[1:]), dtype=self.dtype, device=self.device)
        self._buffers.append(buf)
        for view, src, (module, name) in zip(buf.split(rows), srcs, parts):
            _fill(view, src)
            self._copies.append((view, module, name))
        return buf

    def _bind_moe(self, mlp: nn.Module) -> MoEWeights:
        """Bind a sparse block (HF's or ``MoEBlock``): router, fused experts, the shared expert if any."""
        spec = router_spec(text_config(self._model.config))
        router = self._bind([(mlp.gate, "weight")])[0]
        gate_up = self._bind([(mlp.experts, "gate_up_proj")])[0]
        down = self._bind([(mlp.experts, "down_proj")])[0]
        e, two_i, hidden = gate_up.shape
        if router.shape != (spec.num_experts, hidden) or down.shape != (e, hidden, two_i // 2):
            raise ValueError(
                f"router {tuple(router.shape)}, experts {tuple(gate_up.shape)} and {tuple(down.shape)} do not "
                f"match {spec.num_experts} experts of the config"
            )
        moe = MoEWeights(spec, self._sparse, router, gate_up, down)
        x = torch.empty(0, hidden, dtype=self.dtype, device=self.device)  # what the forward will feed
        fits = grouped_mm_fits(x, gate_up, down) and gate_up.dtype == self.dtype
        # run_experts' choice, made once; exact mode's loop runs each expert's rows through the exact matmul
        moe.experts = grouped_experts if fits and not exact_on() else loop_experts
        if e < spec.num_experts:  # an expert-parallel rollout rank: its whole experts, one block of them
            moe.experts = functools.partial(moe.experts, offset=self.expert_rank * e)
        if self.exchange is not None:  # ep > tp: this rank's experts run on the exchange's pooled rows
            moe.experts = self.exchange.wrap(moe.experts)
        self._sparse += 1
        shared = getattr(mlp, "shared_expert", None)
        if shared is not None:
            moe.shared_gate_up = self._bind([(shared.gate_proj, "weight"), (shared.up_proj, "weight")])
            moe.shared_down = self._bind([(shared.down_proj, "weight")])[0]
            moe.shared_gate = self._bind([(mlp.shared_expert_gate, "weight")])[0]
            moe.shared_splits = (moe.shared_down.shape[1],) * 2
        return moe

    def _bind_layer(self, layer: nn.Module) -> LayerWeights:
        """Bind one decoder layer, checking the projection shapes against the config."""
        attn, mlp = layer.self_attn, layer.mlp
        qkv_mods = [attn.q_proj, attn.k_proj, attn.v_proj]
        sparse = is_sparse_block(mlp)
        dense = [] if sparse else [mlp.gate_proj, mlp.up_proj]
        rows = [local_tensor(m.weight).shape[0] for m in [*qkv_mods, *dense]]
        want = [*self.dims.qkv_splits, *([] if sparse else self.dims.mlp_splits)]
        if rows != want:
            raise ValueError(f"q/k/v/gate/up projections have {rows} rows; the config implies {want}")
        qkv = self._bind([(m, "weight") for m in qkv_mods])
        if sparse:
            return self._layer(layer, qkv, [], self._bind_moe(mlp))
        return self._layer(layer, qkv, self._bind([(mlp.gate_proj, "weight"), (mlp.up_proj, "weight")]))

    def _layer(
        self,
        layer: nn.Module,
        qkv: list[torch.Tensor],
        gate_up: list[torch.Tensor],
        moe: MoEWeights | None = None,
    ) -> LayerWeights:
        """The layer's ``LayerWeights`` around its bound q/k/v and MLP (dense gate/up, or ``moe``)."""
        attn, mlp = layer.self_attn, layer.mlp
        qkv_mods = [attn.q_proj, attn.k_proj, attn.v_proj]

        def bias(mods: list[nn.Module], fused: bool) -> list[torch.Tensor] | None:
            if getattr(mods[0], "bias", None) is None:
                return None
            # A fused weight needs a fused bias; otherwise each bias is bound alone (alias or cast).
            return self._bind([(m, "bias") for m in mods], fuse=fused)

        q_norm = getattr(attn, "q_norm", None)
        k_norm = getattr(attn, "k_norm", None)
        return LayerWeights(
            input_norm=self._bind([(layer.input_layernorm, "weight")])[0],
            qkv=qkv,
            qkv_bias=bias(qkv_mods, len(qkv) == 1),
            q_norm=None if q_norm is None else self._bind([(q_norm, "weight")])[0],
            k_norm=None if k_norm is None else self._bind([(k_norm, "weight")])[0],
            o=self._bind([(attn.o_proj, "weight")]),
            o_bias=bias([attn.o_proj], False),
            post_norm=self._bind([(layer.post_attention_layernorm, "weight")])[0],
            gate_up=gate_up,
            gate_up_bias=None if moe else bias([mlp.gate_proj, mlp.up_proj], len(gate_up) == 1),
            down=[] if moe else self._bind([(mlp.down_proj, "weight")]),
            down_bias=None if moe else bias([mlp.down_proj], False),
            moe=moe,
        )

    @torch.no_grad()
    def bind(self) -> None:
        """(Re)bind every weight; allocates the cast buffers."""
        reshard_fsdp(self._model)
        self._memo: dict[tuple, list[torch.Tensor]] = {}
        self._aliases: list[tuple[torch.Tensor, nn.Module, str]] = []  # zero-copy: (tensor, module, name)
        self._copies: list[tuple[torch.Tensor, nn.Module, str]] = []  # cast buffers: (view, module, name)
        self._buffers: list[torch.Tensor] = []  # the cast buffers themselves (release() frees their storage)
        # FP8 projections' static activation scales (``Fp8Weight.act_scale``), one per input, never released
        # (4 bytes each); ``act_calibrated``: set by a calibrating prefill (``LlamaRunner.prefill_paged``).
        self.act_scales: list[torch.Tensor] = []
        self.act_calibrated = False
        base = text_base(self._model)  # a vision-language model's language model
        self._sparse = 0  # sparse layers bound so far
        self.embed = self._bind([(base.embed_tokens, "weight")])[0]
        self.layers = [self._bind_layer(layer) for layer in base.layers]
        self.num_sparse = self._sparse  # the mixture-of-experts layers, in order
        self.norm = self._bind([(base.norm, "weight")])[0]
        # Tied embeddings: lm_head.weight is the embedding Parameter, so the memo returns the same tensor.
        self.lm_head = self._bind([(self._model.lm_head, "weight")])[0]
        rotary = base.rotary_emb
        # The module's own inv_freq and attention_scaling carry the rope scaling (llama3, yarn, linear).
        self.inv_freq = rotary.inv_freq.detach().to(self.device, torch.float32).clone()  # (D/2,)
        self.attention_scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self._storages = Storages(self._buffers)  # release() frees them between generations
        if self.inv_freq.numel() * 2 != self.dims.head_dim:
            raise ValueError(f"rotary dim {self.inv_freq.numel() * 2} != head_dim {self.dims.head_dim}")

    @torch.no_grad()
    def refresh(self) -> bool:
        """Copy the module's current weights into the cast buffers in place (re-allocated if released).

        Returns True when parameter storage moved (offload/reload, FSDP re-initialisation) so the runner
        had to rebind: tensor addresses changed and any captured CUDA graph must be re-captured.
        """
        reshard_fsdp(self._model)
        if any(local_tensor(getattr(m, n)).data_ptr() != t.data_ptr() for t, m, n in self._aliases):
            logger.info("model parameters moved since the runner bound them; rebinding")
            self.bind()
            return True
        self._storages.restore()  # released after the last generate: allocate again (views stay valid)
        same_device: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for dst, module, name in self._copies:
            if _computed(module):  # merged one projection at a time: never every merge alive at once
                dst.copy_(_read(module, name))
                continue
            src = local_tensor(getattr(module, name))
            if src.device != dst.device:
                _fill(dst, src)  # an offloaded host shard: over to the device first, cast there
                continue
            dsts, srcs = same_device.setdefault((src.dtype, src.device), ([], []))
            dsts.append(dst)
            srcs.append(src)
        for dsts, srcs in same_device.values():
            # One multi-tensor copy (it casts too) instead of a launch per weight: 0.5B, 290 weights, on an
            # H200: 0.9 ms against 2.6 ms.
            torch._foreach_copy_(dsts, srcs)
        return False

    def release(self) -> int:
        """Free the cast buffers' memory until the next ``refresh()``; returns the bytes freed.

        The buffers are a rendering of the module's weights in the generation dtype, re-filled by every
        ``refresh()``, so between generations they are dead weight: at the update's peak they would be a
        second copy of the actor beside FSDP2's own compute-dtype parameters. Their tensors (and every view of
        them) stay valid objects; only the storage goes, as FSDP2 does with its unsharded parameters. Weights
        bound by reference are the module's own and are never touched. Any CUDA graph captured on the
        buffers must be dropped first (the engine captures its graphs per call).
        """
        return self._storages.release()

    def pending_bytes(self) -> int:
        """Bytes the next ``refresh()`` allocates: the cast buffers released since the last one."""
        return self._storages.released_bytes()

    def weight_tensors(self) -> list[torch.Tensor]:
        """Every distinct tensor the forward reads (for checks: data pointers, memory)."""
        seen: dict[int, torch.Tensor] = {}
        for tensors in self._memo.values():
            for t in tensors:
                for part in (t.data, t.scale, t.act_scale) if isinstance(t, Fp8Weight) else (t,):
                    if part is None:
                        continue
                    seen.setdefault(id(part), part)
        return list(seen.values())
