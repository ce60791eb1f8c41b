"""The automatic 3D layout: training and generation views and the memory levers, from the model and the GPUs.

``plan_layout(cfg, model_config, gpu_bytes)`` scores every layout the engine accepts: training tp, pp and
Ulysses sp (as validation accepts them), generation tp, no offload / optimizer offload / parameter and
optimizer offload / the optimizer step on the CPU, gradient checkpointing off or on, and the update's
micro-batch (or token budget) at the config's value and halves of it, and the rollout's sequences decoded at
once where one wave does not fit (``rollout.max_num_seqs``). For each it estimates every phase's
memory per GPU (``plan.memory``: the engine's own accounting plus activations and the KV cache) and
the step time (``plan.step_time``, from the rates measured in benchmarks/RESULTS.md), and keeps the fastest
that fits; where none fits, the one of the smallest peak and its shortfall. Keys set in the config are kept
as they are (the plan only fills the others). A vision-language model (Qwen2-VL, Qwen2.5-VL) is planned from
its text model's shapes and every parameter, its vision tower's too, on the views its training takes (FSDP2
alone, whole rollout replicas). ``Layout.line()`` is the one-line log of the choice and why; ``Layout.table()``
the memory per GPU of each phase and ``candidates_table`` (``plan.report``) the candidates scored and
their verdicts (``hybridflow plan``).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridflow.config import Config, ConfigError, validate_config
from hybridflow.config.aliases import resolve_alias
from hybridflow.config.validate import get_path
from hybridflow.config.views import divisors
from hybridflow.engine import (
    GRAD_BYTES,
    MASTER_BYTES,
    MOMENT_BYTES,
    ParallelDims,
    ViewMemory,
    unsplit_reason,
)
from hybridflow.models.vision import is_vision_language, text_config
from hybridflow.models.vision_tower import check_vision_training
from hybridflow.plan.memory import estimate_phases, generation_slots, host_bytes
from hybridflow.plan.report import gb, gigabytes, host_line, parameters_text, seconds, unchecked_host, why
from hybridflow.plan.step_time import estimate_seconds
from hybridflow.plan.switch import GenerateSplit, expert_sizes, moe_experts, switch_figures

logger = logging.getLogger(__name__)

HEADROOM = 0.9  # of a GPU's memory a plan may fill (the CUDA context, the allocator's fragmentation)
HOST_HEADROOM = 0.8  # of a node's host memory offload and the CPU step may fill (the processes, page cache)
# (the actor's parallel sizes by their long spellings, which a user can paste as they are printed)
LAYOUT_KEYS = (
    "actor.tensor_parallel_size",
    "actor.pipeline_parallel_size",
    "actor.ulysses_sequence_parallel_size",
    "rollout.tensor_model_parallel_size",
    "actor.fsdp.param_offload",
    "actor.fsdp.optimizer_offload",
    "actor.fsdp.optimizer_step_on_cpu",
    "model.enable_gradient_checkpointing",
    "actor.ppo_micro_batch_size_per_gpu",
    "actor.ppo_max_token_len_per_gpu",
    "rollout.max_num_seqs",
    "rollout.expert_parallel_size",
    "actor.parallel.ep",
)
# (param_offload, optimizer_offload, optimizer_step_on_cpu), simplest first; the CPU step moves the optimizer
# itself to the host, so it takes no optimizer offload (validation refuses the two together)
_FIELDS = dict(
    zip(LAYOUT_KEYS, (
        "tp_train", "pp", "sp", "tp_generate", "param_offload", "optimizer_offload", "cpu_step",
        "checkpointing", "micro", "token_budget", "max_seqs", "ep_generate", "ep",
    ))
)  # fmt: skip
OFFLOADS = ((False, False, False), (False, True, False), (True, True, False), (False, False, True))


@dataclass
class Layout:
    """One layout and its memory per GPU by phase (bytes); ``fits`` against ``usable`` bytes."""

    world: int
    tp_train: int = 1
    pp: int = 1
    sp: int = 1
    tp_generate: int = 1
    param_offload: bool = False
    optimizer_offload: bool = False
    # The levers below: None is the config's own value (a Layout built from a run's keys, ``trainer.oom``).
    cpu_step: bool | None = None  # actor.fsdp.optimizer_step_on_cpu
    checkpointing: bool | None = None  # model.enable_gradient_checkpointing
    micro: int | None = None  # actor.ppo_micro_batch_size_per_gpu (fixed micro-batches)
    token_budget: int | None = None  # actor.ppo_max_token_len_per_gpu (dynamic micro-batches)
    max_seqs: int | None = None  # rollout.max_num_seqs: set only where one generation wave does not fit
    dynamic: bool = False  # whether the run sizes micro-batches by tokens (which of the two levers applies)
    seconds: float | None = None  # the estimated step time (``plan.step_time``)
    considered: list[Layout] = field(default_factory=list)  # the chosen layout's: every candidate scored
    phases: dict[str, int] = field(default_factory=dict)
    usable: int | None = None
    host: int = 0  # host bytes of one node the offload or the CPU step holds
    frozen: int = 0  # elements of a frozen vision tower one rank holds (bf16, no gradients or moments)
    host_usable: int | None = None  # None: the host's memory is not checked
    views: ViewMemory | None = None
    state: tuple[int, str, int, int] | None = None  # LoRA: state bytes per GPU, what, adapters, host bytes
    reason: str = ""
    params: int = 0
    kept: dict[str, Any] = field(default_factory=dict)  # the layout keys the config set (not planned)
    # actor.parallel.ep: 1 or the most data-parallel ranks the experts split over; None for a dense model
    ep: int | None = None
    # rollout.expert_parallel_size (``plan.switch``): 1, tp_generate or tp_generate x k; None for a dense model
    ep_generate: int | None = None

    def dims(self, with_sp: bool = True) -> ParallelDims:
        """The actor's training view of this layout (the one place the planner builds it); without sp for the
        memory views, which Ulysses does not change."""
        return ParallelDims(self.world, self.tp_train, self.pp, self.sp if with_sp else 1, self.ep or 1)

    @property
    def peak(self) -> int:
        """The largest phase's bytes per GPU."""
        return max(self.phases.values(), default=0)

    @property
    def fits(self) -> bool:
        """Whether every phase fits in the usable memory (always, without a GPU to plan for), and what the
        layout keeps on the host in the host's (where it is checked)."""
        return (self.usable is None or self.peak <= self.usable) and self.host_fits

    @property
    def host_fits(self) -> bool:
        """Whether the host memory the layout holds fits the node's usable host memory (or is not checked)."""
        return self.host_usable is None or self.host <= self.host_usable

    def overrides(self) -> dict[str, Any]:
        """The config keys of this layout (a lever left at None, the config's value, is not among them)."""
        out = {path: getattr(self, name) for path, name in _FIELDS.items()}
        return {k: v for k, v in out.items() if v is not None}

    def describe(self) -> str:
        """The two views, sp and offload, as the logs name them."""
        train = str(self.dims(with_sp=False))  # sp is named on its own below
        offload = (
            "params+optimizer" if self.param_offload else "optimizer" if self.optimizer_offload
            else "cpu-step" if self.cpu_step else "none"
        )  # fmt: skip
        levers = "".join(
            f", {name}={value}"
            for name, value in (
                ("checkpointing", {True: "on", False: "off"}.get(self.checkpointing)),
                ("micro_batch", None if self.dynamic else self.micro),
                ("token_budget", self.token_budget if self.dynamic else None),
                ("rollout_seqs", self.max_seqs),
            )
            if value is not None
        )
        return (
            f"train_view={train}, generate_view={self.generate_split()}, "
            f"sp={self.sp}, offload={offload}{levers}"
        )

    def generate_split(self) -> GenerateSplit:
        """The generation view of this layout: tp_generate ranks a group, experts over ep_generate ranks."""
        return GenerateSplit(self.world, self.tp_generate, self.ep_generate or 1)

    def line(self) -> str:
        """The one-line log of the choice and why."""
        return f"auto layout: {self.describe()}: {self.reason}"

    def value(self, cfg: Config, path: str) -> Any:
        """The layout's value of a layout key, or the config's where the layout leaves it (None)."""
        value = getattr(self, _FIELDS[path])
        return get_path(cfg, path) if value is None else value

    def peak_phase(self) -> str:
        """The phase that needs the most memory per GPU."""
        return max(self.phases, key=self.phases.get)

    def verdict(self, chosen: Layout) -> str:
        """Why this candidate was or was not chosen: chosen, does not fit (by how much), or slower."""
        if self is chosen:
            return "chosen" if self.fits else "nearest, does not fit"
        if not self.host_fits:
            needs, has = gigabytes(self.host, self.host_usable, decimals=0)
            return f"does not fit: the host needs {needs} of {has} GB per node"
        if not self.fits:
            name = self.peak_phase()
            needs, has = gigabytes(self.phases[name], self.usable)
            return f"does not fit: {name} needs {needs} of {has} GB"
        if self.seconds == chosen.seconds:  # an estimate tie: the simplest of them is chosen
            return "as fast: the chosen one is simpler"
        return f"slower: {seconds(self.seconds, chosen.seconds)} s"

    def table(self) -> str:
        """The memory per GPU of each phase, and the views' own figures."""
        rows = ["| phase | GB per GPU |", "|---|---|"]
        rows += [f"| {name} | {gb(b, 2)} |" for name, b in self.phases.items()]
        if self.usable is not None:
            rows.append(f"| usable ({HEADROOM:.0%} of the GPU) | {gb(self.usable, 2)} |")
        v = self.views
        if v is not None:
            switch = "" if v.received_bytes is None else f", {gb(v.received_bytes, 3)} GB received per switch"
            state = "fp32 masters, grads, AdamW moments" + (
                ", on the host with the CPU step" if self.cpu_step else ""
            )
            held = v.state_bytes()
            if self.frozen:  # the frozen vision tower: its bf16 weights alone
                held -= self.frozen * (MASTER_BYTES + GRAD_BYTES + MOMENT_BYTES - 2)
                state += "; the frozen vision tower in bf16"
            held, state = self.state[:2] if self.state else (held, state)
            rows.append(
                f"\nper GPU: training state {gb(held, 2)} GB ({state}), "
                f"generation weights {gb(v.generation_bytes, 2)} GB{switch}"
            )
        line = host_line(self)
        if line is not None:
            rows.append(line)
        return "\n".join(rows)


_META_MODELS: dict[str, torch.nn.Module] = {}  # shape (the config as JSON) -> its meta model


@functools.lru_cache(maxsize=4)
def _accepted(path: str) -> bool:
    """Whether validation accepts ``path=2`` at two ranks (pp and Ulysses sp join the search once it does)."""
    cfg = Config()
    cfg.trainer.n_gpus_per_node = 2
    cfg.data.train_batch_size, cfg.rollout.n, cfg.actor.ppo_mini_batch_size = 2, 2, 2
    cfg.actor.ppo_micro_batch_size_per_gpu = 1
    cfg.model.use_remove_padding = True  # what Ulysses needs besides its size
    set_path(cfg, path, 2)
    return not any(p.path == path for p in validate_config(cfg))


def set_path(cfg: Config, path: str, value: Any) -> None:
    """Set the field ``path`` names (a long spelling such as ``actor.tensor_parallel_size`` too)."""
    section, key = resolve_alias(path)[0].rsplit(".", 1)
    setattr(get_path(cfg, section), key, value)


def meta_model(model_config: Any) -> torch.nn.Module:
    """The model of ``model_config`` on the meta device (shapes only, no memory; cached per shape): the causal
    LM, or a vision-language model's image-text-to-text model (its text model and vision tower)."""
    key = model_config.to_json_string(use_diff=False)
    if key not in _META_MODELS:
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        auto = AutoModelForImageTextToText if is_vision_language(model_config) else AutoModelForCausalLM
        with torch.device("meta"):
            _META_MODELS[key] = auto.from_config(model_config)
    return _META_MODELS[key]


def _candidates(cfg: Config, model: torch.nn.Module, world: int, fixed: dict[str, Any]) -> list[Layout]:
    """Every layout the engine accepts for this model and world, simplest first, matching ``fixed``."""
    pps = divisors(world) if _accepted("actor.pipeline_parallel_size") else [1]
    sps = divisors(world) if _accepted("actor.ulysses_sequence_parallel_size") else [1]
    checkpointing = _unique([cfg.model.enable_gradient_checkpointing, True])
    out = []
    for tp_t in divisors(world):
        for pp in pps:  # sizes that do not fit the world are refused by their ParallelDims (``_splits``)
            for (tp_g, ep_g), ep in itertools.product(
                _generate_views(cfg, model, world, fixed), _train_eps(model, world // (tp_t * pp), fixed)
            ):
                for sp in sps:
                    if not _splits(model, Layout(world, tp_t, pp, sp, tp_g, ep=ep, ep_generate=ep_g)):
                        continue
                    for offload in OFFLOADS:
                        for ckpt in checkpointing:
                            for micro, budget in _micro_levers(cfg, world // (tp_t * pp)):
                                layout = Layout(world, tp_t, pp, sp, tp_g, *offload, ckpt, micro, budget)
                                layout.ep, layout.ep_generate = ep, ep_g
                                layout.dynamic = cfg.actor.use_dynamic_bsz
                                layout.max_seqs = fixed.get("rollout.max_num_seqs")
                                if all(layout.overrides().get(k) == v for k, v in fixed.items()):
                                    out.append(layout)
    scratch = copy.deepcopy(cfg)  # every candidate sets every layout key: one copy serves them all
    out = [x for x in out if _valid(cfg, x, scratch)]
    return sorted(out, key=lambda x: _simplicity(cfg, x))


def _train_eps(model: torch.nn.Module, dp: int, fixed: dict[str, Any]) -> list[int | None]:
    """actor.parallel.ep values to try: the config's, or for a mixture of experts 1 and the most data-parallel
    ranks its experts split over (each rank then gathers E / ep experts a layer instead of all E: the same
    state per rank, a smaller gathered layer); None for a dense model."""
    experts = moe_experts(model)
    if "actor.parallel.ep" in fixed or not experts:
        return [fixed.get("actor.parallel.ep")]
    return _unique([1, max(e for e in divisors(max(dp, 1)) if experts % e == 0)])


def _generate_views(
    cfg: Config, model: torch.nn.Module, world: int, fixed: dict[str, Any]
) -> list[tuple[int, int | None]]:
    """(tp_generate, ep_generate) pairs to try: every tp dividing the world, and for a mixture of experts every
    expert-parallel size of it (``plan.switch.expert_sizes``: sliced, whole over the group, whole over k
    groups) that validation takes (``_valid``), or the config's; a dense model has no ep_generate (None)."""
    experts = moe_experts(model)
    kept = fixed.get("rollout.expert_parallel_size")
    out = []
    for tp_g in divisors(world):
        sizes = [kept] if kept is not None or not experts else expert_sizes(world, tp_g, experts)
        out += [(tp_g, ep_g) for ep_g in sizes if ep_g is None or ep_g == 1 or ep_g % tp_g == 0]
    return out


def _unique(values: list[Any]) -> list[Any]:
    return list(dict.fromkeys(values))


def _micro_levers(cfg: Config, dp: int) -> list[tuple[int, int]]:
    """(micro-batch, token budget) pairs to try: the config's, then halves of the one the run sizes by.

    A config value that cannot be (a micro-batch that does not divide this GPU's share of a mini-batch, a
    budget below one sample) is a default the plan chooses (a value the user set was checked on loading): the
    largest micro-batch below it that divides the share, or a budget of one whole sample, stand in for it."""
    a, d = cfg.actor, cfg.data
    micro, budget = a.ppo_micro_batch_size_per_gpu, a.ppo_max_token_len_per_gpu
    length = d.max_prompt_length + d.max_response_length
    share = -(-a.ppo_mini_batch_size * cfg.rollout.n // max(dp, 1))
    if a.use_dynamic_bsz:
        budget = max(budget, length)
    elif share % micro:
        micro = max(m for m in range(1, min(micro, share) + 1) if share % m == 0)
    out = [(micro, budget)]
    if a.use_dynamic_bsz:  # halves down to one whole sample
        while budget // 2 >= length and len(out) < 4:
            budget //= 2
            out.append((micro, budget))
    else:  # halves that still divide this GPU's share of a mini-batch
        while micro > 1 and len(out) < 4:
            micro //= 2
            if share % micro == 0:
                out.append((micro, budget))
    return out


def _simplicity(cfg: Config, x: Layout) -> tuple:
    """Simplest first: fewer model-parallel ranks, no offload, the config's own levers, smaller groups."""
    offload = OFFLOADS.index((x.param_offload, x.optimizer_offload, x.cpu_step))
    own = (x.checkpointing != cfg.model.enable_gradient_checkpointing) + (
        (x.micro, x.token_budget)
        != (cfg.actor.ppo_micro_batch_size_per_gpu, cfg.actor.ppo_max_token_len_per_gpu)
    )
    return (
        x.tp_train * x.pp, offload, own, -(x.micro or 0), -(x.token_budget or 0), x.tp_generate, x.sp,
        x.ep or 1, x.ep_generate or 1,
    )  # fmt: skip


def _splits(model: torch.nn.Module, layout: Layout) -> bool:
    """Whether the model splits as the layout asks (heads and MLP over tp, layers over pp, heads over sp).

    A vision-language model trains on FSDP2 alone and generates on whole replicas (``check_vision_training``,
    the switch's ``check_vision_tp``): any other view is refused."""
    if is_vision_language(model.config):
        return max(layout.tp_train, layout.pp, layout.sp, layout.ep or 1, layout.tp_generate) == 1
    ep_g = layout.ep_generate or 1
    if ep_g > 1 and (moe_experts(model) % ep_g or layout.world % ep_g):
        return False
    # experts split across rollout groups (ep_g > tp_g) are whole on each rank as at ep_g = tp_g
    if unsplit_reason(model, layout.tp_train, layout.tp_generate, min(ep_g, layout.tp_generate)) is not None:
        return False
    try:  # the view the actor would build (sizes that do not fit the world are refused here too)
        layout.dims().check_model(model.config)
    except ValueError:
        return False
    return True


def _valid(cfg: Config, layout: Layout, scratch: Config | None = None) -> bool:
    """Whether validation accepts the config with the layout (how sp, pp and tp may combine is its to say).

    ``scratch``: a copy of ``cfg`` to set the keys in (its layout keys are overwritten), instead of a new one.
    """
    out = copy.deepcopy(cfg) if scratch is None else scratch
    for path, value in layout.overrides().items():
        set_path(out, path, value)
    return not validate_config(out)


def explicit_layout_keys(cfg: Config, given: set[str] | None = None) -> dict[str, Any]:
    """The layout keys the config sets: ``given`` paths, and any that differs from its default."""
    default = Config()
    out = {}
    for path in LAYOUT_KEYS:
        value = get_path(cfg, path)
        if (given and resolve_alias(path)[0] in given) or value != get_path(default, path):
            out[path] = value
    return out


def plan_layout(
    cfg: Config,
    model_config: Any,
    gpu_bytes: int | None,
    given: set[str] | None = None,
    host_memory: int | None = None,
) -> Layout:
    """The fastest layout (by ``plan.step_time``'s estimate) whose every phase fits ``gpu_bytes`` per GPU
    (None: no GPU, the plain layout) and whose offload fits ``host_memory`` bytes per node (None: not checked);
    where none fits, the one of the smallest peak, saying by how much.

    A vision-language ``model_config``: the text model's shapes size the activations and the KV cache, and what
    its training refuses (``check_vision_training``) is refused here too."""
    world = cfg.trainer.world_size
    fixed = explicit_layout_keys(cfg, given)
    check_vision_training(cfg, model_config)
    model = meta_model(model_config)
    model_config, size = text_config(model_config), parameters_text(cfg, model)
    candidates = _candidates(cfg, model, world, fixed)
    if not candidates:
        layout = Layout(world)
        for path, value in fixed.items():
            setattr(layout, _FIELDS[path], value)
        layout.reason = "the keys set in the config leave no layout to choose"
        return layout
    usable = None if gpu_bytes is None else int(gpu_bytes * HEADROOM)
    host_usable = None if gpu_bytes is None or host_memory is None else int(host_memory * HOST_HEADROOM)
    for layout in candidates:
        layout.usable, layout.host_usable = usable, host_usable
        layout.phases = estimate_phases(cfg, model_config, model, layout)
        if usable is not None and "rollout.max_num_seqs" not in fixed:
            _fit_generation_waves(cfg, model_config, model, layout)
        layout.host = host_bytes(cfg, layout)
        layout.seconds = estimate_seconds(cfg, model_config, layout)
    first = candidates[0]
    fitting = [x for x in candidates if x.fits]
    if gpu_bytes is None or fitting:  # stable: among equal estimates the simplest
        best = first if gpu_bytes is None else min(fitting, key=lambda x: x.seconds)
        best.reason = why(best, first, fixed, gpu_bytes, size) + unchecked_host(best)
        best.considered = candidates
        return _with_switch(model, best)
    best = min(candidates, key=lambda x: (not x.host_fits, x.peak))
    best.reason = (
        why(best, first, fixed, gpu_bytes, size) + "; " + _short_of(cfg, model_config, model, best, usable)
    ) + unchecked_host(best)
    if best.peak_phase() == "update_actor" and not best.value(cfg, "model.enable_gradient_checkpointing"):
        best.reason += (
            "; model.enable_gradient_checkpointing=true (or a smaller actor.ppo_micro_batch_size_per_gpu) "
            "would cut the update's activations"
        )
    best.considered = candidates
    return _with_switch(model, best)


def _fit_generation_waves(cfg: Config, mc: Any, model: torch.nn.Module, layout: Layout) -> None:
    """Where one wave of the rollout's sequences overflows the GPU (or the rollout's own share,
    ``rollout.gpu_memory_utilization``), decode fewer at once: ``rollout.max_num_seqs`` set to the most that
    fit (whole groups of ``rollout.n`` where a group fits), the other sequences in later waves (time)."""
    slots, per_slot = generation_slots(cfg, mc, layout)
    gpu = layout.usable / HEADROOM
    room = min(layout.usable, cfg.rollout.gpu_memory_utilization * gpu)
    other = layout.phases["generate"] - slots * per_slot  # what the phase holds besides the KV cache
    fit = int((room - other) // per_slot)
    if fit >= slots or fit < 1:  # one wave fits, or not even one sequence does (the phase does not fit)
        return
    n = cfg.rollout.n
    layout.max_seqs = fit - fit % n if fit >= n else fit
    layout.phases = estimate_phases(cfg, mc, model, layout)


def _with_switch(model: torch.nn.Module, layout: Layout) -> Layout:
    """The chosen layout with the bytes its switch moves (``plan.switch``: the reshard plan's count)."""
    dims, tp_g, ep_g = layout.dims(with_sp=False), layout.tp_generate, layout.ep_generate or 1
    received = switch_figures(model, dims, tp_g, ep_g).received_bytes
    layout.views = dataclasses.replace(layout.views, received_bytes=received)
    return layout


def _short_of(cfg: Config, mc: Any, model: torch.nn.Module, layout: Layout, usable: int | None) -> str:
    """How many GPUs of this size the run would need (the same layout kinds over more ranks)."""
    for world in (2, 4, 8, 16, 32, 64, 128, 256, 512):
        if world <= layout.world:
            continue
        wider = copy.deepcopy(cfg)
        wider.trainer.nnodes, wider.trainer.n_gpus_per_node = 1, world
        # the widest rollout group of up to 8 GPUs that splits the model's heads
        tp_g = next(
            (t for t in (8, 4, 2, 1) if t <= world and _splits(model, Layout(world, tp_generate=t))), 1
        )
        for offload, name in (((True, True, False), "offload"), ((False, False, True), "the CPU step")):
            trial = Layout(world, 1, 1, 1, tp_g, *offload, True, usable=usable)
            trial.phases = estimate_phases(wider, mc, model, trial)
            if trial.fits:
                return (
                    f"it would fit on about {world} such GPUs (FSDP2 over all, {name}, checkpointing, "
                    f"rollout tp={trial.tp_generate})"
                )
    return "it does not fit on up to 512 such GPUs"


def apply_layout(cfg: Config, layout: Layout) -> Config:
    """``cfg`` with the layout's keys set, validated (a copy)."""
    out = copy.deepcopy(cfg)
    for path, value in layout.overrides().items():
        set_path(out, path, value)
    problems = validate_config(out)
    if problems:
        raise ConfigError(problems)
    return out
