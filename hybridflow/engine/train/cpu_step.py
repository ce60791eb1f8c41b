"""The optimizer step on the CPU (``fsdp.optimizer_step_on_cpu``): float32 masters and AdamW moments in host
memory, the device holding only compute-dtype weights and gradients.

Each step, after backward and clipping on the device, every gradient shard goes to a host staging buffer
(compute dtype, pinned), the fused CPU AdamW updates the masters from it, and the new masters go back into
the device weights through the same buffer, cast to the compute dtype. The parameters are cut into buckets
of about ``BUCKET_BYTES``, in module order (so roughly a few decoder layers each): every bucket's
device-to-host copy is queued at once on a side CUDA stream, and while the CPU steps bucket i the copies of
the buckets after it are still arriving and the new weights of the buckets before it are going back up.

Time cost per step, for N trained parameters on this rank (its FSDP2 shard) in bf16: 2N bytes down
(gradients) and 2N bytes up (weights) over PCIe / C2C, about 2N / 25e9 s each way through pinned memory on
a PCIe 5 host (the two directions overlap); and the CPU AdamW, which reads and writes the float32 master,
both moments and the gradient, ~28N bytes of host-memory traffic: the fused kernel measured ~0.6e9
parameters/s on 2 cores here (8M parameters in 13 ms), so expect a few 1e9 parameters/s from a 16-core
share. For Qwen2-7B on one GPU that is ~14 GB each way (~0.6 s) plus ~2-4 s of AdamW, against the 112 GB of
float32 masters and moments it takes off the device (docs/engine.md; the lead measures it on the H200).

The optimizer keeps the module's own (device) parameters in its param groups, so the LR schedule, the
checkpoint code (``torch.distributed.checkpoint`` maps them to parameter names) and ``zero_grad`` work as for
the resident AdamW; its state holds the moments as host tensors shaped like the parameters (DTensors under
FSDP2), and its state dict adds each parameter's ``master``, so a checkpoint round-trips the float32 values.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.optim.adamw import adamw

from hybridflow.engine.ops.tensors import local_shard
from hybridflow.engine.train.host_store import HostStore, host_home
from hybridflow.utils.host import ranks_on_host

logger = logging.getLogger(__name__)

# torch.optim.AdamW's own param-group keys with the values of the kernel this step runs, so that a checkpoint
# of these groups has the keys a resident AdamW's loader asks for.
_ADAMW_FLAGS = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": True,
    "decoupled_weight_decay": True,
}
BUCKET_BYTES = 64 * 2**20  # compute-dtype bytes per bucket: small enough to overlap, big enough to be cheap


@torch.no_grad()
def cast_sharded(module: nn.Module, dtype: torch.dtype) -> None:
    """Cast ``module``'s floating-point parameters (FSDP2 shards) to ``dtype`` in place, buffers left alone.

    FSDP2 re-registers the cast shards (its ``_apply``) and reads their dtype as the "original" one when it
    decides whether to cast for compute and what dtype to leave gradients in, so its per-group dtypes are
    recomputed here: with the compute dtype as the shards' own it casts nothing, and gradients are reduced
    in the reduce dtype and kept in the compute dtype.
    """
    ids = {id(p) for p in module.parameters() if p.is_floating_point() and p.dtype != dtype}
    if not ids:
        return
    module._apply(lambda t: t.to(dtype) if id(t) in ids else t)
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            for group in _param_groups(sub):
                group._init_mp_dtypes()  # what its lazy init does: orig dtype = the shards' dtype


def _param_groups(module: FSDPModule) -> list[Any]:
    """An FSDP2 module's parameter groups: a list in torch >= 2.12, one group (or None) before (2.11)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


@torch.no_grad()
def clip_grad_shards(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """The global 2-norm of FSDP2's gradient shards, clipping them in place when ``max_norm`` > 0.

    torch's ``clip_grad_norm_`` on compute-dtype (bf16) gradients rounds each tensor's norm and their total
    to bf16, so the clip coefficient would be off by up to 0.4% against the resident float32 gradients. Here
    each shard's norm is accumulated in float32 (``_foreach_norm`` reads the bf16 values, no upcast copy), the
    squares summed and all-reduced over the shards' mesh, then scaled by torch's own clipping formula.
    """
    grads = [p.grad for p in params if p.grad is not None]
    locals_ = [local_shard(g) for g in grads]
    device = locals_[0].device if locals_ else torch.device("cpu")
    total = torch.zeros((), dtype=torch.float32, device=device)
    if locals_:
        total = torch.stack(torch._foreach_norm(locals_, 2, dtype=torch.float32)).square().sum()
    mesh = getattr(grads[0], "device_mesh", None) if grads else None
    if mesh is not None and mesh.size() > 1:
        dist.all_reduce(total, group=mesh.get_group())  # FSDP2 alone: one 1-D mesh holds every shard
    norm = total.sqrt()
    if max_norm > 0 and locals_:
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)  # torch's clip_grad_norm_ formula
        torch._foreach_mul_(locals_, coef)
    return norm


def _cpu_threads() -> int:
    """Intra-op threads for the CPU step: this rank's share of the host's cores (torchrun sets 1)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(torch.get_num_threads(), cores // max(1, ranks_on_host()))


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` intra-op threads, then restore the count."""
    before = torch.get_num_threads()
    if n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n != before:
            torch.set_num_threads(before)


class HostAdamW(torch.optim.Optimizer):
    """AdamW over a module's device parameters whose masters, moments and step live on the host.

    Built on the module as ``parallelize`` leaves it (trained weights in their master dtype): copies each
    shard to a host master, then casts the device shards to ``compute_dtype``.
    """

    def __init__(
        self,
        module: nn.Module,
        lr: float,
        weight_decay: float,
        betas: tuple[float, float],
        eps: float,
        compute_dtype: torch.dtype,
        pin: bool,
    ) -> None:
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no trainable parameters; nothing to optimise")
        super().__init__(
            params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, **_ADAMW_FLAGS}
        )
        self.masters: dict[nn.Parameter, torch.Tensor] = {}
        for p in params:  # (shard,) host copies in the masters' dtype, before the device shards are cast
            master = local_shard(p).to("cpu", copy=True)
            self.masters[p] = host_home(p, master)
            self.state[p] = {
                "step": torch.zeros((), dtype=torch.float32),
                "exp_avg": host_home(p, torch.zeros_like(master)),
                "exp_avg_sq": host_home(p, torch.zeros_like(master)),
            }
        cast_sharded(module, compute_dtype)
        self.compute_dtype = compute_dtype
        # One compute-dtype host buffer per shard: gradients arrive in it, new weights leave from it.
        self.staging = HostStore(pin)
        self._stage = dict(zip(params, (local_shard(h) for h in self.staging.stash(params))))
        self.device = params[0].device
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.threads = _cpu_threads()

    def master(self, param: nn.Parameter) -> torch.Tensor:
        """The host master of ``param`` (its local shard, in the masters' dtype)."""
        return local_shard(self.masters[param])

    def _buckets(self, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        """``params`` cut in module order into runs of about ``BUCKET_BYTES`` compute-dtype bytes."""
        buckets: list[list[nn.Parameter]] = [[]]
        size = 0
        for p in params:
            if buckets[-1] and size >= BUCKET_BYTES:
                buckets.append([])
                size = 0
            buckets[-1].append(p)
            size += self._stage[p].numel() * self._stage[p].element_size()
        return [b for b in buckets if b]

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        """One AdamW step on the host masters of every parameter with a gradient; new weights to the device."""
        assert closure is None, "HostAdamW takes no closure"
        stream = self._stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))  # backward and clipping are done
        work = []
        for group in self.param_groups:
            for bucket in self._buckets([p for p in group["params"] if p.grad is not None]):
                work.append((group, bucket, self._download(bucket)))
        with _threads(self.threads):
            for group, bucket, arrived in work:
                if arrived is not None:
                    arrived.synchronize()  # this bucket's gradients are on the host; later ones still coming
                self._step_bucket(group, bucket)
                self._upload(bucket)
        if stream is not None:  # the next forward sees the new weights
            torch.cuda.current_stream(self.device).wait_stream(stream)

    def _download(self, bucket: list[nn.Parameter]) -> torch.cuda.Event | None:
        """Queue the copies of ``bucket``'s gradient shards into their staging buffers; an event on CUDA."""
        stream = self._stream
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for p in bucket:
                self._stage[p].copy_(local_shard(p.grad), non_blocking=stream is not None)
            return stream.record_event() if stream is not None else None

    def _upload(self, bucket: list[nn.Parameter]) -> None:
        """Cast ``bucket``'s new masters into the staging buffers and queue their copies into the weights."""
        stream = self._stream
        for p in bucket:
            self._stage[p].copy_(self.master(p))  # on the CPU: the gradient it held has been used
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for p in bucket:
                local_shard(p).copy_(self._stage[p], non_blocking=stream is not None)

    def _step_bucket(self, group: dict[str, Any], bucket: list[nn.Parameter]) -> None:
        """AdamW on the host masters of ``bucket`` (fused CPU kernel, multi-threaded)."""
        masters = [self.master(p) for p in bucket]
        grads = [self._stage[p].to(m.dtype) for p, m in zip(bucket, masters)]  # no copy when dtypes agree
        states = [self.state[p] for p in bucket]
        beta1, beta2 = group["betas"]
        adamw(
            masters,
            grads,
            [local_shard(s["exp_avg"]) for s in states],
            [local_shard(s["exp_avg_sq"]) for s in states],
            [],
            [s["step"] for s in states],
            fused=True,
            amsgrad=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=False,
        )

    def model_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` (the module's sharded state dict) with each trained parameter's entry its float32 host
        master: a checkpoint holds the masters as the model's weights, as a resident run's does, so either
        kind of run resumes from the other's checkpoint and an export from it is not rounded."""
        by_storage = {_storage(p): m for p, m in self.masters.items()}
        return {name: by_storage.get(_storage(t), t) for name, t in state.items()}

    @torch.no_grad()
    def masters_to_weights(self) -> None:
        """Copy every master into its device weights (cast to the compute dtype): after loading masters."""
        for p in self.masters:
            local_shard(p).copy_(self.master(p))

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Copy a ``state_dict()`` into the host state in place (torch's own would move it to the device).

        The masters are not in it: the checkpoint's model weights are (``model_state``).
        """
        groups, saved_groups = self.param_groups, state_dict["param_groups"]
        if len(groups) != len(saved_groups) or any(
            len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)
        ):
            raise ValueError("the optimizer state dict has other parameter groups than this optimizer")
        by_index = {}
        for group, saved in zip(groups, saved_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
            by_index.update(zip(saved["params"], group["params"]))
        for index, entry in state_dict["state"].items():
            p = by_index[index]
            for key, value in entry.items():
                target = self.state[p].get(key)
                if isinstance(value, torch.Tensor) and isinstance(target, torch.Tensor):
                    local_shard(target).copy_(local_shard(value))
                else:
                    self.state[p][key] = value


def _storage(t: torch.Tensor) -> int:
    """The address of a tensor's (local shard's) storage: how a state dict's entry finds its parameter."""
    return local_shard(t).untyped_storage().data_ptr()


def host_adamw(module: nn.Module, optim: Any, compute_dtype: torch.dtype, pin: bool) -> HostAdamW:
    """A ``HostAdamW`` over ``module`` with ``optim``'s (an ``OptimConfig``) hyperparameters."""
    return HostAdamW(module, optim.lr, optim.weight_decay, tuple(optim.betas), optim.eps, compute_dtype, pin)
