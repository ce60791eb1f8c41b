"""LoRA: low-rank adapters on a frozen base, applied by ``parallelize`` before the masters' cast and FSDP2.

Each targeted ``nn.Linear`` of the decoder layers becomes a ``LoraLinear``: y = W x + b + (alpha / r)
B(A(dropout(x))), A (r, in) initialised kaiming-uniform and B (out, r) zeros as PEFT does, so a fresh adapter
leaves the model unchanged. ``LoraLinear`` is an ``nn.Linear`` that keeps the base's own ``weight`` and
``bias`` (the same Parameters, frozen): the base's names do not change (``...q_proj.weight``), so the reshard
plan, the checkpoints' shapes and the HF export see the model they always saw, plus ``...q_proj.lora_A.weight``
and ``...q_proj.lora_B.weight`` (PEFT's names, without its adapter name). Every other parameter is frozen too:
the optimizer only ever sees A and B.

Three switches read the adapter:

- ``adapters_disabled(module)``: the base model (the reference policy: no second copy of the weights);
- ``LoraLinear.generation_tensor``: W + (alpha / r) B A for this rank's shard of W (the rollout's weights);
- ``models.adapters.merge_adapter_state``: a whole state dict merged into plain HF names (export).
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from hybridflow.engine.ops.tensors import local_shard
from hybridflow.models.adapters import is_adapter_name
from hybridflow.utils.errors import UserError

logger = logging.getLogger(__name__)

ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class LoraSpec:
    """What to adapt: rank r, alpha (the update is scaled by alpha / r), the targets and the dropout."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = (
        ALL_LINEAR,
    )  # module-name suffixes (``q_proj``, ``mlp.down_proj``), or all-linear
    dropout: float = 0.0

    @property
    def scaling(self) -> float:
        """alpha / r, the factor of B A."""
        return self.alpha / self.rank


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor behind ``t`` (a DTensor is gathered: a collective over its mesh), detached."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def _local_slices(t: torch.Tensor) -> tuple[slice, ...]:
    """The slices of the whole tensor that this rank's local shard of ``t`` holds."""
    if not hasattr(t, "device_mesh"):
        return tuple(slice(0, n) for n in t.shape)
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


class LoraLinear(nn.Linear):
    """A frozen ``nn.Linear`` plus a trained low-rank update (``lora_A``, ``lora_B``; see the module doc)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0) -> None:
        """Wraps ``base``'s own parameters (no copy); A and B are float32, on the base weight's device."""
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        for p in (self.weight, self.bias):
            if p is not None:
                p.requires_grad_(False)
        device = base.weight.device
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=device, dtype=torch.float32)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=device, dtype=torch.float32)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = alpha / rank
        self.adapter_enabled = True
        self.merged_in_place = False  # InPlaceMerge: the rollout reads the base's own (merged) storage
        self.reset_adapter()

    def reset_adapter(self) -> None:
        """PEFT's initialisation: A kaiming-uniform (a = sqrt(5)), B zeros (the update starts at 0)."""
        with torch.no_grad():
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
            nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., out): the base projection, plus the scaled update unless adapters are off."""
        y = nn.functional.linear(x, self.weight, self.bias)  # (..., out)
        if not self.adapter_enabled:
            return y
        low = self.lora_A(self.lora_dropout(x))  # (..., r)
        return y + self.lora_B(low) * self.scaling

    @property
    def computed_for_generation(self) -> bool:
        """Whether the rollout must compute its weight (``generation_tensor``) rather than read the base's."""
        return not self.merged_in_place

    @torch.no_grad()
    def generation_tensor(self, name: str) -> torch.Tensor:
        """This rank's shard of the generation weight ``name``: W + (alpha / r) B A for ``weight`` (in W's
        dtype, rounded once), the local bias as it is. A collective where A and B are sharded."""
        local = local_shard(getattr(self, name))
        if name != "weight":
            return local
        rows, cols = _local_slices(self.weight)
        a = _full(self.lora_A.weight).float()  # (r, in)
        b = _full(self.lora_B.weight).float()  # (out, r)
        merged = torch.addmm(local.float(), b[rows], a[:, cols], alpha=self.scaling)  # (rows, cols)
        return merged.to(local.dtype)


class InPlaceMerge:
    """One rank's rollout without merge buffers (``rollout.lora_merge=in_place``): W + (alpha / r) B A written
    into each adapted base weight's own storage for a generation, the base copied back exactly afterwards from
    a host copy taken once (the base is frozen). Costs a host copy of the adapted weights and one host ->
    device copy per generation; saves the device copy of them that merge buffers take."""

    def __init__(self, module: nn.Module, pin: bool) -> None:
        self.mods = lora_modules(module)
        self.pin = pin
        self.saved: list[torch.Tensor] | None = None
        for m in self.mods:
            m.merged_in_place = True  # the rollout binds the base's storage by reference

    @torch.no_grad()
    def merge(self) -> None:
        """Write the merged weights into the base's storage (the first call keeps the base on the host)."""
        if self.saved is None:  # pinned host buffers, filled once
            weights = [local_shard(m.weight) for m in self.mods]
            self.saved = [torch.empty_like(w, device="cpu", pin_memory=self.pin) for w in weights]
            for host, w in zip(self.saved, weights):
                host.copy_(w)
        for m in self.mods:
            local_shard(m.weight).copy_(m.generation_tensor("weight"))  # (out, in), rounded once

    @torch.no_grad()
    def restore(self) -> None:
        """Copy the base back (bit for bit) after the generation."""
        for m, host in zip(self.mods, self.saved or []):
            local_shard(m.weight).copy_(host, non_blocking=True)

    @contextlib.contextmanager
    def merged(self) -> Iterator[None]:
        """The base merged for the block (restored even when it raises)."""
        self.merge()
        try:
            yield
        finally:
            self.restore()


def linear_names(layers: list[nn.Module]) -> list[str]:
    """The names (relative to a layer) of every ``nn.Linear`` of the decoder ``layers``, in order, unique."""
    seen: dict[str, None] = {}
    for layer in layers:
        for name, mod in layer.named_modules():
            if isinstance(mod, nn.Linear) and not is_adapter_name(name):  # not an adapter's own A or B
                seen.setdefault(name, None)
    return list(seen)


def _targeted(name: str, targets: tuple[str, ...]) -> bool:
    return ALL_LINEAR in targets or any(name == t or name.endswith("." + t) for t in targets)


def check_targets(layers: list[nn.Module], targets: tuple[str, ...]) -> list[str]:
    """The layer-relative linear names ``targets`` select; UserError naming an unknown target."""
    names = linear_names(layers)
    unknown = [t for t in targets if t != ALL_LINEAR and not any(_targeted(n, (t,)) for n in names)]
    if unknown or not names:
        raise UserError(
            f"model.target_modules: {unknown or list(targets)} match no linear layer of the decoder layers; "
            f"this model's are {names} (suffixes of these, or all-linear)"
        )
    return [n for n in names if _targeted(n, targets)]


def _widths(layers: list[nn.Module], chosen: list[str]) -> dict[str, tuple[int, int]]:
    """(in, out) of each chosen layer-relative linear (the narrowest over the layers, if they differ)."""
    out: dict[str, tuple[int, int]] = {}
    for layer in layers:
        for name in chosen:
            mod = layer.get_submodule(name)
            if isinstance(mod, nn.Linear):
                shape = (mod.in_features, mod.out_features)
                out[name] = min(out.get(name, shape), shape, key=min)
    return out


def check_rank(layers: list[nn.Module], chosen: list[str], rank: int) -> None:
    """Refuse a rank above the width of every adapted linear; warn when above the narrowest ones only.

    B A (out x in) has rank at most min(in, out): rank beyond a linear's width adds parameters and lowers
    the scale alpha / r without adding capacity. Above every width nothing can use it (a typo such as 640
    for 64): refused. Above some widths only, the wider linears use the rank; one rank for linears of
    different widths (GQA's narrow k_proj and v_proj beside q_proj and the MLP) is legitimate: a warning.
    """
    widths = _widths(layers, chosen)
    if not widths:
        return
    narrow = sorted((min(io), name) for name, io in widths.items() if min(io) < rank)
    if not narrow:
        return
    width, name = narrow[0]
    n_in, n_out = widths[name]
    widest = max(min(io) for io in widths.values())
    if len(narrow) == len(widths):
        raise UserError(
            f"model.lora_rank={rank} is above the width of every linear it adapts: B A (out x in) cannot have "
            f"a rank above min(in, out), at most {widest} here (the narrowest, {name}, is in={n_in}, "
            f"out={n_out}: {width}); the extra rank only adds parameters and lowers the scale "
            f"model.lora_alpha / model.lora_rank. Set model.lora_rank={widest} or less"
        )
    logger.warning(
        "model.lora_rank=%d is above the width of %s (the narrowest, %s, is in=%d, out=%d: %d): their "
        "adapters are full rank and the extra rank only adds parameters there, while the wider linears use "
        "it. To avoid it, set model.lora_rank=%d or less, or leave them out of model.target_modules",
        rank,
        ", ".join(n for _, n in narrow),
        name,
        n_in,
        n_out,
        width,
        width,
    )


def apply_lora(model: nn.Module, layers: list[nn.Module], spec: LoraSpec) -> list[str]:
    """Freeze ``model`` and wrap the targeted linears of ``layers`` in place; the wrapped layer-relative
    names (e.g. ``self_attn.q_proj``). A rank above the linears' widths is checked first (``check_rank``)."""
    chosen = check_targets(layers, spec.targets)
    check_rank(layers, chosen, spec.rank)
    for p in model.parameters():
        p.requires_grad_(False)
    for layer in layers:
        for name in chosen:
            owner, _, attr = name.rpartition(".")
            parent = layer.get_submodule(owner) if owner else layer
            base = getattr(parent, attr)
            if isinstance(base, nn.Linear) and not isinstance(base, LoraLinear):
                setattr(parent, attr, LoraLinear(base, spec.rank, spec.alpha, spec.dropout))
    return chosen


def lora_elements(layers: list[nn.Module], spec: LoraSpec) -> tuple[int, int]:
    """(adapter elements, elements of the adapted base weights) of ``layers`` under ``spec``, from the shapes
    alone (a model on the meta device will do): what the planner charges for LoRA."""
    chosen = set(check_targets(layers, spec.targets))
    adapters = adapted = 0
    for layer in layers:
        for name, mod in layer.named_modules():
            if name in chosen and isinstance(mod, nn.Linear):
                adapters += spec.rank * (mod.in_features + mod.out_features)
                adapted += mod.in_features * mod.out_features
    return adapters, adapted


def lora_modules(module: nn.Module) -> list[LoraLinear]:
    """Every ``LoraLinear`` inside ``module``."""
    return [m for m in module.modules() if isinstance(m, LoraLinear)]


@contextlib.contextmanager
def adapters_disabled(module: nn.Module) -> Iterator[None]:
    """Run ``module`` as its base model: every adapter off inside the block (the reference policy)."""
    mods = lora_modules(module)
    for m in mods:
        m.adapter_enabled = False
    try:
        yield
    finally:
        for m in mods:
            m.adapter_enabled = True
