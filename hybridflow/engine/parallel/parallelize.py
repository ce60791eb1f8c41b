"""``parallelize()``: a model laid out on its training view, every dimension applied in one fixed order.

As torchtitan's ``parallelize_llama`` does it, one function applies each dimension of the view
(``dims.ParallelDims``) to the model, in an order where each step sees what the one before left:

1. the pipeline split: the model cut down to this rank's stage (``pipeline.split_stage``), whose layers keep
   their names; stages run packed micro-batches; then LoRA (``lora.apply_lora``): the targeted linears
   wrapped, every base weight frozen;
2. the masters' dtype (float32 trained, the compute dtype frozen: a LoRA base too), cast while the weights
   are plain tensors: a tensor-parallel weight is a DTensor after the next step, which an in-place cast would
   not reach;
3. tensor parallelism: each decoder layer's projections split over the ``tp`` mesh (``tp.apply_tp``);
4. expert parallelism: each MoE block's experts split over the ``ep`` mesh, tokens dispatched to them by
   all-to-all (``ep.apply_ep``);
5. Ulysses: the attention modules and the scoring root's input and output hooked to the ``sp`` group
   (``ulysses.apply_ulysses``; the model must already run the packed attention);
6. per-layer ``torch.compile`` (on CUDA by default), in place, so FSDP2 still finds the layers;
7. FSDP2 over the view's data-parallel ranks (every rank under FSDP2 alone and Ulysses), with mixed
   precision: the compute and reduce dtypes (``fsdp.shard_model``); the experts of an expert-parallel view
   over the ranks holding the same experts (``dp_rep``).

A pipelined view then gets its tied head's gradient pair (``pipeline.TiedWeights``). What comes back
(``Parallelized``) is what a ``train.TrainEngine`` is built on; a new parallel dimension is a new step here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from hybridflow.config.schema import FSDPConfig
from hybridflow.engine.ops.dtypes import to_dtype
from hybridflow.engine.ops.modules import decoder_layers
from hybridflow.engine.ops.packed_attention import use_packed_attention
from hybridflow.engine.parallel.dims import ParallelDims
from hybridflow.engine.parallel.ep import apply_ep
from hybridflow.engine.parallel.fsdp import shard_model
from hybridflow.engine.parallel.lora import LoraSpec, apply_lora
from hybridflow.engine.parallel.pipeline import (
    StageScorer,
    TiedWeights,
    check_train_pp,
    split_stage,
    ties_head,
)
from hybridflow.engine.parallel.tp import apply_tp
from hybridflow.engine.parallel.ulysses import apply_ulysses
from hybridflow.models.vision_tower import vision_units
from hybridflow.utils.device import cuda_in_use
from hybridflow.utils.dist import init_distributed, world_size


@dataclass(frozen=True)
class Stage:
    """This rank's pipeline stage, and whether the whole model tied its head (the split hides it)."""

    index: int
    tied_head: bool


@dataclass
class Parallelized:
    """A model laid out on its view: the sharded root and what the training engine and the roles need."""

    module: nn.Module  # the FSDP2-sharded root (the scorer around the model, or its pipeline stage)
    dims: ParallelDims  # with its process groups
    device: torch.device
    compute_dtype: torch.dtype
    compiled: bool
    stage: Stage | None = None  # this rank's pipeline stage (None: one stage)
    tied: TiedWeights | None = None  # a pipeline's tied head


def default_device() -> torch.device:
    """This rank's CUDA device when it computes on CUDA (``trainer.device``), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if cuda_in_use() else torch.device("cpu")


def compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """Resolve ``fsdp.param_dtype``: 'auto' is bfloat16 on GPU and float32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return to_dtype(name)


def master_dtype(name: str, trainable: bool, compute: torch.dtype) -> torch.dtype:
    """Resolve ``fsdp.master_dtype``: 'auto' is float32 for a trained module and the compute dtype for a
    frozen one (the reference). A frozen module in bf16 holds half the bytes and computes the same values:
    FSDP2 would otherwise round its float32 weights to bf16 on every forward, the same rounding done once."""
    if name == "auto":
        return torch.float32 if trainable else compute
    return to_dtype(name)


def cast_parameters(module: nn.Module, dtype: torch.dtype, frozen: torch.dtype | None = None) -> None:
    """Cast the floating-point parameters in place (``frozen``: the dtype of those without gradients, e.g. a
    LoRA base), leaving buffers alone: ``module.to(bf16)`` would round RoPE's ``inv_freq`` to bf16 too, which
    moves every rotary angle (log-probs differ by ~1e-4)."""
    for param in module.parameters():
        want = frozen if frozen is not None and not param.requires_grad else dtype
        if param.is_floating_point() and param.dtype != want:
            param.data = param.data.to(want)


def reshard_after_forward(fsdp: FSDPConfig, trainable: bool = True) -> bool:
    """``fsdp.reshard_after_forward``; null is on above world size 1 (memory) and for a frozen module, which
    gathers each layer once per forward either way; off for a trained module at world size 1 (the shard is
    the whole parameter, so freeing the gathered compute-dtype copy only means casting it again in backward:
    13% of a 0.5B step on an H200). The CPU optimizer step turns it on there too (``TrainEngine``)."""
    if fsdp.reshard_after_forward is not None:
        return fsdp.reshard_after_forward
    init_distributed()
    return world_size() > 1 or not trainable


def compile_layers(layers: list[nn.Module], enabled: bool | None, device: torch.device) -> bool:
    """``torch.compile`` each decoder layer in place when ``enabled`` (None: on CUDA only); True if done.

    Compiling fuses the RMSNorms, RoPE, SiLU*mul and residual adds between the matmuls: on an H200 (0.5B
    shape, 16k-token micro-batches) that is about a third of the step. Identical layers share one compiled
    graph; a new sequence length recompiles once, after which sizes are dynamic. On CPU it only adds
    compilation time for the small models run there, hence off by default.
    """
    if not (device.type == "cuda" if enabled is None else enabled):
        return False
    for layer in layers:
        layer.compile()  # in place: the module keeps its type, so FSDP2 still finds and shards it
    return True


def split_pipeline(model: nn.Module, dims: ParallelDims) -> Stage | None:
    """Cut ``model`` down to this rank's stage of ``dims`` (in place); None at pp = 1."""
    if dims.pp == 1:
        return None
    check_train_pp(model.config, dims.pp, dims.role)
    stage = Stage(dims.pp_rank, ties_head(model))
    split_stage(model, dims.pp, stage.index)
    return stage


def parallelize(
    model: nn.Module,
    dims: ParallelDims | None,
    fsdp: FSDPConfig,
    *,
    trainable: bool,
    root: Callable[[nn.Module], nn.Module] = lambda m: m,
    stage_attr: str = "lm",
    packed: bool = False,
    checkpointing: bool = False,
    compile: bool | None = None,
    device: torch.device | None = None,
    layers: list[nn.Module] | None = None,
    lora: LoraSpec | None = None,
) -> Parallelized:
    """Lay ``model`` (a Hugging Face model) out on ``dims`` (None: FSDP2 over every rank); a collective.

    ``root``: the module FSDP2 wraps around the whole model (a scorer; a pipeline stage's is a
    ``StageScorer`` holding the model as ``stage_attr``). ``packed``: run the packed attention (forced on
    pipeline stages). ``checkpointing``: recompute each layer's activations in backward. ``compile``:
    per-layer ``torch.compile`` (None: on CUDA only). ``layers``: the modules FSDP2 shards one by one
    (None: the model's decoder layers; a VLM's text decoder layers, its vision tower's blocks, merger and tower
    sharded as units of their own besides). ``lora``: adapters on the decoder layers' linears, the rest frozen
    (the base kept in the compute dtype under ``fsdp.master_dtype=auto``: no float32 masters, no moments).
    """
    device = device or default_device()
    init_distributed()
    dims = (dims or ParallelDims(world_size())).build(device.type)
    stage = split_pipeline(model, dims)  # 1. this rank's pipeline stage
    if packed or stage is not None:
        use_packed_attention(model)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    vision = vision_units(model)  # a VLM's tower: blocks, merger and the tower, FSDP2 units of their own
    if layers is None:
        layers = decoder_layers(model.model.language_model if vision else model)
    if lora is not None:
        apply_lora(model, layers, lora)  # 1b. adapters; the base frozen
    scorer = root(model) if stage is None else StageScorer(model, stage.index, dims.pp, stage_attr)
    compute = compute_dtype(fsdp.param_dtype, device)
    frozen = compute if fsdp.master_dtype == "auto" else None  # frozen weights need no float32 master
    cast_parameters(scorer, master_dtype(fsdp.master_dtype, trainable, compute), frozen)  # 2. masters' dtype
    if dims.tp_mesh is not None:
        apply_tp(layers, dims.tp_mesh, model.config)  # 3. tensor parallelism inside the layers
    experts = []
    if dims.ep > 1:
        dims.check_model(model.config)
        experts = apply_ep(model, dims.ep_mesh)  # 4. experts split over the ep group
    if dims.sp > 1:
        apply_ulysses(scorer, layers, dims.sp_group, dims.role)  # 5. sequences split over the sp group
    compiled = compile_layers(layers, compile, device)  # 6. per-layer compile
    # A LoRA base is frozen: gathering a layer again in backward is a copy, not a cast (free each after use)
    reduce, reshard = to_dtype(fsdp.reduce_dtype), reshard_after_forward(fsdp, trainable and lora is None)
    module = shard_model(  # 7. FSDP2
        scorer,
        [*vision, *layers],
        device,
        compute,
        reduce,
        reshard,
        dims.fsdp_mesh,
        experts,
        dims.experts_fsdp_mesh,
    )
    tied = None
    if stage is not None:  # the tied head's two copies (collective: every rank builds every pair)
        tied = TiedWeights(model, dims, dims.rank, stage.tied_head)
        module.stage_group = dims.pp_group  # checkpoints join the stages' parameter shapes over it
    return Parallelized(module, dims, device, compute, compiled, stage, tied)
