"""The notebook API: ``RLTrainer(model_name=DIR, reward_fn=fn, algorithm="grpo", max_steps=...).train(dataset)``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hybridflow.config import Config, load_config
from hybridflow.data import RLDataset, load_rows
from hybridflow.models import load_causal_lm, load_tokenizer
from hybridflow.trainer.builder import build_components
from hybridflow.trainer.jobs import rl_job


class RLTrainer:
    """PPO-family training in a few lines; every config key is reachable as a dotted keyword override.

    ``RLTrainer(model_name="path/to/model", reward_fn=fn, algorithm="grpo", max_steps=100,
    overrides=["rollout.n=8"])``. ``reward_fn`` has verl's signature
    ``fn(data_source, solution_str, ground_truth, extra_info=None) -> float``. ``algorithm`` is any
    estimator name, one registered with ``@register_adv_est`` before this call included.
    """

    def __init__(
        self,
        model_name: str,
        reward_fn: Any = None,
        algorithm: str = "grpo",
        max_steps: int | None = None,
        config: str | None = None,
        overrides: list[str] | None = None,
    ) -> None:
        extra = [f"model.path={model_name}", f"algorithm.adv_estimator={algorithm}"]
        if max_steps is not None:
            extra.append(f"trainer.total_training_steps={max_steps}")
        self.cfg: Config = load_config(config, extra + list(overrides or []))
        self.reward_fn = reward_fn

    def _dataset(self, data: Any, tokenizer: Any) -> RLDataset:
        if isinstance(data, str | Path):
            rows, source = load_rows(data), str(data)
        else:
            rows, source = [dict(r) for r in data], "dataset"  # a list of dicts or a HF Dataset
        d = self.cfg.data
        return RLDataset(
            rows,
            tokenizer,
            prompt_key=d.prompt_key,
            max_prompt_length=d.max_prompt_length,
            truncation=d.truncation,
            filter_overlong_prompts=d.filter_overlong_prompts,
            source=source,
            reward_fn_key=d.reward_fn_key,
        )

    def train(self, dataset: Any, val_dataset: Any = None) -> list[dict[str, float]]:
        """Train on ``dataset`` (list of dicts, HF Dataset or parquet/jsonl path); returns per-step metrics."""
        tokenizer = load_tokenizer(self.cfg.model.path)
        model = load_causal_lm(self.cfg.model.path)
        train = self._dataset(dataset, tokenizer)
        val = self._dataset(val_dataset, tokenizer) if val_dataset is not None else None
        if val is None:
            self.cfg.trainer.val_before_train = False
        components = build_components(self.cfg, model, tokenizer, self.reward_fn, train=train, val=val)
        return rl_job(self.cfg, components)
