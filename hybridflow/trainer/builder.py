"""Everything a run needs, built from the config: tokenizer, workers, datasets and the scorer."""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from hybridflow.config.schema import Config
from hybridflow.data import KTODataset, PreferenceDataset, RLDataset, build_rl_dataset, load_rows
from hybridflow.data.rl_dataset import has_images
from hybridflow.engine import world_line
from hybridflow.models.vision import is_vision_language, text_config
from hybridflow.models.vision_tower import check_vision_training
from hybridflow.trainer.scoring import Scorer, build_reward_manager, has_scorer, known_sources
from hybridflow.trainer.sft import SFTData
from hybridflow.utils.dist import init_distributed
from hybridflow.utils.errors import UserError
from hybridflow.utils.progress import counted
from hybridflow.workers.actor import ActorWorker, make_sampling_params
from hybridflow.workers.build import (
    COLOCATED,
    SUPERVISED,
    build_roles,
    eos_ids_of,
    load_policy,
    load_policy_processor,
    load_policy_tokenizer,
    pad_id_of,
)
from hybridflow.workers.group import ActorHandle, CriticHandle, LocalGroup, RefHandle, WorkerGroup
from hybridflow.workers.rank import RankWorker
from hybridflow.workers.reward_model import RewardModelWorker

__all__ = [
    "Components",
    "build_components",
    "build_eval_components",
    "build_sft_components",
    "eos_ids_of",
    "load_policy",
]

logger = logging.getLogger(__name__)


@dataclass
class Components:
    """The pieces the driver works with: role handles (any backend), datasets, the scorer."""

    tokenizer: Any
    pad_token_id: int
    eos_token_ids: list[int]
    actor: ActorHandle
    ref: RefHandle | None
    critic: CriticHandle | None
    train: RLDataset | None  # None for evaluation only, and for SFT (its driver holds its rows)
    val: RLDataset | None
    scorer: Scorer | None  # None for SFT: nothing is scored
    total_steps: int
    groups: list[WorkerGroup] = field(default_factory=list)  # the main group (with the actor) first
    pool: WorkerGroup | None = None  # trainer.async_mode=separate: the rollout pool (no checkpoint state)
    # A vision-language policy's processor (``models.vision.VisionProcessor``: images to patches, image tokens
    # expanded), what its datasets take beside the tokenizer; None for a text model.
    processor: Any = None

    def close(self) -> None:
        """Stop the scorer's pool and the worker groups' processes."""
        if self.scorer is not None:
            self.scorer.close()
        for group in [*self.groups, *([self.pool] if self.pool is not None else [])]:
            group.shutdown()


def total_training_steps(cfg: Config, num_prompts: int) -> int:
    """``trainer.total_training_steps``, else ``total_epochs`` passes over the prompts."""
    if cfg.trainer.total_training_steps:
        return cfg.trainer.total_training_steps
    per_epoch = num_prompts // cfg.data.train_batch_size
    if per_epoch < 1:
        raise UserError(
            f"the training set has {num_prompts} prompts, fewer than data.train_batch_size="
            f"{cfg.data.train_batch_size}; lower the batch size or add data"
        )
    return per_epoch * cfg.trainer.total_epochs


def check_data_sources(dataset: RLDataset, cfg: Config, reward_fn: Any) -> None:
    """Refuse rows whose data_source no scorer handles (naming the file and row)."""
    if not has_scorer(cfg, reward_fn):
        dataset.require_data_sources(set(known_sources()), hint="set reward.custom_function.path to score it")


def check_tool_isolation(cfg: Config) -> None:
    """``code_interpreter`` needs isolation by the operating system: refused here, before any model loads, on a
    host without it (unless ``rollout.multi_turn.sandbox.allow_unisolated``)."""
    mt = cfg.rollout.multi_turn
    if mt.enable and "code_interpreter" in mt.tools and not mt.sandbox.allow_unisolated:
        from hybridflow.tools.sandbox import require_isolation

        require_isolation()


def check_rollout_view(cfg: Config, model: torch.nn.Module | None) -> None:
    """Refuse, before any rank starts, a tensor-parallel size (rollout or training) that cannot split the
    policy's heads and MLP, a sequence-parallel size that cannot split its heads, more pipeline stages than it
    has layers, or an expert-parallel size without experts to split: each role's view (``ParallelDims.check_model``). A critic with a model of its own
    (``critic.model.path``) is checked by its worker, against that model."""
    from hybridflow.engine import ParallelDims

    tp = cfg.rollout.tensor_model_parallel_size
    policy_shaped = ["actor", *(["ref"] if cfg.use_reference else [])]
    if cfg.use_critic and cfg.critic.model.path is None:
        policy_shaped.append("critic")  # a value head on the policy's body
    views = [ParallelDims.of(cfg, role, cfg.trainer.world_size) for role in policy_shaped]
    if tp == 1 and all(v.world == v.dp and v.ep == 1 for v in views):
        return
    from hybridflow.engine import check_tp
    from hybridflow.models.loader import load_config as load_model_config

    m = cfg.model
    config = model.config if model is not None else load_model_config(m.path, m.trust_remote_code)
    if tp > 1:
        check_tp(config, tp)
    for view in views:
        view.check_model(config)


def check_position_limit(cfg: Config, model: torch.nn.Module | None, generated: bool = True) -> None:
    """Refuse lengths the model's positions cannot hold; warn where the longest sequences are cut or run past.

    ``generated``: the responses are sampled (RL, evaluation) and the rollout stops each where prompt plus
    response reach the model's limit; else they come whole from the data (DPO, KTO). Nothing is checked for a
    model that states no limit.
    """
    from hybridflow.models.loader import load_config as load_model_config

    d, m = cfg.data, cfg.model
    config = model.config if model is not None else load_model_config(m.path, m.trust_remote_code)
    config = text_config(config)  # a VLM's: its language model's
    limit = getattr(config, "max_position_embeddings", None)
    if not isinstance(limit, int) or limit <= 0:
        return
    prompt, response = d.max_prompt_length, d.max_response_length
    positions = f"the model's position limit (max_position_embeddings={limit})"
    if prompt >= limit:
        raise UserError(
            f"data.max_prompt_length={prompt} is not below {positions}: a prompt that long leaves no room for a "
            f"response; set data.max_prompt_length below {limit} (and data.max_response_length to fit the rest)"
        )
    if generated and response >= limit:
        raise UserError(
            f"data.max_response_length={response} cannot fit in {positions}: the rollout stops every response "
            f"where prompt plus response reach {limit} tokens, so none can be that long; set "
            f"data.max_response_length={limit - prompt} (the {limit} positions minus data.max_prompt_length={prompt}) "
            f"or less, so that every response fits"
        )
    need = prompt + response
    if need <= limit:
        return
    total = f"data.max_prompt_length={prompt} + data.max_response_length={response} = {need} tokens"
    fit = f"data.max_response_length={limit - prompt}" + (
        f" (or data.max_prompt_length={limit - response})" if response < limit else ""
    )
    if not generated and learned_positions(config):
        raise UserError(
            f"{total} cannot fit in {positions}: {config.model_type}'s positions are a learned table of {limit}, "
            f"so the longest pairs would have no position for their last tokens; set {fit} or less"
        )
    if generated:
        what = (
            f"the rollout stops a response where prompt plus response reach {limit} tokens, so prompts longer than "
            f"{limit - response} tokens get shorter responses"
        )
    else:
        what = "the longest sequences run past the positions the model was trained on"
    logger.warning("%s is more than %s: %s; for whole sequences, set %s or less", total, positions, what, fit)


def learned_positions(config: Any) -> bool:
    """Whether the model's positions are a learned table (GPT-2's, OPT's) rather than rotary: none exists past
    ``max_position_embeddings``, where a rotary model computes them (past what it was trained on)."""
    rotary = (
        "rope_parameters",
        "rope_theta",
        "rope_scaling",
        "rotary_dim",
        "rotary_pct",
        "partial_rotary_factor",
    )
    return not any(getattr(config, key, None) is not None for key in rotary)


def _local_groups(
    cfg: Config,
    model: torch.nn.Module,
    tokenizer: Any,
    steps: int,
    processor: Any = None,
    supervised: bool = False,
) -> list[WorkerGroup]:
    """This process as the rank (or, under torchrun, one of the ranks) holding every role (``processor``: a
    vision-language policy's, saved with it; ``supervised``: the actor alone, for SFT)."""
    t = cfg.trainer
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if t.world_size != launched:
        raise UserError(
            f"trainer.nnodes x trainer.n_gpus_per_node = {t.world_size}, but this process is one of {launched}; "
            f"launch with torchrun --nproc_per_node={t.n_gpus_per_node}, or set trainer.backend=ray"
        )
    if t.placement != "colocated":
        raise UserError("trainer.placement=split needs trainer.backend=ray (local roles share this process)")
    init_distributed(timeout_s=t.nccl_timeout)  # before the engines join it with the default timeout
    roles = build_roles(
        cfg, model, steps, pad_id_of(tokenizer), SUPERVISED if supervised else COLOCATED, supervised
    )
    worker = RankWorker(roles, tokenizer, generates=not supervised)
    worker.eos_token_ids = eos_ids_of(model, tokenizer)
    worker.processor = processor
    return [LocalGroup(worker)]


def _ray_groups(cfg: Config, steps: int, supervised: bool = False) -> list[WorkerGroup]:
    """Ray actors: one group with every role (colocated), or the critic in a group of its own (split);
    ``supervised``: one group of the actor alone (SFT)."""
    from hybridflow.workers.ray_group import RayGroup, ensure_ray

    t = cfg.trainer
    split = t.placement == "split" and cfg.use_critic and not supervised
    pool = t.rollout_pool_size if t.async_mode == "separate" and not supervised else 0
    ray = ensure_ray(t.ray_address, min_cpus=t.world_size * (2 if split else 1) + pool)
    use_gpu = t.device == "cuda" or (t.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
    if supervised:
        return [RayGroup(cfg, steps, SUPERVISED, "main", t.world_size, use_gpu, supervised=True)]
    main_roles = ("actor", "ref") if split else COLOCATED
    groups: list[WorkerGroup] = [RayGroup(cfg, steps, main_roles, "main", t.world_size, use_gpu)]
    if split:
        groups.append(RayGroup(cfg, steps, ("critic",), "critic", t.world_size, use_gpu))
    return groups


def _policy(cfg: Config, model: torch.nn.Module | None, tokenizer: Any) -> tuple[torch.nn.Module | None, Any]:
    """The driver's model and tokenizer: with Ray only the tokenizer (each rank loads the model itself)."""
    if cfg.trainer.backend != "ray":
        return (model, tokenizer) if model is not None else load_policy(cfg)
    if model is not None:
        raise UserError("trainer.backend=ray loads the model on every rank from model.path; pass no model")
    return None, tokenizer or load_policy_tokenizer(cfg)


def _groups(
    cfg: Config,
    model: torch.nn.Module | None,
    tokenizer: Any,
    steps: int,
    processor: Any = None,
    supervised: bool = False,
) -> list[WorkerGroup]:
    if cfg.trainer.backend == "ray":  # each rank loads its processor itself (``build_rank_worker``)
        return _ray_groups(cfg, steps, supervised)
    return _local_groups(cfg, model, tokenizer, steps, processor, supervised)


def _rollout_pool(cfg: Config, groups: list[WorkerGroup], steps: int) -> WorkerGroup | None:
    """``trainer.async_mode=separate``: a Ray group of ``trainer.rollout_pool_size`` ranks that only generate,
    on devices of their own (the same kind as the main group's)."""
    t = cfg.trainer
    if t.async_mode != "separate":
        return None
    from hybridflow.workers.ray_group import RayGroup

    use_gpu = getattr(groups[0], "use_gpu", t.device == "cuda")
    return RayGroup(cfg, steps, ("rollout",), "rollout", t.rollout_pool_size, use_gpu)


def _handles(
    cfg: Config, groups: list[WorkerGroup], pad_id: int
) -> tuple[ActorHandle, RefHandle | None, CriticHandle | None]:
    critic_group = next((g for g in groups if g.name == "critic"), groups[0])
    actor = ActorHandle(groups[0], functools.partial(make_sampling_params, cfg), pad_id)
    ref = RefHandle(groups[0], "ref", pad_id) if cfg.use_reference else None
    critic = CriticHandle(critic_group, "critic", pad_id) if cfg.use_critic else None
    return actor, ref, critic


def _datasets(
    cfg: Config,
    tokenizer: Any,
    reward_fn: Any,
    train: RLDataset | None,
    val: RLDataset | None,
    processor: Any = None,
) -> tuple[RLDataset, RLDataset | None]:
    """The given datasets, else the configured files', else the built-in task's; data sources checked.
    ``processor``: a VLM's (images processed once, as the rows are built), else None."""
    built_in = train is None and cfg.data.train_files is None  # the built-in task supplies both splits
    seed = cfg.trainer.seed
    train = train or build_rl_dataset(cfg.data, tokenizer, "train", seed, processor=processor)
    if val is None and (cfg.data.val_files or built_in):
        val = build_rl_dataset(cfg.data, tokenizer, "val", seed, processor=processor)
    for ds in (train, val):
        if ds is not None:
            check_data_sources(ds, cfg, reward_fn)
    return train, val


def _model_config(cfg: Config, model: torch.nn.Module | None) -> Any:
    """The policy's config: the given model's, else ``model.path``'s (the Ray driver loads no model)."""
    if model is not None:
        return model.config
    from hybridflow.models.loader import load_config as load_model_config

    return load_model_config(cfg.model.path, cfg.model.trust_remote_code)


def build_components(
    cfg: Config,
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
    reward_fn: Any = None,
    train: RLDataset | None = None,
    val: RLDataset | None = None,
    *,
    step_wise: bool = False,
) -> Components:
    """Workers, datasets and scorer for ``cfg`` (a model/tokenizer/datasets given here take precedence).

    With ``trainer.backend=ray`` each rank loads the policy from ``model.path``; the driver loads only the
    tokenizer. ``step_wise``: no datasets (the step-wise API's caller brings the prompts of each step), and
    ``trainer.total_training_steps`` (else 1, for a schedule that does not depend on it) for the schedulers.
    """
    logger.info("%s", world_line(cfg))  # first after the layout plan's line: the world, every role's layout
    check_tool_isolation(cfg)
    model, tokenizer = _policy(cfg, model, tokenizer)
    check_rollout_view(cfg, model)
    check_position_limit(cfg, model)
    processor = load_policy_processor(cfg, tokenizer, _model_config(cfg, model))
    if step_wise:
        train = val = None
        steps = cfg.trainer.total_training_steps or 1
        data = "prompts from the caller's loop (step-wise Trainer), " + (
            counted(steps, "step") if cfg.trainer.total_training_steps else "no step limit"
        )
    else:
        train, val = _datasets(cfg, tokenizer, reward_fn, train, val, processor)
        steps = total_training_steps(cfg, len(train))
        data = f"{len(train)} prompts from {train.source}, {counted(steps, 'step')}"
    groups = _groups(cfg, model, tokenizer, steps, processor)
    pool = _rollout_pool(cfg, groups, steps)
    eos = groups[0].run_all("stop_tokens")[0]
    actor, ref, critic = _handles(cfg, groups, pad_id_of(tokenizer))
    vocab = len(tokenizer) if model is None else text_config(model.config).vocab_size
    rm = RewardModelWorker(cfg, vocab) if cfg.reward.model.enable else None
    scorer = Scorer(build_reward_manager(cfg, reward_fn), tokenizer, cfg, rm)
    logger.info(
        "run: %s, %s backend, %d rank(s): %s",
        data,
        cfg.trainer.backend,
        cfg.trainer.world_size,
        " + ".join(name for name, h in (("actor", actor), ("reference", ref), ("critic", critic)) if h),
    )
    return Components(
        tokenizer,
        pad_id_of(tokenizer),
        eos,
        actor,
        ref,
        critic,
        train,
        val,
        scorer,
        steps,
        groups,
        pool,
        processor,
    )


def build_eval_components(
    cfg: Config, model: torch.nn.Module, tokenizer: Any, reward_fn: Any = None
) -> Components:
    """What validation needs: the policy (as an actor, for its rollout engine), the held-out set and scorer."""
    if cfg.data.val_files is None and cfg.data.train_files is not None:
        raise UserError(
            "data.val_files is not set: evaluation needs held-out prompts; set data.val_files=[FILE]"
        )
    check_position_limit(cfg, model)
    processor = load_policy_processor(cfg, tokenizer, model.config)
    val = build_rl_dataset(cfg.data, tokenizer, "val", cfg.trainer.seed, processor=processor)
    check_data_sources(val, cfg, reward_fn)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    actor = ActorWorker(model, cfg, 1, pad_id, trainable=False)  # no optimizer state to hold for evaluation
    scorer = Scorer(build_reward_manager(cfg, reward_fn), tokenizer, cfg, None)
    return Components(
        tokenizer,
        pad_id,
        eos_ids_of(model, tokenizer),
        actor,
        None,
        None,
        None,
        val,
        scorer,
        0,
        processor=processor,
    )


def build_preference_components(
    cfg: Config,
    kind: str,
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
    rows: list[dict[str, Any]] | None = None,
) -> Components:
    """Actor + reference, the preference dataset (DPO pairs or KTO examples) and, if any, a validation set.

    ``rows`` replaces ``data.train_files`` (the built-in DPO demo builds its pairs itself).
    """
    logger.info("%s", world_line(cfg))  # first after the layout plan's line: the world, every role's layout
    model, tokenizer = _policy(cfg, model, tokenizer)
    check_vision_training(cfg, _model_config(cfg, model), kind)  # no images in preference rows yet
    check_position_limit(cfg, model, generated=False)  # the pairs come whole from the data
    d = cfg.data
    train = _preference_dataset(cfg, kind, tokenizer, rows)
    if d.train_batch_size % cfg.trainer.world_size:
        raise UserError(
            f"data.train_batch_size={d.train_batch_size} pairs do not split over {cfg.trainer.world_size} ranks; "
            "use a multiple of trainer.nnodes x trainer.n_gpus_per_node"
        )
    val = (
        build_rl_dataset(d, tokenizer, "val", cfg.trainer.seed) if d.val_files or not d.train_files else None
    )
    steps = total_training_steps(cfg, len(train))
    groups = _groups(cfg, model, tokenizer, steps)
    actor, ref, _ = _handles(cfg, groups, pad_id_of(tokenizer))
    scorer = Scorer(build_reward_manager(cfg, None), tokenizer, cfg, None)
    eos = groups[0].run_all("stop_tokens")[0]
    logger.info(
        "%s: %d training rows, %s, %d rank(s)",
        kind,
        len(train),
        counted(steps, "step"),
        cfg.trainer.world_size,
    )
    return Components(
        tokenizer, pad_id_of(tokenizer), eos, actor, ref, None, train, val, scorer, steps, groups
    )


def build_sft_components(
    cfg: Config,
    rows: list[dict[str, Any]],
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
    processor: Any = None,
    image_key: str = "images",
) -> tuple[Components, SFTData]:
    """The actor alone on its worker group, for SFT (no reference, critic or scorer), and the encoded ``rows``.

    The group is this process (one rank, or each of torchrun's ranks) or Ray actors (``trainer.backend``),
    the actor in its training view (``actor.parallel``, LoRA). ``processor``: a vision-language policy's (None:
    loaded from ``model.path`` when a row has images in ``image_key``), saved with the model.
    """
    from hybridflow.engine import ParallelDims

    t = cfg.trainer
    view = ParallelDims.of(cfg, "actor", t.world_size)
    if cfg.data.train_batch_size % view.dp:  # a padded share would train on its repeated rows
        raise UserError(
            f"data.train_batch_size={cfg.data.train_batch_size} rows do not split over the actor's {view.dp} "
            f"data-parallel replicas (train_view={view} on {t.world_size} ranks); use a multiple of {view.dp}"
        )
    model, tokenizer = _policy(cfg, model, tokenizer)
    config = _model_config(cfg, model)
    check_vision_training(cfg, config, "sft")
    vlm = is_vision_language(config)
    if processor is None and vlm and any(has_images(r, image_key=image_key) for r in rows):
        processor = load_policy_processor(cfg, tokenizer, config)  # text rows need none
    steps = sft_steps(cfg, len(rows))
    encode = functools.partial(
        SFTData.encode, tokenizer, rows, processor=processor, vlm=vlm, image_key=image_key
    )
    # A given model is checked against its rows before its engine takes it over (a refused row leaves it whole).
    data = encode(eos_ids_of(model, tokenizer)) if model is not None else None
    groups = _groups(cfg, model, tokenizer, steps, processor, supervised=True)
    eos = groups[0].run_all("stop_tokens")[0]
    if data is None:  # Ray: only the ranks hold the model
        try:
            data = encode(eos)
        except BaseException:
            for group in groups:
                group.shutdown()
            raise
    logger.info(
        "sft: %d rows, %s, %s backend, %d rank(s): actor train_view=%s",
        len(rows),
        counted(steps, "step"),
        t.backend,
        t.world_size,
        view,
    )
    pad = pad_id_of(tokenizer)
    actor = ActorHandle(groups[0], functools.partial(make_sampling_params, cfg), pad)
    # no reference, critic or scorer; the rows stay with the driver (``SFTTrainer``)
    components = Components(tokenizer, pad, eos, actor, None, None, None, None, None, steps, groups)
    components.processor = processor
    return components, data


def sft_steps(cfg: Config, rows: int) -> int:
    """``trainer.total_training_steps``, else ``total_epochs`` passes over the rows (at least one step)."""
    t = cfg.trainer
    return t.total_training_steps or max(1, rows // cfg.data.train_batch_size) * t.total_epochs


def _preference_dataset(
    cfg: Config, kind: str, tokenizer: Any, rows: list[dict[str, Any]] | None
) -> PreferenceDataset | KTODataset:
    """DPO pairs or KTO examples from ``rows`` (None: ``data.train_files``)."""
    p, d = cfg.preference, cfg.data
    if rows is None:
        if not d.train_files:
            raise UserError(
                f"data.train_files is not set: {kind} trains on preference rows; point it to a file"
            )
        rows = load_rows(d.train_files)
    source = ", ".join(map(str, d.train_files or ["built-in pairs"]))
    common = dict(truncation=p.truncation, prompt_key=d.prompt_key, source=source)
    if kind == "dpo":
        keys = dict(chosen_key=p.chosen_key, rejected_key=p.rejected_key)
        return PreferenceDataset(
            rows, tokenizer, d.max_prompt_length, d.max_response_length, **keys, **common
        )
    keys = dict(completion_key=p.completion_key, label_key=p.label_key)
    return KTODataset(rows, tokenizer, d.max_prompt_length, d.max_response_length, **keys, **common)
