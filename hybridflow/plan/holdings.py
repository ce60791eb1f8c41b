"""Which part of a parameter each rank holds in a training view and in a generation view, as boxes.

The engine lays the parameters out this way (``engine.parallel.dims.train_box`` for training, the rollout's
``ShardLayout`` for generation); the planner reads the engine through its surface only, so the geometry is
written here again for ``plan.switch``, and tests/plan/test_switch.py holds the two to the same bytes (the
engine's ``view_memory``) on every view the engine builds. A box is one (start, stop) per dimension of the full
parameter; a generation part may be several boxes (a fused gate/up expert slice: one in each half).

Kinds are the family's shard rules (``FamilySpec.shard_rules``): column (split on rows), kv (rows by KV head,
a head shared by ranks when tp exceeds the KV heads), row (split on columns), vocab (rows, the last slice
padded), first (a row-parallel bias: rank 0's), replicated, and for fused experts (E, 2I, H) / (E, H, I)
experts_column / experts_row (each expert sliced on its intermediate dim) or whole experts over ep ranks.
"""

from __future__ import annotations

import functools
import re
from typing import Any

from hybridflow.engine import ParallelDims
from hybridflow.models.families import is_moe
from hybridflow.models.family import FAMILIES, FamilySpec

Box = tuple[tuple[int, int], ...]

# every family's fused experts (``Experts.fused``): what expert parallelism splits whole
_EXPERTS = tuple(dict.fromkeys(n for s in FAMILIES.values() if s.experts for n in s.experts.fused))


def is_expert(name: str) -> bool:
    """Whether parameter ``name`` is a MoE block's fused experts (the router is not)."""
    return name.endswith(_EXPERTS)


@functools.lru_cache(maxsize=65536)
def sliced_kind(name: str, family: FamilySpec | None) -> str:
    """A parameter's tensor-parallel kind in the rollout with each expert sliced (``replicated`` without a
    family's rules)."""
    if family is None:
        return "replicated"
    for pattern, kind in family.shard_rules():
        if re.search(pattern, name):
            return kind
    raise ValueError(f"parameter {name!r} has no shard rule in the {family.name} family's entry")


def trained_kind(config: Any, name: str, kind: str) -> str:
    """How the training view lays a parameter out: a mixture of experts' blocks whole on every tp rank, its
    fused experts split over the training ep (``experts``)."""
    if not is_moe(config) or ".mlp." not in name:
        return kind
    return "experts" if is_expert(name) else "replicated"


def volume(box: Box | None) -> int:
    """Elements in a box (0 for None)."""
    n = 0 if box is None else 1
    for lo, hi in box or ():
        n *= hi - lo
    return n


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes of one parameter (None: none)."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def _chunk(lo: int, hi: int, parts: int, i: int) -> tuple[int, int]:
    """Part ``i`` of ``parts`` of [lo, hi) as ``torch.chunk`` splits it (empty parts at the end)."""
    size = -(-(hi - lo) // parts)
    return min(lo + i * size, hi), min(lo + (i + 1) * size, hi)


def _along(shape: tuple[int, ...], dim: int, span: tuple[int, int]) -> Box | None:
    """The whole of ``shape`` but ``span`` along ``dim`` (None when empty)."""
    if span[0] >= span[1]:
        return None
    return tuple(span if d == dim else (0, n) for d, n in enumerate(shape))


def stages_of(name: str, num_layers: int, pp: int, tied: bool) -> tuple[int, ...]:
    """The pipeline stages holding parameter ``name``: its layer's (contiguous layers, the first stages one
    longer), the embedding the first (a tied one the last too), the rest the last."""
    parts = name.split(".")
    if "layers" in parts:
        layer, (size, extra) = int(parts[parts.index("layers") + 1]), divmod(num_layers, pp)
        starts = [s * size + min(s, extra) for s in range(pp)] + [num_layers]
        return tuple(s for s in range(pp) if starts[s] <= layer < starts[s + 1])
    if "embed_tokens" in parts:
        return (0, pp - 1) if tied and pp > 1 else (0,)
    return (pp - 1,)


def train_box(
    kind: str, shape: tuple[int, ...], view: ParallelDims, rank: int, fsdp_dim: int, stages: tuple[int, ...]
) -> Box | None:
    """The box ``rank`` holds in training ``view``: experts whole over ep then FSDP2 over the ranks holding
    them; else its pipeline stage's, the column / kv rows or row columns of its tp rank, then FSDP2's chunk
    over dp (every rank under Ulysses) along ``fsdp_dim``."""
    box = [(0, n) for n in shape]
    if kind == "experts" and view.ep > 1:
        rep_rank, ep_rank = view.ep_coords(rank)
        box[0] = _chunk(0, shape[0], view.ep, ep_rank)
        box[fsdp_dim] = _chunk(*box[fsdp_dim], view.dp // view.ep, rep_rank)
        return None if any(lo >= hi for lo, hi in box) else tuple(box)
    pp_rank, tp_rank, dp_rank = view.coords(rank)
    if pp_rank not in stages:
        return None
    split = {"column": 0, "kv": 0, "row": 1}.get(kind) if view.tp > 1 else None
    if split is not None:
        box[split] = _chunk(0, shape[split], view.tp, tp_rank)
    fsdp_rank, fsdp_size = (rank, view.world) if view.sp > 1 else (dp_rank, view.dp)
    box[fsdp_dim] = _chunk(*box[fsdp_dim], fsdp_size, fsdp_rank)
    return None if any(lo >= hi for lo, hi in box) else tuple(box)


def generate_boxes(kind: str, shape: tuple[int, ...], tp: int, t: int, head_rows: int) -> list[Box]:
    """The boxes tensor-parallel rank ``t`` of a rollout group of ``tp`` needs (none: its buffer stays zeros)."""
    if tp == 1 or kind == "replicated":
        return [tuple((0, n) for n in shape)]
    if kind == "first":
        return [tuple((0, n) for n in shape)] if t == 0 else []
    if kind == "experts_column":  # (E, 2I, H): the same rows of the gate half and of the up half
        part, half = shape[1] // 2 // tp, shape[1] // 2
        return [_along(shape, 1, (h * half + t * part, h * half + (t + 1) * part)) for h in (0, 1)]
    if kind == "experts_row":  # (E, H, I): its columns of the intermediate dim
        part = shape[2] // tp
        return [_along(shape, 2, (t * part, (t + 1) * part))]
    dim = 1 if kind == "row" else 0
    part = local_shape(kind, shape, tp, head_rows)[dim]
    start = t * part
    if kind == "kv" and shape[0] // head_rows < tp:  # ranks share KV head t * KVH // tp
        start = (t * (shape[0] // head_rows) // tp) * head_rows
    box = _along(shape, dim, (start, min(start + part, shape[dim])))
    return [] if box is None else [box]


def local_shape(kind: str, shape: tuple[int, ...], tp: int, head_rows: int) -> tuple[int, ...]:
    """The shape of one rollout rank's buffer of the parameter (the last vocabulary slice padded)."""
    if tp == 1 or kind in ("replicated", "first"):
        return shape
    if kind.startswith("experts"):
        dim = 1 if kind == "experts_column" else 2
        return tuple(n // tp if d == dim else n for d, n in enumerate(shape))
    dim = 1 if kind == "row" else 0
    rows = shape[dim]
    if kind == "vocab":
        part = -(-rows // tp)
    elif kind == "kv" and rows // head_rows < tp:
        part = head_rows
    else:
        part = rows // tp
    return tuple(part if d == dim else n for d, n in enumerate(shape))
