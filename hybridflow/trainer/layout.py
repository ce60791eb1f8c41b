"""The automatic 3D layout: training and generation views picked from the model's size and the GPUs.

``plan_layout(cfg, model_config, gpu_bytes)`` tries every layout the engine accepts today (training tp, and
pp and Ulysses sp once validation accepts them; generation tp; no offload, optimizer offload, parameter and
optimizer offload), estimates each phase's memory per GPU from the engine's own accounting
(``engine.hybrid.memory``: held boxes, the reshard plan's generation shard) plus activations and the KV
cache, and keeps the first that fits, simplest first: FSDP2 alone before tensor parallelism, no offload before
offload, smaller rollout groups before larger ones. Keys set in the config are kept as they are (the plan
only fills the others). ``Layout.line()`` is the one-line log of the choice and why; ``Layout.table()`` the
memory per GPU of each phase (``hybridflow plan``).
"""

from __future__ import annotations

import copy
import functools
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
    view_memory,
)

logger = logging.getLogger(__name__)

GB = 1e9
HEADROOM = 0.9  # of a GPU's memory a plan may fill (the CUDA context, the allocator's fragmentation)
# (the actor's parallel sizes by their long spellings, which a user can paste as they are printed)
LAYOUT_KEYS = (
    "actor.tensor_parallel_size",
    "actor.pipeline_parallel_size",
    "actor.ulysses_sequence_parallel_size",
    "rollout.tensor_model_parallel_size",
    "actor.fsdp.param_offload",
    "actor.fsdp.optimizer_offload",
)
OFFLOADS = ((False, False), (False, True), (True, True))  # (param_offload, optimizer_offload)
# Model shapes ``hybridflow plan --model-shape`` knows (the HF config fields that size the memory).
MODEL_SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(model_type="qwen2", hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(model_type="qwen2", hidden_size=1536, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
    "llama-3-8b": dict(model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False),
    "llama-3-70b": dict(model_type="llama", hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, intermediate_size=28672, vocab_size=128256, tie_word_embeddings=False),
}  # fmt: skip


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
    phases: dict[str, int] = field(default_factory=dict)
    usable: int | None = None
    views: ViewMemory | None = None
    reason: str = ""
    params: int = 0
    kept: dict[str, Any] = field(default_factory=dict)  # the layout keys the config set (not planned)

    def dims(self, with_sp: bool = True) -> ParallelDims:
        """The actor's training view of this layout (the one place the planner builds it); without sp for the
        memory views, which Ulysses does not change."""
        return ParallelDims(self.world, self.tp_train, self.pp, self.sp if with_sp else 1)

    @property
    def peak(self) -> int:
        """The largest phase's bytes per GPU."""
        return max(self.phases.values(), default=0)

    @property
    def fits(self) -> bool:
        """Whether every phase fits in the usable memory (always, without a GPU to plan for)."""
        return self.usable is None or self.peak <= self.usable

    def overrides(self) -> dict[str, Any]:
        """The config keys of this layout."""
        return {
            "actor.tensor_parallel_size": self.tp_train,
            "actor.pipeline_parallel_size": self.pp,
            "actor.ulysses_sequence_parallel_size": self.sp,
            "rollout.tensor_model_parallel_size": self.tp_generate,
            "actor.fsdp.param_offload": self.param_offload,
            "actor.fsdp.optimizer_offload": self.optimizer_offload,
        }

    def describe(self) -> str:
        """The two views, sp and offload, as the logs name them."""
        train = str(self.dims(with_sp=False))  # sp is named on its own below
        offload = (
            "params+optimizer" if self.param_offload else "optimizer" if self.optimizer_offload else "none"
        )
        return (
            f"train_view={train}, generate_view=(tp={self.tp_generate}, dp={self.world // self.tp_generate}), "
            f"sp={self.sp}, offload={offload}"
        )

    def line(self) -> str:
        """The one-line log of the choice and why."""
        return f"auto layout: {self.describe()}: {self.reason}"

    def table(self) -> str:
        """The memory per GPU of each phase, and the views' own figures."""
        rows = ["| phase | GB per GPU |", "|---|---|"]
        rows += [f"| {name} | {b / GB:.2f} |" for name, b in self.phases.items()]
        if self.usable is not None:
            rows.append(f"| usable ({HEADROOM:.0%} of the GPU) | {self.usable / GB:.2f} |")
        v = self.views
        if v is not None:
            switch = (
                "" if v.received_bytes is None else f", {v.received_bytes / GB:.3f} GB received per switch"
            )
            rows.append(
                f"\nper GPU: training state {v.state_bytes() / GB:.2f} GB (fp32 masters, grads, AdamW moments), "
                f"generation weights {v.generation_bytes / GB:.2f} GB{switch}"
            )
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
    """The causal LM of ``model_config`` on the meta device (shapes only, no memory; cached per shape)."""
    key = model_config.to_json_string(use_diff=False)
    if key not in _META_MODELS:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            _META_MODELS[key] = AutoModelForCausalLM.from_config(model_config)
    return _META_MODELS[key]


def shape_config(name: str) -> Any:
    """The HF config of a known model shape (``MODEL_SHAPES``)."""
    from transformers import AutoConfig

    if name not in MODEL_SHAPES:
        from hybridflow.utils.errors import UserError

        raise UserError(f"unknown model shape {name!r}; use one of {', '.join(MODEL_SHAPES)}")
    kwargs = dict(MODEL_SHAPES[name])
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)


def _kv_bytes(cfg: Config, mc: Any, layout: Layout, rollout_bytes: int) -> int:
    """The rollout's KV cache per GPU: its group's share of the samples, each of the context length."""
    d, r = cfg.data, cfg.rollout
    heads = mc.num_attention_heads
    kv = getattr(mc, "num_key_value_heads", None) or heads
    head_dim = getattr(mc, "head_dim", None) or mc.hidden_size // heads
    local_kv = max(1, kv // layout.tp_generate)
    per_token = mc.num_hidden_layers * 2 * local_kv * head_dim * rollout_bytes
    groups = layout.world // layout.tp_generate
    slots = min(r.max_num_seqs, -(-d.train_batch_size * r.n // groups))
    context = r.max_model_len or d.max_prompt_length + d.max_response_length
    return slots * context * per_token + slots * mc.vocab_size * 4 // layout.tp_generate


# Fitted on one H200 (benchmarks/plan_check.py, Qwen2.5-0.5B and 1.5B shapes, GRPO workloads W1 and W2, bf16
# with remove-padding and dynamic micro-batches): what the update's backward really keeps of the bf16 tensors a
# decoder layer could save, and the bytes per LM-head (embedding) parameter its buffers take during the update
# (growing with the micro-batch up to HEAD_FULL_TOKENS). Checked on held-out runs: a 32k-token budget (1.5B)
# within 7%; fixed micro-batches of 4 samples (0.5B) were overestimated by 30% before the head's growth term.
SAVED_SHARE = 0.57
HEAD_BYTES_PER_PARAM = 41
HEAD_FULL_TOKENS = 8192


def _micro_tokens(samples: int, length: int, dynamic: bool, budget: int, micro: int) -> int:
    """Tokens of one micro-batch: ``micro`` samples, or, by a token budget, the samples split evenly."""
    if not dynamic:
        return micro * length
    total = max(samples, 1) * length
    return -(-total // -(-total // budget))


def _activation_bytes(cfg: Config, mc: Any, layout: Layout, backward: bool) -> int:
    """One micro-batch's activations per GPU: a backward's saved tensors and head buffers, or a forward's MLP."""
    a, r, d = cfg.actor, cfg.rollout, cfg.data
    length = d.max_prompt_length + d.max_response_length
    dp = layout.world // (layout.tp_train * layout.pp)
    if backward:  # the update's micro-batch of one mini-batch
        samples = -(-a.ppo_mini_batch_size * r.n // dp)
        tokens = _micro_tokens(
            samples, length, a.use_dynamic_bsz, a.ppo_max_token_len_per_gpu, a.ppo_micro_batch_size_per_gpu
        )
    else:  # the old-log-prob (and reference) pass over the whole batch
        samples = -(-d.train_batch_size * r.n // dp)
        budget, micro = r.log_prob_max_token_len_per_gpu, r.log_prob_micro_batch_size_per_gpu
        tokens = _micro_tokens(samples, length, r.log_prob_use_dynamic_bsz, budget, micro)
    tokens //= layout.sp
    h, tp = mc.hidden_size, layout.tp_train
    i = getattr(mc, "intermediate_size", None) or getattr(mc, "n_inner", None) or 4 * h  # GPT-2: n_inner
    if not backward:  # no graph kept: the MLP's gate, up and product of one layer at a time
        return tokens * 2 * 3 * i // tp
    kv_dim = (getattr(mc, "num_key_value_heads", None) or mc.num_attention_heads) * (
        h // mc.num_attention_heads
    )
    layer = int(SAVED_SHARE * tokens * 2 * (6 * h + 2 * kv_dim + 4 * i)) // tp  # one layer's saved tensors
    layers = -(-mc.num_hidden_layers // layout.pp)
    saved = tokens * 2 * h * layers + layer if cfg.model.enable_gradient_checkpointing else layer * layers
    # 1F1B: the first stage holds the saved tensors of up to pp micro-batches at once
    saved *= min(layout.pp, -(-samples * length // max(tokens * layout.sp, 1)))
    head = HEAD_BYTES_PER_PARAM * mc.vocab_size * h * min(tokens, HEAD_FULL_TOKENS) // HEAD_FULL_TOKENS // tp
    return saved + head


@functools.lru_cache(maxsize=64)
def _views(model: torch.nn.Module, dims: ParallelDims, tp_generate: int) -> ViewMemory:
    """The views' figures without the switch's transfers (offload does not change them)."""
    return view_memory(model, dims, tp_generate, switch=False)


def estimate_phases(cfg: Config, mc: Any, model: torch.nn.Module, layout: Layout) -> dict[str, int]:
    """Bytes per GPU of each phase of a step under ``layout`` (the actor; a colocated reference added)."""
    v = _views(model, layout.dims(with_sp=False), layout.tp_generate)  # sp: no change
    layout.views, layout.params = v, v.full_elements
    held = v.held_elements
    masters, moments, grads = held * MASTER_BYTES, held * MOMENT_BYTES, held * GRAD_BYTES
    ref = held * 2 if cfg.use_reference and not cfg.ref.fsdp.param_offload else 0
    # At one rank FSDP2 keeps the bf16 layers gathered through the micro-batches; above, two layers at once.
    gathered = held * 2 if layout.world == 1 else 2 * v.layer_bytes
    if layout.world == 1:
        generation = held * 2  # the rollout reads a bf16 cast of the masters
    else:
        generation = v.generation_bytes
    resident = (0 if layout.param_offload else masters) + (0 if layout.optimizer_offload else moments)
    return {
        "generate": resident + ref + generation + _kv_bytes(cfg, mc, layout, 2),
        "log_prob": masters + (0 if layout.optimizer_offload else moments) + ref + gathered
        + _activation_bytes(cfg, mc, layout, backward=False),
        "update_actor": masters + moments + grads + ref + gathered + _activation_bytes(cfg, mc, layout, True),
    }  # fmt: skip


def _candidates(cfg: Config, model: torch.nn.Module, world: int, fixed: dict[str, Any]) -> list[Layout]:
    """Every layout the engine accepts for this model and world, simplest first, matching ``fixed``."""
    pps = divisors(world) if _accepted("actor.pipeline_parallel_size") else [1]
    sps = divisors(world) if _accepted("actor.ulysses_sequence_parallel_size") else [1]
    out = []
    for tp_t in divisors(world):
        for pp in pps:  # sizes that do not fit the world are refused by their ParallelDims (``_splits``)
            for offload in OFFLOADS:
                for tp_g in divisors(world):
                    for sp in sps:
                        layout = Layout(world, tp_t, pp, sp, tp_g, *offload)
                        if all(layout.overrides()[k] == v for k, v in fixed.items()):
                            out.append(layout)
    out = [x for x in out if _splits(model, x) and _valid(cfg, x)]
    return sorted(
        out, key=lambda x: (x.tp_train * x.pp, x.param_offload + x.optimizer_offload, x.tp_generate, x.sp)
    )


def _splits(model: torch.nn.Module, layout: Layout) -> bool:
    """Whether the model splits as the layout asks (heads and MLP over tp, layers over pp, heads over sp)."""
    if unsplit_reason(model, layout.tp_train, layout.tp_generate) is not None:
        return False
    try:  # the view the actor would build (sizes that do not fit the world are refused here too)
        layout.dims().check_model(model.config)
    except ValueError:
        return False
    return True


def _valid(cfg: Config, layout: Layout) -> bool:
    """Whether validation accepts the config with the layout (how sp, pp and tp may combine is its to say)."""
    out = copy.deepcopy(cfg)
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
    cfg: Config, model_config: Any, gpu_bytes: int | None, given: set[str] | None = None
) -> Layout:
    """The simplest layout whose every phase fits ``gpu_bytes`` per GPU (None: no GPU, the default layout)."""
    world = cfg.trainer.world_size
    fixed = explicit_layout_keys(cfg, given)
    model = meta_model(model_config)
    candidates = _candidates(cfg, model, world, fixed)
    if not candidates:
        layout = Layout(world)
        for path, value in fixed.items():
            setattr(layout, _FIELDS[path], value)
        layout.reason = "the keys set in the config leave no layout to choose"
        return layout
    usable = None if gpu_bytes is None else int(gpu_bytes * HEADROOM)
    first = None
    for layout in candidates:
        layout.usable = usable
        layout.phases = estimate_phases(cfg, model_config, model, layout)
        first = first or layout
        if layout.fits:
            layout.reason = _why(layout, first, fixed, gpu_bytes)
            return _with_switch(model, layout)
    best = min(candidates, key=lambda x: x.peak)
    best.reason = (
        _why(best, first, fixed, gpu_bytes) + "; " + _short_of(cfg, model_config, model, best, usable)
    )
    if (
        max(best.phases, key=best.phases.get) == "update_actor"
        and not cfg.model.enable_gradient_checkpointing
    ):
        best.reason += (
            "; model.enable_gradient_checkpointing=true (or a smaller actor.ppo_micro_batch_size_per_gpu) "
            "would cut the update's activations"
        )
    return _with_switch(model, best)


def _with_switch(model: torch.nn.Module, layout: Layout) -> Layout:
    """The chosen layout with the bytes its switch moves (from the reshard plan; up to 64 ranks)."""
    if layout.world <= 64:
        layout.views = view_memory(model, layout.dims(with_sp=False), layout.tp_generate)
    return layout


_FIELDS = dict(
    zip(LAYOUT_KEYS, ("tp_train", "pp", "sp", "tp_generate", "param_offload", "optimizer_offload"))
)


def _phase_over(layout: Layout) -> str:
    name = max(layout.phases, key=layout.phases.get)
    return f"{name} needs {layout.phases[name] / GB:.1f} GB"


def _why(layout: Layout, first: Layout, fixed: dict[str, Any], gpu_bytes: int | None) -> str:
    """Why this layout: the model and GPUs, what did not fit before it, what the config fixed."""
    n = layout.params
    size = f"{n / 1e9:.2f}B parameters" if n >= 1e8 else f"{n / 1e6:.2f}M parameters"
    kept = f"; kept from the config: {', '.join(f'{k}={v}' for k, v in fixed.items())}" if fixed else ""
    if gpu_bytes is None:
        return f"{size} on {layout.world} rank(s) without a GPU: nothing to fit, the plain layout{kept}"
    gpus = f"{layout.world} GPU(s) of {gpu_bytes / GB:.0f} GB"
    if not layout.fits:
        return (
            f"{size} on {gpus}: no layout fits, the smallest peak is this one ({_phase_over(layout)}){kept}"
        )
    if layout is first:
        return f"{size} on {gpus}: the simplest layout fits ({_phase_over(layout)} of {layout.usable / GB:.1f}){kept}"
    return (
        f"{size} on {gpus}: {first.describe()} does not fit ({_phase_over(first)} of {first.usable / GB:.1f}); "
        f"this one does ({_phase_over(layout)}){kept}"
    )


def _short_of(cfg: Config, mc: Any, model: torch.nn.Module, layout: Layout, usable: int | None) -> str:
    """How many GPUs of this size the run would need (the same layout kinds over more ranks)."""
    for world in (2, 4, 8, 16, 32, 64, 128, 256, 512):
        if world <= layout.world:
            continue
        wider = copy.deepcopy(cfg)
        wider.trainer.nnodes, wider.trainer.n_gpus_per_node = 1, world
        trial = Layout(world, 1, 1, 1, min(world, 8), True, True, usable=usable)
        if unsplit_reason(model, 1, trial.tp_generate) is not None:
            continue
        trial.phases = estimate_phases(wider, mc, model, trial)
        if trial.fits:
            return f"it would fit on about {world} such GPUs (FSDP2 over all, offload, rollout tp={trial.tp_generate})"
    return "it does not fit on up to 512 such GPUs"


def gpu_memory_bytes() -> int | None:
    """This machine's GPU memory (the first device), or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(0).total_memory)


def apply_layout(cfg: Config, layout: Layout) -> Config:
    """``cfg`` with the layout's keys set, validated (a copy)."""
    out = copy.deepcopy(cfg)
    for path, value in layout.overrides().items():
        set_path(out, path, value)
    problems = validate_config(out)
    if problems:
        raise ConfigError(problems)
    return out
