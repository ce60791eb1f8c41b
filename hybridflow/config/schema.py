"""The configuration schema: one dataclass per section, every field with a one-line help string.

Sizes (batch sizes, lengths, devices) default to the built-in tiny CPU demo; algorithmic settings
(clipping, KL, loss aggregation, sampling, optimizer) default to verl's values, so a verl user finds the
numbers they know. Fields whose default is ``None`` are resolved from other fields; the help says how.
"""

# ruff: noqa: RUF009 - option() and section() return dataclasses.field(...), which ruff cannot see

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass
from typing import Any

from hybridflow.config.algo_schema import (  # noqa: F401 (re-exported: the schema's sections live here too)
    AlgorithmConfig,
    BypassLossConfig,
    FilterGroupsConfig,
    KLControlConfig,
    PolicyLossConfig,
    RolloutCorrectionConfig,
)
from hybridflow.config.parallel import ParallelConfig  # noqa: F401 (re-exported)
from hybridflow.config.preference import PreferenceConfig
from hybridflow.config.role_schema import (  # noqa: F401 (re-exported: the role sections live here too)
    ActorConfig,
    CriticConfig,
    CriticModelConfig,
    FSDPConfig,
    OptimConfig,
    RefConfig,
)
from hybridflow.config.schema_base import option, section


@dataclass
class ModelConfig:
    """The policy model (actor, reference and rollout share it)."""

    path: str | None = option(
        None, "Local Hugging Face model directory; null builds the built-in tiny model."
    )
    tokenizer_path: str | None = option(None, "Tokenizer directory; null uses model.path.")
    tiny_arch: str = option("qwen2", "Architecture of the demo's tiny model: qwen2, qwen3 or llama.")
    trust_remote_code: bool = option(False, "Allow custom modelling code shipped with the checkpoint.")
    override_config: dict[str, Any] = option({}, "Keys set on the HF model config after loading it.")
    attn_implementation: str = option("sdpa", "Attention implementation passed to transformers.")
    enable_gradient_checkpointing: bool = option(False, "Recompute activations in backward to save memory.")
    use_remove_padding: bool = option(
        False, "Pack sequences without pad tokens for log-prob and update passes."
    )
    custom_chat_template: str | None = option(None, "Jinja chat template that replaces the tokenizer's own.")
    lora_rank: int = option(
        0,
        "LoRA rank r of the actor's adapters; 0 trains every weight (the reference is then the base model).",
    )
    lora_alpha: float = option(16.0, "LoRA alpha: the adapters' update is scaled by lora_alpha / lora_rank.")
    target_modules: list[str] = option(
        ["all-linear"],
        "Decoder-layer linears with adapters: name suffixes (q_proj, mlp.down_proj) or all-linear (no LM head).",
    )
    lora_dropout: float = option(0.0, "Dropout on the adapters' input during updates (0: none, as in RL).")
    freeze_vision_tower: bool = option(
        True,
        "Vision-language models: keep the vision tower and merger frozen (no gradient, not in the optimizer).",
    )


@dataclass
class DataConfig:
    """Prompt datasets, lengths and the number of prompts per step."""

    train_files: list[str] | None = option(
        None, "Training parquet/jsonl files; null uses the built-in task (an empty list is an error)."
    )
    val_files: list[str] | None = option(
        None,
        "Validation files; null = none with train_files, else the built-in task (an empty list is an error).",
    )
    task: str = option(
        "arithmetic",
        "Built-in task used when train_files is null (multiply: with rollout.multi_turn and calc; squares: a VLM).",
    )
    task_train_size: int = option(2000, "Number of generated training problems of the built-in task.")
    task_val_size: int = option(200, "Number of generated held-out problems of the built-in task.")
    task_kwargs: dict[str, Any] = option(
        {}, "Keyword arguments of the built-in task generator (e.g. digits, ops)."
    )
    prompt_key: str = option(
        "prompt",
        "Prompt column (chat messages or text); without a chat prompt, a row's 'messages' gives it (docs/data.md).",
    )
    image_key: str = option(
        "images",
        "Column of a row's images (paths, bytes, {bytes, path} dicts or PIL images), for vision-language models.",
    )
    template_text_prompts: bool = option(
        True,
        "Chat-template text RL prompts as one user turn, as verl does; false keeps them as they are (TRL's format).",
    )
    response_key: str = option("response", "Dataset column holding the target response (SFT only).")
    reward_fn_key: str = option("data_source", "Dataset column that selects the reward function.")
    max_prompt_length: int = option(128, "Maximum prompt length in tokens.")
    max_response_length: int = option(64, "Maximum generated response length in tokens.")
    train_batch_size: int = option(16, "Prompts per training step (each sampled rollout.n times).")
    val_batch_size: int | None = option(None, "Prompts per validation batch; null validates in one batch.")
    gen_batch_size: int | None = option(
        None, "Prompts per generation round with dynamic sampling; null = train_batch_size."
    )
    shuffle: bool = option(True, "Shuffle the training prompts each epoch (seeded by trainer.seed).")
    filter_overlong_prompts: bool = option(False, "Drop prompts over max_prompt_length (count logged).")
    truncation: str = option("error", "What to do with an over-long prompt: error, left, right or middle.")


@dataclass
class SamplingConfig:
    """Sampling settings for validation generation."""

    n: int = option(1, "Samples per validation prompt.")
    temperature: float = option(0.0, "Sampling temperature (0 with do_sample=false is greedy).")
    top_p: float = option(1.0, "Nucleus sampling mass; 1.0 disables it.")
    top_k: int = option(-1, "Top-k cut-off; -1 (or 0) disables it.")
    do_sample: bool = option(False, "Sample (true) or decode greedily (false).")


@dataclass
class SandboxConfig:
    """Limits of each ``code_interpreter`` run, isolated by the operating system (bubblewrap)."""

    allow_unisolated: bool = option(
        False, "Where bubblewrap cannot isolate, run the code under the weaker in-process guard, not refuse."
    )
    memory_mb: int = option(1024, "Address space of the code's process (RLIMIT_AS), in MiB.")
    processes: int = option(32, "Processes and threads the code may run at once (RLIMIT_NPROC).")
    scratch_mb: int = option(64, "Size of the run's private tmpfs working directory, in MiB.")
    file_mb: int = option(64, "Largest file the code may write (RLIMIT_FSIZE), in MiB.")


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts with tools (verl's ``rollout.multi_turn``): an agent loop, token in, token out."""

    enable: bool = option(False, "Generate episodes of assistant turns and tool outputs (tools below).")
    format: str = option(
        "hermes", "Tool-call format: hermes (<tool_call>{json}</tool_call>) or plain ([[name: arg]])."
    )
    tools: list[str] = option(
        [], "Built-in tools: calc (arithmetic), code_interpreter (a sandboxed subprocess)."
    )
    tool_config_path: str | None = option(
        None, "A YAML file of your own tools: tools: [{name, description, parameters, function}]."
    )
    max_assistant_turns: int = option(5, "Most assistant turns per episode.")
    max_user_turns: int | None = option(
        None, "Most tool turns per episode (the episode ends at the next call); null: no cap but the above."
    )
    max_parallel_calls: int = option(
        1, "Most tool calls run per assistant turn, concurrently; the rest are answered with an error."
    )
    max_tool_response_length: int = option(256, "A tool's output is cut to this many characters.")
    tool_timeout_s: float = option(
        10.0, "Seconds a tool call may run before it is stopped (an error result); code_interpreter too."
    )
    sandbox: SandboxConfig = section(SandboxConfig, "The code_interpreter sandbox (docs/tools.md).")


@dataclass
class HarnessConfig:
    """Your own agent harness over an OpenAI-compatible endpoint on the rollout engine (docs/agents.md)."""

    module: str | None = option(
        None, "Python file or importable module with the harness; null: no harness (the built-in rollout)."
    )
    function: str = option(
        "episode", "The harness: async def episode(client, row) -> reward or (reward, metrics)."
    )
    max_concurrency: int = option(64, "Episodes running at once.")
    timeout_s: float = option(300.0, "Seconds an episode may take; past them it is that episode's failure.")
    on_error: str = option(
        "zero", "A failed episode (exception, timeout, no reward): zero (reward 0, its tokens kept) or drop."
    )
    tool_format: str = option(
        "hermes", "How tool calls are read out of answers when a request offers tools: hermes or plain."
    )
    host: str = option("127.0.0.1", "Address the endpoint listens on (loopback unless you open it).")
    port: int = option(0, "Port of the endpoint; 0 picks a free one.")
    verifiers_env: str | None = option(
        None,
        "A verifiers environment (installed id or .py file) instead of module; its rubric gives the reward.",
    )
    verifiers_config: dict[str, Any] = option(
        {}, "The verifiers environment's config (taskset.*, agent.*, ...: what verifiers' --env.* sets)."
    )

    @property
    def enabled(self) -> bool:
        """Whether episodes are played by a harness (``module``) or a verifiers environment."""
        return self.module is not None or self.verifiers_env is not None


@dataclass
class RolloutConfig:
    """The built-in rollout engine and its sampling settings."""

    engine: str = option(
        "native", "Generation engine: native (built-in, fast) or hf (transformers generate)."
    )
    n: int = option(8, "Responses sampled per prompt (the group size of GRPO/RLOO).")
    temperature: float = option(1.0, "Sampling temperature; log-probs are taken at logits / temperature.")
    top_p: float = option(1.0, "Nucleus sampling mass; 1.0 disables it.")
    top_k: int = option(-1, "Top-k cut-off; -1 (or 0) disables it.")
    min_p: float = option(0.0, "Min-p cut-off relative to the most likely token; 0 disables it.")
    do_sample: bool = option(True, "Sample (true) or decode greedily (false).")
    ignore_eos: bool = option(False, "Keep generating after EOS up to the response length (benchmarks).")
    stop_token_ids: list[int] = option([], "Extra token ids that end a response besides EOS.")
    dtype: str = option(
        "auto",
        "Generation dtype: auto (the training compute dtype, actor.fsdp.param_dtype), bfloat16, float16, "
        "float32.",
    )
    quantization: str | None = option(
        None, "Rollout weights: null (rollout.dtype) or fp8 (projections in e4m3, rowwise scales)."
    )
    quantization_force: bool = option(
        False, "fp8 even where the start-up probe finds FP8 GEMMs no faster than bf16 on this GPU."
    )
    quantization_kernel: str = option(
        "auto",
        "FP8 kernel: auto (probe picks), w8a16, scaled_mm, scaled_mm_static or triton_w8a8 (static scales).",
    )
    kv_cache_dtype: str = option(
        "auto",
        "KV cache: auto (rollout.dtype) or fp8 (e4m3, per-head scales set at each switch: twice the blocks).",
    )
    exact: bool = option(
        False,
        "Rollout log-probs bitwise equal to the trainer's (batch-invariant kernels; docs/algorithms.md).",
    )
    allow_dtype_mismatch: bool = option(
        False,
        "Run a rollout.dtype other than the training compute dtype (refused unless true: log-probs drift).",
    )
    gpu_memory_utilization: float = option(0.5, "GPU share this process may hold with its KV cache, (0, 1].")
    max_num_seqs: int = option(1024, "Most sequences decoded at once (the paged engine's seats).")
    max_num_batched_tokens: int = option(8192, "Token budget of one prefill chunk.")
    max_model_len: int | None = option(
        None, "KV-cache context length; null = max_prompt_length + max_response_length."
    )
    tensor_model_parallel_size: int = option(
        1, "Ranks per rollout group (Megatron-style shards); divides the world; 1 = a whole replica per rank."
    )
    expert_parallel_size: int = option(
        1,
        "MoE rollout: 1 = every expert sliced over a rollout group; = tensor_model_parallel_size: split whole.",
    )
    update_weights_bucket_megabytes: int = option(
        512, "Train -> generate switch: MiB of generation weights moved per all-to-all bucket."
    )
    free_cache_engine: bool = option(
        True, "After generating, free the KV cache and the rollout's weight copies for training."
    )
    lora_merge: str = option(
        "buffer",
        "LoRA at one rank: buffer (merged copies of the adapted weights) or in_place (host restore).",
    )
    enforce_eager: bool = option(False, "Disable CUDA graphs for decode (debugging).")
    compile_decode: bool = option(
        False,
        "torch.compile decode steps and prefill layers (GPU): ~2x decode, tens of seconds per bucket.",
    )
    log_prob_micro_batch_size_per_gpu: int = option(
        16, "Sequences per GPU per forward when recomputing old log-probs."
    )
    log_prob_use_dynamic_bsz: bool = option(False, "Size old-log-prob micro-batches by tokens instead.")
    log_prob_max_token_len_per_gpu: int = option(
        16384, "Token budget per GPU per forward with dynamic batch size."
    )
    val_kwargs: SamplingConfig = section(SamplingConfig, "Sampling settings used for validation.")
    multi_turn: MultiTurnConfig = section(MultiTurnConfig, "Multi-turn rollouts with tools.")
    harness: HarnessConfig = section(
        HarnessConfig, "Your own agent harness over an OpenAI-compatible endpoint."
    )


@dataclass
class CustomRewardFunctionConfig:
    """A user reward function loaded from a file or module."""

    path: str | None = option(
        None, "Python file or 'module:function' with the reward function; null = built-in scorers."
    )
    name: str = option("compute_score", "Function name in path (ignored when path is 'module:function').")
    reward_kwargs: dict[str, Any] = option({}, "Extra keyword arguments passed to the function.")


@dataclass
class RewardModelConfig:
    """A sequence-classification reward model."""

    enable: bool = option(False, "Score responses with a reward model.")
    path: str | None = option(None, "Reward model directory (sequence classification).")
    trust_remote_code: bool = option(False, "Allow custom modelling code of the reward model.")
    micro_batch_size_per_gpu: int = option(16, "Sequences per GPU per reward-model forward.")
    max_length: int | None = option(None, "Reward-model truncation; only null (whole sequences) for now.")
    param_offload: bool = option(False, "Keep the reward model on CPU between phases.")


@dataclass
class OverlongBufferConfig:
    """DAPO soft overlong punishment."""

    enable: bool = option(False, "Penalise responses that run into the last len tokens of the budget.")
    len: int = option(0, "Length of the penalty buffer before max_response_length.")
    penalty_factor: float = option(1.0, "Penalty at the very end of the buffer (linear ramp from 0).")
    log: bool = option(False, "Log the overlong penalty metrics.")


@dataclass
class RewardConfig:
    """How responses are scored."""

    manager: str = option("naive", "Reward manager: naive (one call per sample), batch, dapo or prime.")
    custom_function: CustomRewardFunctionConfig = section(CustomRewardFunctionConfig, "User reward function.")
    model: RewardModelConfig = section(RewardModelConfig, "Reward model.")
    overlong_buffer: OverlongBufferConfig = section(OverlongBufferConfig, "DAPO overlong penalty.")
    on_error: str = option("raise", "A failing reward function: raise (stop the run) or zero (logged).")
    num_workers: int = option(0, "Processes scoring in parallel; 0 scores in the trainer process.")
    timeout_s: float = option(
        60.0,
        "Seconds one reward call may take, in-process or in the pool (a batch function: the whole batch).",
    )
    launch_async: bool = option(False, "Score in a thread while the log-prob passes run on the GPU workers.")


@dataclass
class TrainerConfig:
    """The run: length, devices, checkpoints, validation and logging."""

    total_epochs: int = option(1, "Passes over the training prompts.")
    total_training_steps: int | None = option(None, "Stop after this many steps; null = total_epochs worth.")
    project_name: str = option("hybridflow", "Project name (loggers, run directory).")
    experiment_name: str = option("demo", "Experiment name (loggers, run directory).")
    logger: list[str] = option(
        ["console"], "Loggers: console, jsonl, tensorboard, wandb (jsonl is always on)."
    )
    default_local_dir: str | None = option(
        None, "Run directory; null = runs/{project_name}/{experiment_name}."
    )
    save_freq: int = option(
        -1,
        "Save a checkpoint every this many steps and at the end; -1 = only at the end; 0 = never.",
    )
    save_hf: bool = option(False, "Also export a Hugging Face model directory at every save.")
    max_ckpt_to_keep: int | None = option(None, "Keep only the newest checkpoints; null keeps all.")
    resume: str | None = option(
        None, "auto, disable, or a checkpoint (or run) directory; overrides resume_mode/resume_from_path."
    )
    resume_mode: str = option(
        "auto", "auto (latest checkpoint in the run directory), disable, or resume_path (verl's keys)."
    )
    resume_from_path: str | None = option(
        None, "Checkpoint directory to resume from with resume_mode=resume_path."
    )
    test_freq: int = option(-1, "Validate every this many steps; -1 = never during training.")
    val_before_train: bool = option(True, "Validate once before the first step.")
    val_only: bool = option(False, "Only validate, then exit.")
    log_val_generations: int = option(0, "Validation generations printed to the log each time.")
    rollout_data_dir: str | None = option(
        None, "Directory for per-step JSONL dumps of generations; null = off."
    )
    validation_data_dir: str | None = option(None, "Directory for validation generation dumps; null = off.")
    critic_warmup: int = option(0, "Steps that train only the critic before the actor starts.")
    balance_batch: bool = option(True, "Reorder samples so data-parallel ranks get similar token counts.")
    nnodes: int = option(1, "Number of nodes.")
    n_gpus_per_node: int = option(1, "Devices per node (processes per node on CPU).")
    device: str = option("auto", "Device type: auto (cuda when available, else cpu), cuda or cpu.")
    cpu_threads: int = option(
        0,
        "Torch threads per CPU rank; 0 = auto (free CPUs split between the host's ranks, or OMP_NUM_THREADS).",
    )
    backend: str = option("local", "Worker backend: local (in-process, one rank) or ray.")
    ray_address: str | None = option(None, "Ray cluster to join; null starts a local Ray instance.")
    placement: str = option("colocated", "Role placement: colocated (share devices) or split.")
    async_mode: str = option(
        "sync",
        "sync (each step waits), colocate (partial rollouts carried over) or separate (a rollout pool; ray).",
    )
    rollout_pool_size: int = option(
        0, "async_mode=separate: ranks (devices) of the rollout pool, beside the trainer's world_size."
    )
    max_staleness: int = option(1, "Async: weight versions a trained token may lag the policy, 1 to 8.")
    staleness_policy: str = option(
        "wait", "Async: a group about to exceed max_staleness: wait (finish it now) or drop it."
    )
    nccl_timeout: int = option(600, "Timeout of collectives in seconds.")
    auto_layout: bool = option(
        True,
        "Plan the layout keys you did not set (parallel sizes, offload), as hybridflow plan; false: off.",
    )
    gpu_memory_gb: float | None = option(
        None,
        "Use at most this many GB of each GPU and plan for it (a smaller GPU on a bigger one); null = all.",
    )
    seed: int = option(42, "Seed of data order, sampling and initialisation.")
    deterministic: bool = option(
        False,
        "Same seed, same GPU: identical metrics and weights (deterministic kernels; slower, docs/algorithms.md).",
    )

    @property
    def world_size(self) -> int:
        """The data-parallel world size: nnodes * n_gpus_per_node."""
        return self.nnodes * self.n_gpus_per_node

    def run_dir(self) -> str:
        """The run directory: default_local_dir, or runs/{project_name}/{experiment_name}."""
        if self.default_local_dir:
            return self.default_local_dir
        return f"runs/{self.project_name}/{self.experiment_name}"


@dataclass
class Config:
    """The whole configuration of a hybridflow run."""

    model: ModelConfig = section(ModelConfig, "Policy model.")
    data: DataConfig = section(DataConfig, "Datasets and batch sizes.")
    rollout: RolloutConfig = section(RolloutConfig, "Rollout engine and sampling.")
    actor: ActorConfig = section(ActorConfig, "Policy update.")
    critic: CriticConfig = section(CriticConfig, "Critic (value model).")
    ref: RefConfig = section(RefConfig, "Reference policy.")
    reward: RewardConfig = section(RewardConfig, "Reward functions and models.")
    algorithm: AlgorithmConfig = section(AlgorithmConfig, "Advantage estimator and KL penalty.")
    trainer: TrainerConfig = section(TrainerConfig, "Run length, devices, checkpoints, logging.")
    preference: PreferenceConfig = section(PreferenceConfig, "DPO / IPO / KTO losses and columns.")

    def to_dict(self) -> dict[str, Any]:
        """The config as nested plain dicts and lists (what save_config writes)."""
        return dataclasses.asdict(self)

    @property
    def use_critic(self) -> bool:
        """Whether a critic is trained: critic.enable, or GAE when it is null."""
        if self.critic.enable is not None:
            return self.critic.enable
        return self.algorithm.adv_estimator == "gae"

    @property
    def use_reference(self) -> bool:
        """Whether a reference policy is kept: ref.enable, or a KL loss / KL reward when it is null."""
        if self.ref.enable is not None:
            return self.ref.enable
        return self.actor.use_kl_loss or self.algorithm.use_kl_in_reward


@dataclass(frozen=True)
class FieldSpec:
    """One leaf field of the schema: its dotted path, type, default and help string."""

    path: str
    type: Any
    default: Any
    help: str


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _walk(obj: Any, prefix: str, leaves: dict[str, FieldSpec], sections: dict[str, str]) -> None:
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        path = f"{prefix}{f.name}"
        value = getattr(obj, f.name)  # the default instance, so nested overrides (critic lr) show
        if _is_section(hints[f.name]):
            sections[path] = f.metadata["help"]
            _walk(value, path + ".", leaves, sections)
        else:
            leaves[path] = FieldSpec(path, hints[f.name], value, f.metadata["help"])


@functools.cache
def schema_index() -> tuple[dict[str, FieldSpec], dict[str, str]]:
    """All leaf fields (dotted path -> FieldSpec) and all sections (dotted path -> help) of Config."""
    leaves: dict[str, FieldSpec] = {}
    sections: dict[str, str] = {}
    _walk(Config(), "", leaves, sections)
    return leaves, sections
