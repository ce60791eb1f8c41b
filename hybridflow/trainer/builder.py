"""Everything a run needs, built from the config: tokenizer, workers, datasets and the scorer."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

import torch

from hybridflow.config.schema import Config
from hybridflow.data import RLDataset, build_rl_dataset
from hybridflow.data.rows import BUILT_IN
from hybridflow.models import build_value_model, load_causal_lm, load_tokenizer, load_value_model
from hybridflow.trainer.scoring import Scorer, build_reward_manager, has_scorer, known_sources
from hybridflow.workers.actor import ActorWorker
from hybridflow.workers.critic import CriticWorker
from hybridflow.workers.reference import ReferenceWorker
from hybridflow.workers.reward_model import RewardModelWorker

logger = logging.getLogger(__name__)


@dataclass
class Components:
    """The pieces the driver works with."""

    tokenizer: Any
    pad_token_id: int
    eos_token_ids: list[int]
    actor: ActorWorker
    ref: ReferenceWorker | None
    critic: CriticWorker | None
    train: RLDataset | None  # None for evaluation only
    val: RLDataset | None
    scorer: Scorer
    total_steps: int


def eos_ids_of(model: torch.nn.Module, tokenizer: Any) -> list[int]:
    """Stop tokens: the generation config's eos (a list for chat models), else the tokenizer's."""
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    ids = eos if isinstance(eos, list) else [eos]
    ids = [i for i in ids if i is not None] or [tokenizer.eos_token_id]
    return [i for i in ids if i is not None]


def load_policy(cfg: Config) -> tuple[torch.nn.Module, Any]:
    """The policy model (float32 master weights) and its tokenizer from ``model.path``."""
    m = cfg.model
    if not m.path:
        raise ValueError("model.path is not set; point it to a local Hugging Face model directory")
    tokenizer = load_tokenizer(m.tokenizer_path or m.path, trust_remote_code=m.trust_remote_code)
    if m.custom_chat_template:
        tokenizer.chat_template = m.custom_chat_template
    model = load_causal_lm(
        m.path,
        dtype="float32",
        attn_implementation=m.attn_implementation,
        trust_remote_code=m.trust_remote_code,
        override_config=dict(m.override_config),
    )
    return model, tokenizer


def total_training_steps(cfg: Config, num_prompts: int) -> int:
    """``trainer.total_training_steps``, else ``total_epochs`` passes over the prompts."""
    if cfg.trainer.total_training_steps:
        return cfg.trainer.total_training_steps
    per_epoch = num_prompts // cfg.data.train_batch_size
    if per_epoch < 1:
        raise ValueError(
            f"the training set has {num_prompts} prompts, fewer than data.train_batch_size="
            f"{cfg.data.train_batch_size}; lower the batch size or add data"
        )
    return per_epoch * cfg.trainer.total_epochs


def check_data_sources(dataset: RLDataset, cfg: Config, reward_fn: Any) -> None:
    """Refuse rows whose data_source no scorer handles (naming the file and row)."""
    if not has_scorer(cfg, reward_fn):
        dataset.require_data_sources(set(known_sources()), hint="set reward.custom_function.path to score it")


def build_components(
    cfg: Config,
    model: torch.nn.Module | None = None,
    tokenizer: Any = None,
    reward_fn: Any = None,
    train: RLDataset | None = None,
    val: RLDataset | None = None,
) -> Components:
    """Workers, datasets and scorer for ``cfg`` (a model/tokenizer/datasets given here take precedence)."""
    if model is None:
        model, tokenizer = load_policy(cfg)
    built_in = train is None and cfg.data.train_files is None  # the built-in task supplies both splits
    train = train or build_rl_dataset(cfg.data, tokenizer, "train", cfg.trainer.seed)
    if val is None and (cfg.data.val_files or built_in):
        val = build_rl_dataset(cfg.data, tokenizer, "val", cfg.trainer.seed)
    for ds in (train, val):
        if ds is not None:
            check_data_sources(ds, cfg, reward_fn)
    steps = total_training_steps(cfg, len(train))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = eos_ids_of(model, tokenizer)
    # The reference and critic start from the initial policy: copy it before the actor's engine shards it.
    ref_model = copy.deepcopy(model) if cfg.use_reference else None
    critic_model = None
    if cfg.use_critic:
        path = cfg.critic.model.path
        critic_model = load_value_model(path) if path else build_value_model(model)
    actor = ActorWorker(model, cfg, steps, pad_id)
    ref = ReferenceWorker(ref_model, cfg) if ref_model is not None else None
    critic = CriticWorker(critic_model, cfg, steps) if critic_model is not None else None
    rm = RewardModelWorker(cfg, model.config.vocab_size) if cfg.reward.model.enable else None
    scorer = Scorer(build_reward_manager(cfg, reward_fn), tokenizer, cfg, rm)
    logger.info(
        "run: %d prompts (%s), %d steps, actor%s%s",
        len(train),
        "built-in task" if cfg.data.train_files is None else BUILT_IN and "files",
        steps,
        " + reference" if ref else "",
        " + critic" if critic else "",
    )
    return Components(tokenizer, pad_id, eos, actor, ref, critic, train, val, scorer, steps)


def build_eval_components(
    cfg: Config, model: torch.nn.Module, tokenizer: Any, reward_fn: Any = None
) -> Components:
    """What validation needs: the policy (as an actor, for its rollout engine), the held-out set and scorer."""
    if cfg.data.val_files is None and cfg.data.train_files is not None:
        raise ValueError(
            "data.val_files is not set: evaluation needs held-out prompts; set data.val_files=[FILE]"
        )
    val = build_rl_dataset(cfg.data, tokenizer, "val", cfg.trainer.seed)
    check_data_sources(val, cfg, reward_fn)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    actor = ActorWorker(model, cfg, 1, pad_id)
    scorer = Scorer(build_reward_manager(cfg, reward_fn), tokenizer, cfg, None)
    return Components(
        tokenizer, pad_id, eos_ids_of(model, tokenizer), actor, None, None, None, val, scorer, 0
    )
