"""One FSDP2-sharded module with its optimizer and LR schedule: stepping, clipping, offload between phases."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator

import torch
from torch import nn

from hybridflow.config.schema import FSDPConfig, OptimConfig
from hybridflow.engine.ops.dtypes import to_dtype
from hybridflow.engine.parallel.fsdp import (
    grad_norm_and_clip,
    optimizer_state_bytes,
    reshard_fsdp,
    set_accumulation,
    shard_model,
)
from hybridflow.engine.parallel.grad_norm import clip_by_global_norm
from hybridflow.engine.parallel.tp import apply_tp
from hybridflow.engine.parallel.train_view import TrainView, build_mesh
from hybridflow.engine.parallel.ulysses import apply_ulysses, ulysses_groups
from hybridflow.engine.train.host_store import HostStore
from hybridflow.engine.train.offload import choose_pinning, move_model, move_optimizer
from hybridflow.engine.train.optim import allocate_state, build_lr_scheduler, build_optimizer
from hybridflow.utils.device import cuda_in_use
from hybridflow.utils.dist import init_distributed, world_size
from hybridflow.utils.host import available_host_bytes, ranks_on_host

logger = logging.getLogger(__name__)


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


def cast_parameters(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating-point parameters in place, leaving buffers alone: ``module.to(bf16)`` would round
    RoPE's ``inv_freq`` to bf16 too, which moves every rotary angle (log-probs differ by ~1e-4)."""
    for param in module.parameters():
        if param.is_floating_point() and param.dtype != dtype:
            param.data = param.data.to(dtype)


def warmup_steps(optim: OptimConfig, total_steps: int) -> int:
    """Warm-up steps from ``lr_warmup_steps``, or from ``lr_warmup_steps_ratio`` when that is negative."""
    return (
        optim.lr_warmup_steps
        if optim.lr_warmup_steps >= 0
        else int(optim.lr_warmup_steps_ratio * total_steps)
    )


def reshard_after_forward(fsdp: FSDPConfig) -> bool:
    """``fsdp.reshard_after_forward``; null is off at world size 1 (the shard is the whole parameter, so
    freeing the gathered compute-dtype copy only means casting it again in backward: 13% of a 0.5B step
    on an H200), on otherwise (memory)."""
    if fsdp.reshard_after_forward is not None:
        return fsdp.reshard_after_forward
    init_distributed()
    return world_size() > 1


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


class TrainEngine:
    """Holds a sharded module and (when trainable) its AdamW and schedule; the roles call into it.

    ``view``: the training view (``engine.parallel.train_view``); None is FSDP2 over every rank. Under a
    view with tensor parallelism the layers are split over its ``tp`` mesh first, then FSDP2 shards over
    ``dp``; ``dp_size`` and ``dp_group`` are what losses and metrics are averaged over.
    """

    def __init__(
        self,
        module: nn.Module,
        layers: list[nn.Module],
        fsdp: FSDPConfig,
        optim: OptimConfig | None,
        grad_clip: float = 1.0,
        total_steps: int = 1,
        device: torch.device | None = None,
        use_torch_compile: bool | None = None,
        view: TrainView | None = None,
    ) -> None:
        self.device = device or default_device()
        init_distributed()
        self.view = view if view is not None else TrainView(world_size())
        mesh = None
        if not self.view.fsdp_only:
            mesh = build_mesh(self.view, self.device)
            apply_tp(layers, mesh["tp"])
        self.dp_group = None if mesh is None else mesh["dp"].get_group()
        self.pp_group = None if mesh is None else mesh["pp"].get_group()
        self.sp_group = None  # Ulysses: FSDP2 over every rank, losses averaged across the sp groups
        if self.view.sp > 1:
            self.dp_group, self.sp_group = ulysses_groups(self.view, self.device)
            apply_ulysses(module, layers, self.sp_group, self.view.role)
        self.compiled = compile_layers(layers, use_torch_compile, self.device)
        self.fsdp = fsdp
        self.grad_clip = grad_clip
        self.compute_dtype = compute_dtype(fsdp.param_dtype, self.device)
        cast_parameters(module, master_dtype(fsdp.master_dtype, optim is not None, self.compute_dtype))
        self.module = shard_model(
            module,
            layers,
            self.device,
            self.compute_dtype,
            to_dtype(fsdp.reduce_dtype),
            reshard_after_forward(fsdp),
            None if mesh is None else mesh["dp"],
        )
        self.optimizer = self.scheduler = None
        if optim is not None:
            self.optimizer = build_optimizer(
                self.module.parameters(), optim.lr, optim.weight_decay, tuple(optim.betas), optim.eps
            )
            self.scheduler = build_lr_scheduler(
                self.optimizer,
                optim.lr_scheduler_type,
                warmup_steps(optim, total_steps),
                total_steps,
                optim.min_lr_ratio,
                optim.num_cycles,
            )
            allocate_state(self.optimizer)  # steady-state memory from the start (see its docstring)
        self.skipped_steps = 0
        self.tied = None  # a pipeline's tied head (``pipeline.TiedWeights``): set by the role that has one
        self.on_device = True
        self.moments_away = False  # moved to the host for one rollout (optimizer_offload=auto)
        self.pin_memory = fsdp.pin_memory
        if self.device.type == "cuda":  # a CPU run moves nothing
            self.pin_memory = choose_pinning(
                fsdp, self.module, self.optimizer, ranks_on_host(), available_host_bytes()
            )
        # The host homes of the offloaded shards and moments, allocated at the first offload.
        self.param_store, self.moment_store = HostStore(self.pin_memory), HostStore(self.pin_memory)
        self.offload()

    @property
    def dp_size(self) -> int:
        """The data-parallel size of the view (the world size under FSDP2 alone)."""
        return self.view.dp

    @property
    def lr(self) -> float:
        """The learning rate the next optimizer step uses."""
        return self.optimizer.param_groups[0]["lr"] if self.optimizer else 0.0

    def accumulate(
        self,
        micro_batch: int,
        num_micro_batches: int,
        defer_grad_sync: bool | None = None,
        keep_params_gathered: bool | None = None,
    ) -> None:
        """Set FSDP2's gradient sync / resharding for the coming backward (see ``fsdp.set_accumulation``).

        None turns an option on at world size 1 without parameter offload, where it costs no extra
        communication and little memory.
        """
        auto = world_size() == 1 and not self.fsdp.param_offload
        set_accumulation(
            self.module,
            last=micro_batch == num_micro_batches - 1,
            defer_grad_sync=auto if defer_grad_sync is None else defer_grad_sync,
            keep_params_gathered=auto if keep_params_gathered is None else keep_params_gathered,
        )

    def optimizer_step(self) -> float:
        """Clip and step; a non-finite gradient norm skips the step (counted). Returns the pre-clip norm."""
        assert self.optimizer is not None, "optimizer_step on a forward-only engine"
        params = [p for p in self.module.parameters() if p.grad is not None]
        if self.view.fsdp_only:
            norm = grad_norm_and_clip(params, self.grad_clip)
        else:  # parameters on several meshes (tp x dp layers, dp-only embeddings), or on several stages
            twin = None
            if self.tied is not None:
                self.tied.sync_grads()  # the first and last stages' copies of a tied head get one gradient
                twin = None if self.tied.counted else self.tied.param  # counted once, on the first stage
            counted = [p for p in params if p is not twin]
            norm = clip_by_global_norm(params, self.grad_clip, self.pp_group, counted)
        norm_value = float(norm)
        if math.isfinite(norm_value):
            self.optimizer.step()
        else:
            self.skipped_steps += 1
            logger.warning(
                "non-finite grad norm (%s): optimizer step skipped (%d so far)",
                norm_value,
                self.skipped_steps,
            )
        self.optimizer.zero_grad(set_to_none=True)
        return norm_value

    def lr_step(self) -> None:
        """Advance the learning-rate schedule by one training step."""
        if self.scheduler is not None:
            self.scheduler.step()

    def onload(self) -> None:
        """Bring offloaded parameters / optimizer state back to the device before a phase that needs them."""
        if self.moments_away:
            move_optimizer(self.optimizer, self.device, self.pin_memory)
            self.moments_away = False
        if self.on_device:
            return
        if self.fsdp.param_offload:
            move_model(self.module, self.device, self.pin_memory)
        if self._offloads_moments:
            move_optimizer(self.optimizer, self.device, self.pin_memory)
        self.on_device = True

    @property
    def _offloads_moments(self) -> bool:
        """Whether every phase hands the optimizer state to the host (``optimizer_offload=true``)."""
        return self.fsdp.optimizer_offload is True and self.optimizer is not None

    def make_room(self) -> int:
        """Move the optimizer state to the host until the next ``onload()``; returns the device bytes freed.

        For ``optimizer_offload=auto``: the actor calls it (on its own engine, then a colocated critic's)
        before a rollout whose KV cache would otherwise not hold all its sequences at once, since a second
        wave of decoding costs far more than moving the moments out and back (0.18 s for a 0.5B actor on an
        H200). Nothing to move: returns 0.
        """
        if self.optimizer is None or self.moments_away or self.device.type == "cpu":
            return 0
        if self._offloads_moments and not self.on_device:
            return 0  # already on the host between phases
        freed = optimizer_state_bytes(self.optimizer)
        move_optimizer(self.optimizer, "cpu", self.pin_memory, self.moment_store)
        self.moments_away = True
        torch.cuda.empty_cache()
        return freed

    @contextlib.contextmanager
    def onloaded(self) -> Iterator[None]:
        """Hold parameters and optimizer state on the device for the block, then hand memory back as before.

        For work outside the phases that reads or writes every shard: NCCL gathers only device tensors (an
        export of offloaded shards fails at world size > 1), and a loaded optimizer state lands on its
        parameter's device.
        """
        was_on_device = self.on_device
        self.onload()
        try:
            yield
        finally:
            if not was_on_device:
                self.offload()

    def offload(self) -> None:
        """Hand the device memory to other phases: free gathered parameters; offload as configured.

        Every phase ends here, so a forward-only pass never leaves FSDP2's gathered compute-dtype copy
        behind (``fsdp.reshard_fsdp``); parameters and optimizer state then move to CPU when configured.
        """
        reshard_fsdp(self.module)
        offloads = self.fsdp.param_offload or self._offloads_moments
        if not offloads or not self.on_device or self.device.type == "cpu":
            return  # nothing moves: keep the allocator's cache (emptying it costs a device sync)
        if self.fsdp.param_offload:
            move_model(self.module, "cpu", self.pin_memory, self.param_store)
        if self._offloads_moments:
            move_optimizer(self.optimizer, "cpu", self.pin_memory, self.moment_store)
        self.on_device = False
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
