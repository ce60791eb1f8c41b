"""An estimate of one PPO step's time under a layout, for ranking the planner's candidates (not a prediction).

``estimate_seconds(cfg, model_config, layout)`` reads the shape of the work (``Work``) and the layout's levers
(``Levers``) off the config and the layout; the rest is pure arithmetic on them, with the rates of one
H200 measured in benchmarks/RESULTS.md (named below, each with its source). What is not measured there (the
host-device and NVLink bandwidths, the fixed cost of a micro-batch) is an order-of-magnitude estimate, said so
where it is defined. The figures rank candidates sensibly (a slower lever costs time in proportion to what it
moves or recomputes); they are not meant to match a run to better than a factor of about 1.5.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridflow.config import Config
from hybridflow.config.off_policy import old_log_prob_source
from hybridflow.models.families import is_moe
from hybridflow.models.vision import text_config
from hybridflow.plan.memory import group_samples, kv_bytes_per_token, update_micro

# ``layout`` arguments are ``plan.search.Layout`` (not imported: that module imports this one)
Layout = Any

# Measured (benchmarks/RESULTS.md, one H200, bf16):
PEAK_FLOPS = 790e12  # dense bf16 FLOP/s that MFU is quoted against (an 8192^3 matmul ran at 800 TFLOP/s)
UPDATE_MFU = 0.5  # the update at 6N FLOPs/token: 48.7% (W2 0.5B) to 61.3% (W2 1.5B) MFU
LOG_PROB_MFU = 0.56  # a log-prob pass at 2N FLOPs/token: 56.0% / 56.7% (W2 0.5B old-log-prob / reference)
HBM_BYTES_PER_S = 4.3e12  # the decode roofline's HBM bandwidth
DECODE_ROOFLINE = 0.5  # decode reached 51.1% (W2 0.5B) and 50.2% (W2 1.5B) of that roofline
CHECKPOINT_RECOMPUTE = 2 / 6  # checkpointing runs one more forward (2N of the update's 6N): +33% compute
# Fitted to the CPU step's first measure (RESULTS.md, W1 0.5B: the update 0.44 s slower for 0.49B parameters,
# of which ~0.08 s is the 4 bytes/parameter over PCIe): the host's AdamW traffic, 28 bytes per parameter
# (read masters, grads, two moments; write masters, two moments) at this effective rate on 16 host cores.
HOST_ADAM_BYTES_PER_S = 40e9
HOST_ADAM_BYTES = 28
# Estimates (not measured in RESULTS.md):
PCIE_BYTES_PER_S = 25e9  # host <-> device per direction, the order PCIe 5 x16 reaches with pinned memory
NVLINK_BYTES_PER_S = 400e9  # all-reduce / all-gather bus bandwidth between H200s of one node
ALLREDUCE_LATENCY_S = 10e-6  # a small (decode-sized) all-reduce over NVLink: latency-bound
LAYER_OVERHEAD_S = 0.5e-3  # fixed cost of one decoder layer's forward + backward in a micro-batch (launches)


@dataclass(frozen=True)
class Work:
    """The step's work as the layout sees it (per GPU where it says so)."""

    params: int  # N, every parameter of the model
    held: int  # parameter elements one rank holds in the training view
    layers: int
    hidden: int
    world: int
    gpus_per_node: int
    tokens: int  # prompt + response tokens of every sample of the step
    response: int  # decode steps of one wave
    waves: int  # generation waves of one generation group
    slots: int  # sequences one generation group decodes at once
    kv_bytes_per_token: int  # KV cache bytes of one token on one generation rank
    context: int  # prompt + response length
    log_prob_passes: int  # old-log-prob and reference passes
    micro_batches: int  # the update's micro-batches per GPU per step
    micro_tokens: int  # tokens of one of them
    generation_bytes: int = (
        0  # one generation rank's weights, streamed every decode step (0: 2 x params / tp)
    )
    exchanges: int = 0  # token exchanges between rollout groups per decode step (MoE layers when ep_g > tp_g)


@dataclass(frozen=True)
class Levers:
    """The layout's choices that cost time."""

    tp_train: int = 1
    tp_generate: int = 1
    param_offload: bool = False
    optimizer_offload: bool = False
    cpu_step: bool = False
    checkpointing: bool = False


def stage_seconds(w: Work, x: Levers) -> dict[str, float]:
    """Seconds of each stage of one step (generate, log_prob, update_actor, transfers): an estimate."""
    update = 6 * w.params * w.tokens / (w.world * PEAK_FLOPS * UPDATE_MFU)
    if x.checkpointing:
        update *= 1 + CHECKPOINT_RECOMPUTE
    update += w.micro_batches * w.layers * LAYER_OVERHEAD_S
    if w.world > x.tp_train:  # FSDP gathers the bf16 weights for forward and backward, and reduces the grads
        update += w.micro_batches * 3 * 2 * w.params / x.tp_train / NVLINK_BYTES_PER_S
    log_prob = w.log_prob_passes * 2 * w.params * w.tokens / (w.world * PEAK_FLOPS * LOG_PROB_MFU)
    if x.tp_train > 1:  # two all-reduces of the hidden states per layer forward, two more backward (ring)
        ring = 2 * (x.tp_train - 1) / x.tp_train
        per_pass = w.layers * 2 * ring * w.micro_tokens * w.hidden * 2 / NVLINK_BYTES_PER_S
        update += w.micro_batches * per_pass * (3 if x.checkpointing else 2)
        log_prob += w.log_prob_passes * per_pass * max(1, w.micro_batches // 2)
    # every decode step streams the group's weights and the sequences' KV cache (half the context on average)
    # (a mixture of experts' rank streams its own experts: whole ones over ep_g ranks, or its slice of all)
    weights = w.generation_bytes or 2 * w.params / x.tp_generate
    streamed = weights + w.slots * w.context // 2 * w.kv_bytes_per_token
    generate = w.waves * w.response * streamed / (HBM_BYTES_PER_S * DECODE_ROOFLINE)
    if x.tp_generate > 1:
        generate += w.waves * w.response * w.layers * 2 * ALLREDUCE_LATENCY_S
    # experts across rollout groups: each MoE layer sends the tokens to their experts' ranks and back, two
    # decode-sized (latency-bound) collectives, as an all-reduce
    generate += w.waves * w.response * w.exchanges * 2 * ALLREDUCE_LATENCY_S
    return {
        "generate": generate,
        "log_prob": log_prob,
        "update_actor": update,
        "transfers": transfer_seconds(w, x),
    }


def transfer_seconds(w: Work, x: Levers) -> float:
    """Host-device traffic of one step: offloaded state down and up, or the CPU step's gradients and weights."""
    seconds = 0.0
    if x.param_offload:  # float32 masters down after the update and up before the next phase
        seconds += 2 * 4 * w.held / PCIE_BYTES_PER_S
    if x.optimizer_offload:  # the AdamW moments down and up
        seconds += 2 * 8 * w.held / PCIE_BYTES_PER_S
    if x.cpu_step:  # bf16 grads down, bf16 weights up; the host's AdamW shared by the node's GPUs
        seconds += 4 * w.held / PCIE_BYTES_PER_S
        seconds += HOST_ADAM_BYTES * w.held * min(w.gpus_per_node, w.world) / HOST_ADAM_BYTES_PER_S
    return seconds


def step_seconds(w: Work, x: Levers) -> float:
    """One step's estimated seconds (the stages one after another, as the hybrid engine runs them)."""
    return sum(stage_seconds(w, x).values())


def _log_prob_passes(cfg: Config) -> int:
    """The step's forward-only passes: the reference's, and the old policy's unless the update is on-policy
    and takes its own log-probs (``config.off_policy``; the 7B run on the H200 had no such pass)."""
    return (old_log_prob_source(cfg) == "recompute") + bool(cfg.use_reference)


def _exchanges(mc: Any, layout: Layout) -> int:
    """Token exchanges between rollout groups in one decode step: one per sparse layer when the experts are
    split across groups (ep_generate > tp_generate), else none."""
    if (layout.ep_generate or 1) <= layout.tp_generate:
        return 0
    dense = set(getattr(mc, "mlp_only_layers", None) or ())  # Qwen-MoE's dense layers
    return sum(1 for i in range(mc.num_hidden_layers) if i not in dense)


def estimate_seconds(cfg: Config, mc: Any, layout: Layout) -> float:
    """The layout's estimated step time (after ``plan.memory.estimate_phases``, which sizes it)."""
    d, r, mc = cfg.data, cfg.rollout, text_config(mc)
    context = d.max_prompt_length + d.max_response_length
    samples = group_samples(cfg, layout)
    slots = max(1, min(layout.value(cfg, "rollout.max_num_seqs"), samples))
    micro_batches, micro_tokens = update_micro(cfg, layout)
    work = Work(
        params=layout.params, held=layout.views.held_elements - layout.frozen, layers=mc.num_hidden_layers,
        hidden=mc.hidden_size, world=layout.world, gpus_per_node=cfg.trainer.n_gpus_per_node,
        tokens=d.train_batch_size * r.n * context, response=d.max_response_length, waves=-(-samples // slots),
        slots=slots, kv_bytes_per_token=kv_bytes_per_token(cfg, mc, layout),
        context=context, log_prob_passes=_log_prob_passes(cfg),
        micro_batches=micro_batches, micro_tokens=micro_tokens,
        generation_bytes=layout.views.generation_bytes if is_moe(mc) else 0, exchanges=_exchanges(mc, layout),
    )  # fmt: skip
    levers = Levers(
        layout.tp_train, layout.tp_generate, layout.param_offload, layout.optimizer_offload,
        bool(layout.value(cfg, "actor.fsdp.optimizer_step_on_cpu")),
        bool(layout.value(cfg, "model.enable_gradient_checkpointing")),
    )  # fmt: skip
    return step_seconds(work, levers)
