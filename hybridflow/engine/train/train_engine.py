"""One parallelized module with its optimizer and LR schedule: stepping, clipping, offload between phases."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist

from hybridflow.config.schema import FSDPConfig, OptimConfig
from hybridflow.engine.parallel.fsdp import (
    grad_norm_and_clip,
    optimizer_state_bytes,
    reshard_fsdp,
    set_accumulation,
    set_reshard_after_forward,
)
from hybridflow.engine.parallel.grad_norm import clip_by_global_norm
from hybridflow.engine.parallel.parallelize import Parallelized
from hybridflow.engine.train.cpu_step import clip_grad_shards, host_adamw
from hybridflow.engine.train.host_store import HostStore
from hybridflow.engine.train.offload import choose_pinning, move_model, move_optimizer
from hybridflow.engine.train.optim import allocate_state, build_lr_scheduler, build_optimizer
from hybridflow.utils.dist import world_size
from hybridflow.utils.errors import UserError
from hybridflow.utils.host import available_host_bytes, ranks_on_host

logger = logging.getLogger(__name__)


def warmup_steps(optim: OptimConfig, total_steps: int) -> int:
    """Warm-up steps from ``lr_warmup_steps``, or from ``lr_warmup_steps_ratio`` when that is negative."""
    return (
        optim.lr_warmup_steps
        if optim.lr_warmup_steps >= 0
        else int(optim.lr_warmup_steps_ratio * total_steps)
    )


def check_cpu_step(fsdp: FSDPConfig) -> None:
    """Refuse ``optimizer_step_on_cpu`` with ``optimizer_offload``: its moments already live on the host."""
    if fsdp.optimizer_offload is not False:
        raise UserError(
            f"fsdp.optimizer_offload={fsdp.optimizer_offload} with fsdp.optimizer_step_on_cpu=true: the CPU "
            "step keeps the moments on the host already; set optimizer_offload=false"
        )


class TrainEngine:
    """Holds a parallelized module and (when trainable) its AdamW and schedule; the roles call into it.

    The module comes laid out on its training view (``parallel.parallelize``): the engine keeps the optimizer,
    the learning-rate schedule, clipping, offload and FSDP2's accumulation switches. ``dims`` is the view;
    ``dp_size`` and ``dp_group`` are what losses and metrics are averaged over.
    """

    def __init__(
        self,
        model: Parallelized,
        fsdp: FSDPConfig,
        optim: OptimConfig | None,
        grad_clip: float = 1.0,
        total_steps: int = 1,
    ) -> None:
        self.module, self.dims, self.device = model.module, model.dims, model.device
        self.compute_dtype, self.compiled = model.compute_dtype, model.compiled
        self.tied = model.tied  # a pipeline's tied head (``pipeline.TiedWeights``), else None
        self.fsdp = fsdp
        self.grad_clip = grad_clip
        self.optimizer = self.scheduler = None
        self.cpu_step = fsdp.optimizer_step_on_cpu and optim is not None
        if optim is not None:
            self.optimizer = self._build_optimizer(optim)
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

    def _build_optimizer(self, optim: OptimConfig) -> torch.optim.Optimizer:
        """The resident AdamW, or with ``fsdp.optimizer_step_on_cpu`` the host one (``cpu_step.HostAdamW``)."""
        if not self.cpu_step:
            return build_optimizer(
                self.module.parameters(), optim.lr, optim.weight_decay, tuple(optim.betas), optim.eps
            )
        check_cpu_step(self.fsdp)
        # The masters and moments go to the host, the device shards are cast to the compute dtype.
        pin = self.fsdp.pin_memory and self.device.type == "cuda"
        optimizer = host_adamw(self.module, optim, self.compute_dtype, pin)
        if self.fsdp.reshard_after_forward is None:
            # The shards are in the compute dtype now: gathering a layer again in backward is a copy, not a
            # cast, so even at one rank each layer is freed after its forward (7B: 15 GB less in the update).
            set_reshard_after_forward(self.module, True)
        return optimizer

    @property
    def dp_group(self) -> dist.ProcessGroup | None:
        """The data-parallel group losses and metrics are summed over (None: every rank)."""
        return self.dims.dp_group

    @property
    def pp_group(self) -> dist.ProcessGroup | None:
        """The pipeline stages of this rank's replica (None under FSDP2 alone)."""
        return self.dims.pp_group

    @property
    def sp_group(self) -> dist.ProcessGroup | None:
        """This rank's Ulysses group (None at sp = 1)."""
        return self.dims.sp_group

    @property
    def dp_size(self) -> int:
        """The data-parallel size of the view (the world size under FSDP2 alone)."""
        return self.dims.dp

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
        communication and little memory; with the CPU optimizer step ``keep_params_gathered`` stays off (its
        shards are in the compute dtype, so gathering again is a copy: not worth a second copy of the weights).
        Deferred sync accumulates the unsharded gradients in the float32 reduce dtype (4 bytes a parameter).
        """
        auto = world_size() == 1 and not self.fsdp.param_offload
        set_accumulation(
            self.module,
            last=micro_batch == num_micro_batches - 1,
            defer_grad_sync=auto if defer_grad_sync is None else defer_grad_sync,
            keep_params_gathered=(auto and not self.cpu_step)
            if keep_params_gathered is None
            else keep_params_gathered,
        )

    def optimizer_step(self) -> float:
        """Clip and step; a non-finite gradient norm skips the step (counted). Returns the pre-clip norm."""
        assert self.optimizer is not None, "optimizer_step on a forward-only engine"
        params = [p for p in self.module.parameters() if p.grad is not None]
        if self.dims.fsdp_only and self.cpu_step:  # compute-dtype gradients: a float32 norm
            norm = clip_grad_shards(params, self.grad_clip)
        elif self.dims.fsdp_only:
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
        if self.optimizer is None or self.moments_away or self.device.type == "cpu" or self.cpu_step:
            return 0  # (the CPU step's moments never leave the host)
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
