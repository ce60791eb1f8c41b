"""The reshard plan: which box of which parameter each rank receives from which rank, computed once.

Inputs are data: every parameter's full shape, the dimension FSDP2 shards it on over the W training ranks
(rank s holds the s-th of W chunks, ``torch.chunk``'s sizes) and the box each generation rank needs
(``parallel.layout.ShardLayout`` through the ``GenerateView``). A transfer is the intersection of what a
receiver needs with what a sender holds; what a rank holds itself it copies locally. So every rank receives
exactly the elements of its generation shard that it does not already hold, each from the one rank that
holds it: the minimum any layout switch can move. ``print(plan)`` shows the bytes per rank.

With FP8 projections (``rollout.quantization=fp8``, ``quantised``) those travel and are held at one byte an
element, and their float32 rowwise scales (4 bytes a row of the full weight) reach every generation rank of a
multi-rank plan through the scales' all-reduce (``fp8_scales``): the byte counts include both.

The same plan streams weights across two pools (``trainer.async_mode=separate``): the holdings cover every
rank of the group the plan runs over, the generation view only the rollout pool's (``GenerateView.first``).
Ranks of the trainer pool hold boxes and need none, ranks of the rollout pool hold none and need their shard,
so every transfer goes from a trainer rank to a rollout rank and nothing is copied locally.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from hybridflow.engine.parallel.layout import Box, ShardLayout
from hybridflow.engine.parallel.view import GenerateView

FP8_BYTES = 1  # an e4m3 element
SCALE_BYTES = 4  # a float32 rowwise scale


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes of the same tensor, or None when they do not overlap."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def contains(outer: Box, inner: Box) -> bool:
    """Whether box ``inner`` lies inside box ``outer``."""
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner))


def volume(box: Box | None) -> int:
    """Elements in a box (0 for None)."""
    if box is None:
        return 0
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


def chunk_box(shape: tuple[int, ...], dim: int | None, world: int, rank: int) -> Box | None:
    """The box FSDP2 gives ``rank`` of ``world`` (``torch.chunk`` along ``dim``; None: the whole tensor)."""
    if dim is None or world == 1:
        return tuple((0, n) for n in shape)
    size = -(-shape[dim] // world)
    start, stop = min(rank * size, shape[dim]), min((rank + 1) * size, shape[dim])
    if start == stop:
        return None  # FSDP2 pads the split with empty chunks at the end
    return tuple((start, stop) if d == dim else (0, n) for d, n in enumerate(shape))


@dataclass(frozen=True)
class Transfer:
    """``box`` of parameter ``param`` (in full-tensor coordinates) goes from rank ``src`` to rank ``dst``."""

    param: int
    src: int
    dst: int
    box: Box


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of the plan: name, full shape, FSDP2 shard dim (None: not sharded), rollout layout."""

    name: str
    shape: tuple[int, ...]
    train_dim: int | None
    layout: ShardLayout


class ReshardPlan:
    """Every transfer of a train -> generate switch, grouped into buckets of about ``bucket_bytes``.

    ``holdings[rank][param]``: the box of each parameter each training rank holds, for any training view
    (tensor-parallel shards split again by FSDP2, parameters of other pipeline stages as None). Without it,
    FSDP2 alone over every rank: each ``ParamSpec.train_dim`` chunked W ways. The plan's ranks are the
    holdings' (the view's without them): a view on a pool of them (``view.first``) makes a cross-pool plan,
    whose other ranks only send (their rows of ``holdings``) and whose pool's ranks only receive.
    ``quantised``: per parameter, whether it goes in FP8 (``elem_size`` is the other parameters' dtype's).
    """

    def __init__(
        self,
        params: list[ParamSpec],
        view: GenerateView,
        elem_size: int,
        bucket_bytes: int,
        holdings: list[list[Box | None]] | None = None,
        train_view: str | None = None,
        quantised: list[bool] | None = None,
    ) -> None:
        self.params, self.view, self.elem_size = params, view, elem_size
        self.quantised = quantised or [False] * len(params)
        self.elems = [FP8_BYTES if q else elem_size for q in self.quantised]  # bytes an element, by parameter
        self.holdings = holdings
        self.world = view.world if holdings is None else len(holdings)  # every rank of the plan's group
        if view.end > self.world:
            raise ValueError(
                f"the generation view {view} covers ranks up to {view.end - 1}, the plan's holdings only "
                f"{self.world} ranks (a plan across pools needs every rank's holdings)"
            )
        default = f"({self.world - view.world} trainer ranks)" if self.cross_pool else f"(fsdp={view.world})"
        self.train_view = train_view or default
        self.transfers: list[Transfer] = [t for i in range(len(params)) for t in self._transfers_of(i)]
        self.buckets = self._buckets(bucket_bytes)

    def held(self, param: int, rank: int) -> Box | None:
        """The box of ``param`` training rank ``rank`` holds."""
        if self.holdings is not None:
            return self.holdings[rank][param]
        p = self.params[param]
        return chunk_box(p.shape, p.train_dim, self.view.world, rank)

    def needed(self, param: int, rank: int) -> Box | None:
        """The box of ``param`` generation rank ``rank`` needs (None: its buffer stays zeros, or the rank is
        not one of the view's: a trainer rank of a cross-pool plan)."""
        if not self.view.generates(rank):
            return None
        return self.params[param].layout.box(self.view.tp_rank(rank), self.view.ep_rank(rank))

    @property
    def cross_pool(self) -> bool:
        """Whether some ranks of the plan only send: the generation view covers a pool of them."""
        return self.view.world < self.world

    def _transfers_of(self, i: int) -> Iterator[Transfer]:
        """Each element a rank needs, from one rank that holds it: itself first, else the next ranks.

        Training views hold some parameters on several ranks (the embedding and norms are replicated over
        the tensor-parallel ranks): a replica's copy of a box already taken is not sent again.
        """
        world = self.world
        for dst in range(world):
            need = self.needed(i, dst)
            if need is None:
                continue
            taken: list[Box] = []
            for src in sorted(range(world), key=lambda r: (r - dst) % world):
                held = self.held(i, src)
                part = None if held is None else intersect(need, held)
                if part is None:
                    continue
                if any(intersect(part, box) is not None for box in taken):
                    assert any(contains(box, part) for box in taken), f"param {i}: holdings overlap in part"
                    continue
                taken.append(part)
                yield Transfer(i, src, dst, part)

    def _buckets(self, bucket_bytes: int) -> list[list[int]]:
        """Consecutive parameters, a bucket closed once its generation buffers reach ``bucket_bytes``."""
        out: list[list[int]] = [[]]
        size = 0
        for i, p in enumerate(self.params):
            out[-1].append(i)
            size += volume(tuple((0, n) for n in p.layout.local_shape())) * self.elems[i]
            if size >= bucket_bytes and i + 1 < len(self.params):
                out.append([])
                size = 0
        return out

    def uncovered(self) -> list[str]:
        """``name@rank`` of every needed box the holders do not fully cover (empty: every buffer is filled)."""
        got: dict[tuple[int, int], int] = {}
        for t in self.transfers:
            got[t.param, t.dst] = got.get((t.param, t.dst), 0) + volume(t.box)
        return [
            f"{p.name}@{rank}"
            for rank in range(self.world)
            for i, p in enumerate(self.params)
            if got.get((i, rank), 0) < volume(self.needed(i, rank))
        ]

    def bytes_received(self, rank: int) -> int:
        """Bytes ``rank`` receives from other ranks at every switch (its own part is a local copy), FP8 scales
        included (``scale_bytes_received``)."""
        data = sum(
            volume(t.box) * self.elems[t.param] for t in self.transfers if t.dst == rank and t.src != rank
        )
        return data + self.scale_bytes_received(rank)

    def scale_bytes_received(self, rank: int) -> int:
        """Bytes of FP8 scales ``rank`` receives: every quantised weight's full-row scales (float32), which the
        all-reduce of a multi-rank plan delivers to each generation rank; none at one rank."""
        if self.world == 1 or not self.view.generates(rank):
            return 0
        return (
            sum(self._rows(p.layout.plan_shape) for p, q in zip(self.params, self.quantised) if q)
            * SCALE_BYTES
        )

    def bytes_sent(self, rank: int) -> int:
        """Bytes ``rank`` sends to other ranks at every switch (its boxes; the scales' all-reduce aside)."""
        return sum(
            volume(t.box) * self.elems[t.param] for t in self.transfers if t.src == rank and t.dst != rank
        )

    def generation_bytes(self) -> int:
        """Bytes of one rank's generation buffers (every parameter's local shape, and its FP8 rows' scales; the
        same on every rank of the generation view)."""
        return sum(self._bytes(i, p.layout.local_shape()) for i, p in enumerate(self.params))

    def full_bytes(self) -> int:
        """Bytes of a whole copy of the parameters in the generation dtype (FP8 ones with their scales)."""
        return sum(self._bytes(i, p.shape) for i, p in enumerate(self.params))

    @staticmethod
    def _rows(shape: tuple[int, ...]) -> int:
        """Rows of a weight of ``shape`` (every dim but the last): its scales, quantised."""
        return volume(tuple((0, n) for n in shape[:-1]))

    def _bytes(self, param: int, shape: tuple[int, ...]) -> int:
        """Bytes of ``param`` held at ``shape``: its elements, and its rows' scales when quantised."""
        scales = self._rows(shape) * SCALE_BYTES if self.quantised[param] else 0
        return volume(tuple((0, n) for n in shape)) * self.elems[param] + scales

    def __str__(self) -> str:
        gib = 2**30
        lines = [
            f"reshard plan: train_view={self.train_view}, generate_view={self.view}, "
            f"{len(self.params)} parameters in {len(self.buckets)} bucket(s); per rank: generation buffers "
            f"{self.generation_bytes() / gib:.3f} GiB of a {self.full_bytes() / gib:.3f} GiB copy"
        ]
        for rank in range(self.world):
            sources = sorted({t.src for t in self.transfers if t.dst == rank and t.src != rank})
            pool = ("rollout" if self.view.generates(rank) else "trainer") if self.cross_pool else ""
            lines.append(
                f"  rank {rank}{f' ({pool})' if pool else ''}: receives {self.bytes_received(rank) / gib:.4f} "
                f"GiB from ranks {sources}, sends {self.bytes_sent(rank) / gib:.4f} GiB"
            )
        return "\n".join(lines)
