"""The notebook API: ``RLTrainer(model_name=DIR, reward_fn=fn, max_steps=...).train(dataset)``.

The HybridFlow write-ups' call runs as written::

    trainer = RLTrainer(model_name="/models/Llama-3-8B", reward_fn=lambda x: 1.0 if "Transformer" in x else 0.5,
                        max_steps=100, per_device_train_batch_size=2, gradient_accumulation_steps=4,
                        learning_rate=1e-6, use_3d_hybrid=True)
    trainer.train(small_dataset)

Keywords map onto config keys (``api.keywords``), the reward function's shape is recognised at
construction (``rewards.shapes``), datasets come in any of ``data.user_rows``' forms, and with
``use_3d_hybrid=True`` (the hybrid engine) the layout is planned from the model and the GPUs unless the config
sets it (``plan.auto_layout``, as ``hybridflow train`` does; ``trainer.auto_layout=false`` turns it off).
``use_3d_hybrid=False`` runs the baseline (``actor.hybrid_engine=false``).
Lengths come from the model and the data unless set (``api.lengths``); every ``train()`` gets a run
directory of its own and resumes only when asked (``api.run_dirs``).
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridflow.api import lengths
from hybridflow.api.keywords import KEYWORDS, check_keywords, keyword_overrides, keyword_paths
from hybridflow.api.run_dirs import Resume, run_dir_settings
from hybridflow.config import Config
from hybridflow.config.loader import _read_yaml, config_from_dict
from hybridflow.config.nesting import check_nesting
from hybridflow.config.user_keys import file_values, given_overrides, user_keys
from hybridflow.data import RLDataset
from hybridflow.data.user_rows import as_rows
from hybridflow.plan.auto_layout import log_plan, plan_run
from hybridflow.plan.search import Layout
from hybridflow.rewards.shapes import RewardShape, recognise_reward
from hybridflow.trainer.builder import build_components, load_policy
from hybridflow.trainer.jobs import rl_job
from hybridflow.utils.errors import UserError
from hybridflow.utils.logging import setup_console_logging
from hybridflow.workers.build import load_policy_tokenizer

logger = logging.getLogger(__name__)

ConfigSource = str | os.PathLike | Mapping[str, Any] | None


def _read_config(config: ConfigSource) -> dict[str, Any]:
    """The ``config=`` argument as a nested mapping: a YAML file's path, or a dict (verl's keys accepted)."""
    if config is None:
        return {}
    if isinstance(config, Mapping):
        check_nesting(config, "config")  # before deepcopy, which recurses once per level
        return copy.deepcopy(dict(config))
    if isinstance(config, (str, os.PathLike)):
        return dict(_read_yaml(config))
    raise UserError(
        f"config={type(config).__name__}: give the path of a YAML file or a dict of sections (e.g. "
        "{'rollout': {'n': 4}})"
    )


@dataclass
class Setup:
    """What the user gave the Python API: keywords, the config file or dict, overrides, and our defaults.

    ``config(extra)`` builds the run's config; ``extra`` holds values the API chooses (lengths, the run
    directory) for keys the user left unset.
    """

    keywords: dict[str, Any]
    file: dict[str, Any]
    overrides: list[str]
    defaults: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(
        cls,
        keywords: dict[str, Any],
        config: ConfigSource,
        overrides: list[str] | None,
        defaults: dict[str, Any] | None = None,
    ) -> Setup:
        """Read the config argument and check the keywords against it and the overrides."""
        setup = cls(dict(keywords), _read_config(config), list(overrides or []), dict(defaults or {}))
        setup.keyword_overrides()  # refuses contradictions now, before anything loads
        return setup

    def keyword_overrides(self) -> list[str]:
        """The keywords (and our defaults for keys nobody set) as ``key=value`` overrides."""
        return keyword_overrides(self.keywords, self.overrides, file_values(self.file), self.defaults or None)

    def is_set(self, path: str) -> bool:
        """Whether the user set ``path``: a keyword, an override or the config file/dict."""
        given = given_overrides(self.overrides)
        return path in given or path in file_values(self.file) or path in keyword_paths(self.keywords)

    def config(self, extra: Mapping[str, Any] | None = None) -> Config:
        """The run's config: defaults, the file or dict, ``extra`` (unset keys only), keywords, overrides."""
        data = {**self.file, **dict(extra or {})}  # dotted keys at the top level are read as paths
        return config_from_dict(data, self.keyword_overrides() + self.overrides)

    def layout_keys(self) -> set[str]:
        """The keys the user set, which the automatic layout keeps."""
        return user_keys(self.file, self.overrides)


def plan(setup: Setup, cfg: Config, plan_it: bool = True) -> tuple[Config, Layout | None]:
    """``cfg`` with the automatic layout applied (``plan.auto_layout``: keys the user set are kept)."""
    if not plan_it:
        return cfg, None
    return plan_run(cfg, setup.layout_keys())


def log_layout(cfg: Config, layout: Layout | None) -> None:
    """The layout line with the planned keys (a warning when nothing fits), or why none was planned."""
    log_plan(cfg, layout)


def build_config(
    keywords: dict[str, Any], config: ConfigSource, overrides: list[str] | None, plan_it: bool = True
) -> tuple[Config, Layout | None]:
    """The run's config from the keywords, a YAML file (or dict) and overrides, with the automatic layout."""
    setup = Setup.of(keywords, config, overrides)
    cfg, layout = plan(setup, setup.config(), plan_it)
    log_layout(cfg, layout)
    return cfg, layout


def describe(data: Any, name: str, rows: int) -> str:
    """The dataset as log lines name it: its files, else its type and size ('datasets.Dataset (8 rows)')."""
    if isinstance(data, (list, tuple)) and not all(isinstance(p, Path) for p in data):
        return f"a list of {rows} rows"
    if name == type(data).__name__:
        return f"{type(data).__module__.split('.')[0]}.{name} ({rows} rows)"
    return name


def build_dataset(
    cfg: Config,
    data: Any,
    tokenizer: Any,
    reward: RewardShape | None,
    max_prompt_length: int | None = None,
    require_ground_truth: bool | None = None,
    processor: Any = None,
) -> RLDataset:
    """An RLDataset from any of the dataset forms users hold (``data.user_rows``).

    ``max_prompt_length`` (the API's own limit) filters longer prompts out unless the user chose a
    truncation; None keeps the config's rules. ``require_ground_truth`` defaults to whether the reward reads one.
    ``processor``: a vision-language policy's, for rows with images (column ``data.image_key``).
    """
    d = cfg.data
    trl = reward is None or reward.shape == "trl"  # a TRL function may come later (step-wise API)
    rows, source = as_rows(data, d.prompt_key, d.reward_fn_key, columns_as_extra_info=trl)
    if require_ground_truth is None:
        require_ground_truth = reward is None or reward.needs_ground_truth
    own = max_prompt_length is not None
    return RLDataset(
        rows,
        tokenizer,
        prompt_key=d.prompt_key,
        max_prompt_length=max_prompt_length if own else d.max_prompt_length,
        truncation=d.truncation,
        filter_overlong_prompts=d.filter_overlong_prompts or (own and d.truncation == "error"),
        source=describe(data, source, len(rows)),
        reward_fn_key=d.reward_fn_key,
        require_ground_truth=require_ground_truth,
        template_text_prompts=d.template_text_prompts,
        processor=processor,
        image_key=d.image_key,
    )


class RLTrainer:
    """PPO-family training in a few lines, with the write-ups' and TRL's keywords (``api.keywords``).

    ``reward_fn`` may take the response text, verl's ``(data_source, solution_str, ground_truth,
    extra_info)``, TRL's batched ``(completions, **kwargs)`` or ``(prompt_ids, response_ids, tokenizer)``;
    its shape is checked here. ``config`` is a YAML file or a dict of sections; any config key is reachable
    through ``overrides=["rollout.n=8", ...]``. A keyword that contradicts the config or an override is
    refused, naming both; an unknown keyword is refused, naming the closest one.
    """

    def __init__(
        self,
        model_name: str,
        reward_fn: Any = None,
        algorithm: str | None = None,
        max_steps: int | None = None,
        *,
        per_device_train_batch_size: int | None = None,
        gradient_accumulation_steps: int | None = None,
        learning_rate: float | None = None,
        num_generations: int | None = None,
        max_prompt_length: int | None = None,
        max_completion_length: int | None = None,
        output_dir: str | os.PathLike | None = None,
        use_3d_hybrid: bool | None = None,
        config: ConfigSource = None,
        overrides: list[str] | None = None,
        **unknown: Any,
    ) -> None:
        check_keywords(unknown, (*KEYWORDS, "reward_fn", "config", "overrides"), "RLTrainer")
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
            max_prompt_length=max_prompt_length,
            max_completion_length=max_completion_length,
            output_dir=None if output_dir is None else str(output_dir),
            use_3d_hybrid=use_3d_hybrid,
        )
        self.setup = Setup.of(keywords, config, overrides)
        self.limit = lengths.position_limit(self.setup.config())
        self.extra = self._response_default()
        self.cfg, self.layout = plan(self.setup, self.setup.config(self.extra))
        log_layout(self.cfg, self.layout)
        self.history: list[dict[str, float]] = []
        self.run_dir: Path | None = None  # set by train()

    def _response_default(self) -> dict[str, Any]:
        """verl's response length (or half the model's positions) unless the user set one."""
        if self.setup.is_set(lengths.RESPONSE):
            return {}
        return {lengths.RESPONSE: lengths.default_response_length(self.limit)}

    def train(
        self, dataset: Any, val_dataset: Any = None, resume_from_checkpoint: Resume = None
    ) -> list[dict[str, float]]:
        """Train on ``dataset`` (any form of ``data.user_rows``) in a run directory of its own; the per-step
        metrics. ``resume_from_checkpoint``: True (the latest checkpoint of the named run, else of this
        model's newest run), a checkpoint or run directory, or False (a fresh start even in a named one)."""
        extra = dict(
            self.extra, **run_dir_settings(self.setup.config(), self.setup.is_set, resume_from_checkpoint)
        )
        cfg = self.setup.config(extra)
        if cfg.trainer.backend == "ray":  # every rank loads the model itself; the driver needs the tokenizer
            model, tokenizer = None, load_policy_tokenizer(cfg)
        else:
            model, tokenizer = load_policy(cfg)
        train, val = self._datasets(cfg, dataset, val_dataset, tokenizer, extra)
        cfg, layout = plan(self.setup, self.setup.config(extra))
        if layout is not None and (self.layout is None or layout.line() != self.layout.line()):
            log_layout(cfg, layout)  # planned again for the lengths of the data
        self.cfg, self.layout = cfg, layout
        self.run_dir = Path(cfg.trainer.run_dir())
        logger.info("run directory: %s", self.run_dir)
        if val is None:
            self.cfg.trainer.val_before_train = False
        components = build_components(self.cfg, model, tokenizer, self.reward, train=train, val=val)
        try:
            self.history = rl_job(self.cfg, components)
        finally:
            components.close()
        return self.history

    def _datasets(
        self, cfg: Config, dataset: Any, val_dataset: Any, tokenizer: Any, extra: dict[str, Any]
    ) -> tuple[RLDataset, RLDataset | None]:
        """The train and validation sets; ``data.max_prompt_length`` sized from them unless the user set it."""
        sized = not self.setup.is_set(lengths.PROMPT)
        cap = lengths.prompt_cap(self.limit, cfg.data.max_response_length) if sized else None
        limit = (cap or lengths.NO_LIMIT) if sized else None
        train = build_dataset(cfg, dataset, tokenizer, self.reward, limit)
        val = (
            build_dataset(cfg, val_dataset, tokenizer, self.reward, limit)
            if val_dataset is not None
            else None
        )
        if sized:
            longest = lengths.longest_prompt([train, val])
            extra[lengths.PROMPT] = longest
            lengths.prompt_length_line(longest, cap, self.limit, cfg.data.max_response_length, train.source)
        return train, val
