"""Building a rank's roles from the config: the policy, the reference and critic copies, and the workers."""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from hybridflow.config.parallel import role_sizes
from hybridflow.config.schema import Config
from hybridflow.engine import enable_exact_kernels
from hybridflow.models import build_value_model, load_causal_lm, load_tokenizer, load_value_model
from hybridflow.models.families import check_router_replay, disable_dropout
from hybridflow.models.moe import install_moe
from hybridflow.models.vision_tower import check_vision_training, load_vision_processor
from hybridflow.utils.errors import UserError
from hybridflow.utils.seed import set_seed
from hybridflow.workers.actor import ActorWorker
from hybridflow.workers.critic import CriticWorker
from hybridflow.workers.rank import RankWorker
from hybridflow.workers.reference import AdapterReference, ReferenceWorker
from hybridflow.workers.rollout_pool import RolloutWorker, rollout_skeleton

logger = logging.getLogger(__name__)

COLOCATED = ("actor", "ref", "critic")
SUPERVISED = ("actor",)  # SFT: the actor alone, trained on given responses


def eos_ids_of(model: torch.nn.Module, tokenizer: Any) -> list[int]:
    """Stop tokens: the generation config's eos (a list for chat models), else the tokenizer's."""
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    ids = eos if isinstance(eos, list) else [eos]
    ids = [i for i in ids if i is not None] or [tokenizer.eos_token_id]
    return [i for i in ids if i is not None]


def pad_id_of(tokenizer: Any) -> int:
    """The pad token, or EOS for tokenizers without one."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def load_policy_tokenizer(cfg: Config) -> Any:
    """The tokenizer of ``model.tokenizer_path`` (else ``model.path``), with the configured chat template."""
    m = cfg.model
    if not m.path:
        raise UserError("model.path is not set; point it to a local Hugging Face model directory")
    tokenizer = load_tokenizer(m.tokenizer_path or m.path, trust_remote_code=m.trust_remote_code)
    if m.custom_chat_template:
        tokenizer.chat_template = m.custom_chat_template
    return tokenizer


def load_policy_processor(cfg: Config, tokenizer: Any, config: Any) -> Any:
    """A vision-language policy's processor (``models.vision.VisionProcessor``) from ``model.path``, beside
    ``tokenizer``; None for a text model (or a model handed in without a path)."""
    return load_vision_processor(cfg.model.path, tokenizer, config)


def load_policy(cfg: Config) -> tuple[torch.nn.Module, Any]:
    """The policy model (float32 master weights) and its tokenizer from ``model.path``."""
    tokenizer = load_policy_tokenizer(cfg)
    m = cfg.model
    model = load_causal_lm(
        m.path,
        dtype="float32",
        attn_implementation=m.attn_implementation,
        trust_remote_code=m.trust_remote_code,
        override_config=dict(m.override_config),
    )
    return model, tokenizer


def build_roles(
    cfg: Config,
    model: torch.nn.Module,
    total_steps: int,
    pad_id: int,
    roles: tuple[str, ...] = COLOCATED,
    supervised: bool = False,
) -> dict[str, Any]:
    """The workers of ``roles`` that the config asks for, built from the initial policy ``model``.

    Dropout is turned off in every model first (``families.disable_dropout``): the update must score the
    distribution the rollout sampled from. ``supervised`` (SFT: nothing is sampled) keeps the model's dropout.
    """
    install_moe(model)  # a model handed in (notebook, benchmarks) gets the shared MoE blocks as a loaded one
    check_vision_training(cfg, model.config)  # a VLM: what its training does not implement is refused
    check_router_replay(model.config, cfg.actor.router_replay, cfg.rollout.engine, role_sizes(cfg, "actor"))
    turned_off = [] if supervised else disable_dropout(model)
    if turned_off:
        logger.info(
            "dropout off for RL (the update must see what the rollout sampled): %s", ", ".join(turned_off)
        )
    # The reference and critic start from the initial policy: copy it before the actor's engine shards it.
    # With LoRA the reference is the actor's base (its adapters off): no copy.
    adapted = cfg.model.lora_rank > 0
    ref_model = copy.deepcopy(model) if cfg.use_reference and "ref" in roles and not adapted else None
    critic_model = None
    if cfg.use_critic and "critic" in roles:
        path = cfg.critic.model.path
        critic_model = load_value_model(path) if path else build_value_model(model)
        disable_dropout(critic_model)
    # The reference takes its copy to the device first: on a 7B run with the CPU optimizer step, the copy's
    # 30 GB of host memory must be gone before the actor's masters and moments (107 GB) take the host.
    ref = ReferenceWorker(ref_model, cfg, pad_id) if ref_model is not None else None
    del ref_model
    out: dict[str, Any] = {}
    if "actor" in roles:
        out["actor"] = ActorWorker(model, cfg, total_steps, pad_id, generates=not supervised)
        if adapted and cfg.use_reference and "ref" in roles:
            ref = AdapterReference(out["actor"], cfg)
    if ref is not None:
        out["ref"] = ref
    if critic_model is not None:
        out["critic"] = CriticWorker(critic_model, cfg, total_steps, pad_id)
        if cfg.critic.fsdp.optimizer_offload == "auto" and "actor" in out:  # on the rollout's devices
            out["actor"].room_donors.append(out["critic"].engine.engine)
    return out


def build_rank_worker(
    cfg: Config, total_steps: int, roles: tuple[str, ...], group: str, supervised: bool = False
) -> RankWorker:
    """A rank of a worker group: loads the policy from ``model.path`` and builds its roles (Ray ranks).

    A rank is a process of its own, rebuilt from the config: it first imports the module
    ``reward.custom_function.path`` names, so that a policy loss registered there exists here too.
    ``supervised``: an SFT rank (``build_roles``; its actor never generates, so no multi-turn environment).
    """
    if cfg.reward.custom_function.path:
        from hybridflow.rewards.loader import import_reward_module

        import_reward_module(cfg.reward.custom_function.path)
    set_seed(cfg.trainer.seed, cfg.trainer.deterministic)
    if cfg.rollout.exact:  # a Ray rank is a process of its own: the kernels are routed in per process
        enable_exact_kernels()
    if roles == ("rollout",):  # a separate rollout pool: no training weights, a skeleton to stream into
        return build_rollout_rank(cfg, group)
    model, tokenizer = load_policy(cfg)
    built = build_roles(cfg, model, total_steps, pad_id_of(tokenizer), roles, supervised)
    worker = RankWorker(built, tokenizer, group, generates=not supervised)
    worker.eos_token_ids = eos_ids_of(model, tokenizer)
    worker.processor = load_policy_processor(cfg, tokenizer, model.config)
    return worker


def build_rollout_rank(cfg: Config, group: str) -> RankWorker:
    """A rank of a separate rollout pool (``trainer.async_mode=separate``): the policy's skeleton on the meta
    device and its tokenizer; the weights come from the trainer pool's stream."""
    from hybridflow.models.loader import load_config

    m = cfg.model
    tokenizer = load_policy_tokenizer(cfg)
    config = load_config(m.path, m.trust_remote_code, dict(m.override_config))
    worker = RolloutWorker(rollout_skeleton(config), cfg, pad_id_of(tokenizer))
    return RankWorker({"rollout": worker}, tokenizer, group)
