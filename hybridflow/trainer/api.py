"""The notebook API: ``RLTrainer(model_name=DIR, reward_fn=fn, max_steps=...).train(dataset)``.

The HybridFlow write-ups' call runs as written::

    trainer = RLTrainer(model_name="/models/Llama-3-8B", reward_fn=lambda x: 1.0 if "Transformer" in x else 0.5,
                        max_steps=100, per_device_train_batch_size=2, gradient_accumulation_steps=4,
                        learning_rate=1e-6, use_3d_hybrid=True)
    trainer.train(small_dataset)

Keywords map onto config keys (``trainer.keywords``), the reward function's shape is recognised at
construction (``rewards.shapes``), datasets come in any of ``data.user_rows``' forms, and with
``use_3d_hybrid=True`` (the hybrid engine) the layout is planned from the model and the GPUs unless the config
sets it (``trainer.layout``). ``use_3d_hybrid=False`` runs the baseline (``actor.hybrid_engine=false``).
"""

from __future__ import annotations

import logging
from typing import Any

from hybridflow.config import Config, load_config
from hybridflow.config.loader import _read_yaml
from hybridflow.data import RLDataset
from hybridflow.data.user_rows import as_rows
from hybridflow.rewards.shapes import RewardShape, recognise_reward
from hybridflow.trainer.builder import build_components, load_policy
from hybridflow.trainer.jobs import rl_job
from hybridflow.trainer.keywords import given_overrides, keyword_overrides
from hybridflow.trainer.layout import Layout, apply_layout, gpu_memory_bytes, plan_layout
from hybridflow.utils.logging import setup_console_logging

logger = logging.getLogger(__name__)


def build_config(
    keywords: dict[str, Any], config: str | None, overrides: list[str] | None, plan: bool = True
) -> tuple[Config, Layout | None]:
    """The run's config from the keywords, a YAML file and overrides, with the automatic layout applied.

    The layout is planned when the hybrid engine is on (``use_3d_hybrid``) and ``plan`` is true; keys the
    config or the overrides set are kept.
    """
    overrides = list(overrides or [])
    file = _read_yaml(config) if config is not None else {}
    cfg = load_config(config, keyword_overrides(keywords, overrides, file) + overrides)
    if not (plan and cfg.actor.hybrid_engine):
        logger.info("use_3d_hybrid=False: the baseline (every rank keeps a whole copy, no layout planned)")
        return cfg, None
    from hybridflow.models.loader import load_config as load_model_config

    model_config = load_model_config(cfg.model.path, cfg.model.trust_remote_code)
    gpu = gpu_memory_bytes() if cfg.trainer.device != "cpu" else None
    layout = plan_layout(cfg, model_config, gpu, given=set(given_overrides(overrides)) | _file_keys(file))
    (logger.info if layout.fits else logger.warning)("%s", layout.line())
    return apply_layout(cfg, layout), layout


def _file_keys(file: dict[str, Any], prefix: str = "") -> set[str]:
    """The dotted keys a YAML config sets."""
    out: set[str] = set()
    for key, value in file.items():
        path = f"{prefix}{key}"
        out |= _file_keys(value, path + ".") if isinstance(value, dict) else {path}
    return out


def build_dataset(cfg: Config, data: Any, tokenizer: Any, reward: RewardShape | None) -> RLDataset:
    """An RLDataset from any of the dataset forms users hold (``data.user_rows``)."""
    d = cfg.data
    trl = reward is not None and reward.shape == "trl"
    rows, source = as_rows(data, d.prompt_key, d.reward_fn_key, columns_as_extra_info=trl)
    return RLDataset(
        rows,
        tokenizer,
        prompt_key=d.prompt_key,
        max_prompt_length=d.max_prompt_length,
        truncation=d.truncation,
        filter_overlong_prompts=d.filter_overlong_prompts,
        source=source,
        reward_fn_key=d.reward_fn_key,
        require_ground_truth=reward is None or reward.needs_ground_truth,
        template_text_prompts=d.template_text_prompts,
    )


class RLTrainer:
    """PPO-family training in a few lines, with the write-ups' and TRL's keywords (``trainer.keywords``).

    ``reward_fn`` may take the response text, verl's ``(data_source, solution_str, ground_truth,
    extra_info)``, TRL's batched ``(completions, **kwargs)`` or ``(prompt_ids, response_ids, tokenizer)``;
    its shape is checked here. Any config key is reachable through ``overrides=["rollout.n=8", ...]``.
    """

    def __init__(
        self,
        model_name: str,
        reward_fn: Any = None,
        algorithm: str = "grpo",
        max_steps: int | None = None,
        *,
        per_device_train_batch_size: int | None = None,
        gradient_accumulation_steps: int | None = None,
        learning_rate: float | None = None,
        num_generations: int | None = None,
        use_3d_hybrid: bool = True,
        config: str | None = None,
        overrides: list[str] | None = None,
    ) -> None:
        setup_console_logging()  # the per-step line shows in a notebook too
        self.reward = recognise_reward(reward_fn) if reward_fn is not None else None
        keywords = dict(
            model_name=model_name,
            algorithm=algorithm,
            max_steps=max_steps,
            per_device_train_batch_size=per_device_train_batch_size,
            gradient_accumulation_steps=gradient_accumulation_steps,
            learning_rate=learning_rate,
            num_generations=num_generations,
            use_3d_hybrid=use_3d_hybrid,
        )
        self.cfg, self.layout = build_config(keywords, config, overrides)
        self.history: list[dict[str, float]] = []

    def train(self, dataset: Any, val_dataset: Any = None) -> list[dict[str, float]]:
        """Train on ``dataset`` (any form of ``data.user_rows``); returns the per-step metrics."""
        model, tokenizer = load_policy(self.cfg)
        train = build_dataset(self.cfg, dataset, tokenizer, self.reward)
        val = (
            build_dataset(self.cfg, val_dataset, tokenizer, self.reward) if val_dataset is not None else None
        )
        if val is None:
            self.cfg.trainer.val_before_train = False
        components = build_components(self.cfg, model, tokenizer, self.reward, train=train, val=val)
        try:
            self.history = rl_job(self.cfg, components)
        finally:
            components.close()
        return self.history
