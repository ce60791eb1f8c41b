"""How the planner (``plan.search``) writes its figures and its candidates (``hybridflow plan``).

``gigabytes`` writes byte counts in GB with as many decimals as they need: a figure that is not zero never
reads 0, and two figures compared with each other ("needs A of B GB") never read the same when they differ.
``candidates_table`` is the table of the candidates the plan scored: the chosen layout, then the best few of
each verdict (the fastest of those that fit but are slower, the nearest of those whose GPU memory, phase by
phase, or host memory does not fit), or every candidate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hybridflow.config import Config
from hybridflow.models.vision_tower import vision_tower

# ``layout`` arguments are ``plan.search.Layout`` (not imported: that module imports this one)
Layout = Any

GB = 1e9
MOST_DECIMALS = 9  # a GB to the byte
PER_VERDICT = 3  # the candidates of each verdict the short table shows


def _places(value: float, decimals: int) -> int:
    """The fewest decimals, at least ``decimals``, that do not show a non-zero ``value`` as 0."""
    places = decimals
    while value and round(value, places) == 0 and places < MOST_DECIMALS:
        places += 1
    return places


def _apart(values: tuple[float, ...], places: list[int]) -> tuple[str, ...]:
    """``values`` with at least ``places`` decimals each, more (for all) until different values read apart."""
    for extra in range(MOST_DECIMALS + 1):
        texts = tuple(f"{v:.{min(p + extra, MOST_DECIMALS)}f}" for v, p in zip(values, places))
        if len(set(texts)) == len(set(values)):
            break
    return texts


def gigabytes(*values: float, decimals: int = 1) -> tuple[str, ...]:
    """``values`` (bytes) in GB with ``decimals`` decimals, or more where that would show a non-zero figure as 0
    or two different figures as the same number."""
    gbs = tuple(v / GB for v in values)
    return _apart(gbs, [_places(v, decimals) for v in gbs])


def gb(value: float, decimals: int = 1) -> str:
    """One figure in GB (``gigabytes``)."""
    return gigabytes(value, decimals=decimals)[0]


def gpu_size(value: float) -> str:
    """A memory size as given (80, 141, 1.5): whole GB without decimals, else one decimal (or more if needed)."""
    whole = round(value / GB)
    return str(whole) if abs(value - whole * GB) < 0.05 * GB else gb(value)


def seconds(value: float, other: float | None = None) -> str:
    """An estimated time in seconds with one decimal, or as many as a short one needs not to read 0 (and, with
    ``other``, not to read as ``other`` where it differs)."""
    if other is None:
        return f"{value:.{_places(value, 1)}f}"
    return _apart((value, other), [_places(value, 1), _places(other, 1)])[0]


def phase_over(layout: Layout, of: int | None = None) -> str:
    """The layout's largest phase and its GB per GPU (``of`` so many usable bytes, told apart from them)."""
    name = layout.peak_phase()
    if of is None:
        return f"{name} needs {gb(layout.phases[name])} GB"
    needs, has = gigabytes(layout.phases[name], of)
    return f"{name} needs {needs} GB of {has}"


def parameters_text(cfg: Config, model: torch.nn.Module) -> str:
    """The model's size as the reason names it: with a vision-language model's tower, and whether it trains."""

    def count(n: int) -> str:
        return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"

    text = f"{count(sum(p.numel() for p in model.parameters()))} parameters"
    tower = vision_tower(model)
    if tower is None:
        return text
    state = "frozen" if cfg.model.freeze_vision_tower else "trained"
    return f"{text} (vision tower {count(sum(p.numel() for p in tower.parameters()))}, {state})"


def why(layout: Layout, first: Layout, fixed: dict[str, Any], gpu_bytes: int | None, size: str) -> str:
    """Why this layout: the model (``size``) and GPUs, what did not fit or was slower, the estimate, what the
    config fixed."""
    kept = f"; kept from the config: {', '.join(f'{k}={v}' for k, v in fixed.items())}" if fixed else ""
    if gpu_bytes is None:
        return f"{size} on {layout.world} rank(s) without a GPU: nothing to fit, the plain layout{kept}"
    gpus = f"{layout.world} GPU(s) of {gpu_size(gpu_bytes)} GB"
    step = f"; estimated step {seconds(layout.seconds)} s (an estimate from benchmarks/RESULTS.md rates)"
    if not layout.host_fits:
        needs, has = gigabytes(layout.host, layout.host_usable, decimals=0)
        return (
            f"{size} on {gpus}: no layout fits, this one fits the GPU ({phase_over(layout)}) but its host memory "
            f"does not ({needs} of {has} GB per node){kept}"
        )
    if not layout.fits:
        return (
            f"{size} on {gpus}: no layout fits, the smallest peak is this one "
            f"({phase_over(layout, layout.usable)}, {gb(layout.peak - layout.usable)} GB short){kept}"
        )
    if layout is first:
        return f"{size} on {gpus}: the simplest layout fits ({phase_over(layout, layout.usable)}){step}{kept}"
    if first.fits:
        return (
            f"{size} on {gpus}: the fastest that fits ({phase_over(layout, layout.usable)}); the simplest, "
            f"{first.describe()}, fits too but is slower ({seconds(first.seconds)} s){step}{kept}"
        )
    return (
        f"{size} on {gpus}: {first.describe()} does not fit ({phase_over(first, first.usable)}); "
        f"this one does ({phase_over(layout)}) and is the fastest that fits{step}{kept}"
    )


def unchecked_host(layout: Layout) -> str:
    """The reason's note when the host's memory was not checked against what the layout keeps there."""
    if layout.usable is None or layout.host_usable is not None or not layout.host:
        return ""
    return f"; host memory not checked: this layout keeps {gb(layout.host)} GB per node on the host"


def verdict_kind(x: Layout, chosen: Layout) -> str:
    """The reason of a candidate's verdict without its figures: chosen, slower, which phase does not fit the
    GPU, or the host."""
    if x is chosen:
        return "chosen"
    if not x.host_fits:
        return "host"
    return f"gpu:{x.peak_phase()}" if not x.fits else "slower"


def _rank(kind: str) -> Callable[[Layout], tuple]:
    """Best first within a verdict: the fastest of the slower ones, the nearest of those that do not fit."""
    if kind == "slower":
        return lambda x: (x.seconds,)
    if kind == "host":
        return lambda x: (x.host, x.peak)
    return lambda x: (x.peak, x.seconds)


def shown_candidates(layout: Layout, every: bool = False) -> list[Layout]:
    """The rows of the table: the chosen layout, then every candidate (``every``) or the best ``PER_VERDICT`` of
    each verdict, verdicts in the order slower, GPU memory (by phase), host memory."""
    groups: dict[str, list[Layout]] = {}
    for x in layout.considered:
        if x is not layout:
            groups.setdefault(verdict_kind(x, layout), []).append(x)
    order = sorted(groups, key=lambda k: (k != "slower", k == "host", k))
    rows = [layout]
    for kind in order:
        ranked = sorted(groups[kind], key=_rank(kind))
        rows += ranked if every else ranked[:PER_VERDICT]
    return rows


def candidates_table(layout: Layout, every: bool = False) -> str:
    """The candidates the plan scored: peak phase, GB per GPU, host GB per node, estimated step, verdict; the
    chosen one and the best few of each verdict (``shown_candidates``), or ``every`` one."""
    rows = ["| candidate | peak phase | GB per GPU | host GB per node | est. step s | verdict |"]
    rows.append("|---|---|---|---|---|---|")
    if not layout.phases:  # nothing was scored: the keys set leave no layout
        return "\n".join([*rows, f"(no candidate: {layout.reason})"])
    shown = shown_candidates(layout, every)
    steps = [seconds(x.seconds, layout.seconds) for x in shown[1:]]  # as each verdict compares them
    places = max([len(t.partition(".")[2]) for t in steps] + [_places(layout.seconds, 1)])
    steps.insert(0, f"{layout.seconds:.{places}f}")  # the chosen one as finely as the finest of the others
    for x, step in zip(shown, steps):
        name = x.peak_phase()
        rows.append(
            f"| {x.describe()} | {name} | {gb(x.phases[name], 2)} | {gb(x.host, 0)} | {step} "
            f"| {x.verdict(layout)} |"
        )
    total = len(layout.considered)
    if len(shown) < total:
        rows.append(f"({total - len(shown)} more candidates not shown; --all lists all {total})")
    return "\n".join(rows)


def host_line(layout: Layout) -> str | None:
    """What the layout keeps on the host per node (offload, the CPU step) and whether the node's memory was
    checked against it (None: nothing on the host)."""
    if not layout.host:
        return None
    line = f"host memory per node (offload, CPU step): {gb(layout.host)} GB"
    if layout.host_usable is not None:
        return f"{line} of {gb(layout.host_usable)} usable"
    return (
        f"{line}, not checked: planning for GPUs other than this machine's (pass --host-memory-gb, the memory "
        "of one node, to check it)"
    )
