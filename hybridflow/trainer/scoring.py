"""Turning sampled responses into scores: decode, call the reward functions, add the DAPO overlong penalty."""

from __future__ import annotations

import logging
from typing import Any

import torch

from hybridflow.config.schema import Config
from hybridflow.protocol import Batch
from hybridflow.rewards import RewardManager, default_compute_score, known_data_sources, load_reward_function
from hybridflow.rewards.shapes import RewardShape
from hybridflow.utils.text import batch_decode

logger = logging.getLogger(__name__)


def build_reward_manager(cfg: Config, reward_fn: Any = None) -> RewardManager:
    """The configured manager: a given Python function, ``reward.custom_function``, or the built-in scorers."""
    r = cfg.reward
    fn, name = reward_fn, getattr(reward_fn, "__name__", None)
    if fn is None and r.custom_function.path:
        fn = load_reward_function(r.custom_function.path, r.custom_function.name)
        name = f"{r.custom_function.path}:{r.custom_function.name}"
    kind = r.manager if r.manager in ("naive", "batch", "token") else "naive"  # dapo/prime score per sample
    if isinstance(fn, RewardShape):  # recognised by the notebook API: its own call and manager kind
        fn, name, kind = fn.call, fn.name, fn.kind
    return RewardManager(
        fn,
        kind=kind,
        on_error=r.on_error,
        num_workers=r.num_workers,
        timeout_s=r.timeout_s,
        fn_name=name or "default_compute_score",
        reward_kwargs=dict(r.custom_function.reward_kwargs),
    )


def has_scorer(cfg: Config, reward_fn: Any = None) -> bool:
    """True when a user function or a reward model scores every sample (so any data_source is acceptable)."""
    return reward_fn is not None or bool(cfg.reward.custom_function.path) or cfg.reward.model.enable


def known_sources() -> list[str]:
    """Data sources the built-in scorers understand."""
    return known_data_sources()


class Scorer:
    """Scores a batch of samples: ``score(batch) -> (scores (B,), extras)``."""

    def __init__(self, manager: RewardManager, tokenizer: Any, cfg: Config, reward_model: Any = None) -> None:
        self.manager = manager
        self.reward_model = reward_model  # a RewardModelWorker replaces the rule-based scores when set
        self.tokenizer = tokenizer
        self.overlong = cfg.reward.overlong_buffer
        self.max_response_length = cfg.data.max_response_length
        self.model_path = cfg.reward.model.path
        h = cfg.rollout.harness
        self.harness = h.verifiers_env or h.module if h.enabled else None  # the episodes' own rewards
        self.sources: set[str] = set()  # the data sources scored so far (a warning names them)

    def describe(self) -> str:
        """Who scores, as a warning names it: the reward model, the function, or the built-in scorer, with the
        data sources seen so far."""
        sources = ", ".join(repr(s) for s in sorted(self.sources)[:5]) + (
            ", ..." if len(self.sources) > 5 else ""
        )
        of = f"data_source {sources}" if sources else "no data scored yet"
        if self.harness is not None:
            return f"the harness {self.harness} ({of})"
        if self.reward_model is not None:
            return f"the reward model {self.model_path} ({of})"
        if self.manager.fn_name == "default_compute_score":
            return f"the built-in scorer of {of}"
        return f"the reward function {self.manager.fn_name} ({of})"

    def score(self, batch: Batch) -> tuple[torch.Tensor, dict[str, list[float]]]:
        """Decode each response (valid tokens only) and score it against its ground truth."""
        mask = batch["response_mask"].bool()  # (B, R)
        if "data_source" in batch:
            self.sources.update(str(s) for s in batch["data_source"])
        if "harness_reward" in batch:  # rollout.harness: each episode's harness gave its reward
            out = torch.tensor([float(r) for r in batch["harness_reward"]], dtype=torch.float32)  # (B,)
            return self._with_penalty(out, {"acc": (out > 0).float().tolist()}, mask)
        if self.reward_model is not None:
            out = self.reward_model.compute_scores(batch)  # (B,)
            return self._with_penalty(out, {"acc": (out > 0).float().tolist()}, mask)
        response_ids = [row[m].tolist() for row, m in zip(batch["responses"], mask)]
        texts = batch_decode(self.tokenizer, response_ids, skip_special_tokens=True)
        prompt_ids = None
        if self.manager.kind == "token":
            prompt_len = batch["input_ids"].shape[1] - mask.shape[1]  # the left-padded prompt columns
            prompt_mask = batch["attention_mask"][:, :prompt_len].bool()  # (B, P)
            prompt_ids = [row[m].tolist() for row, m in zip(batch["input_ids"][:, :prompt_len], prompt_mask)]
        extra_infos = list(batch["extra_info"]) if "extra_info" in batch else None
        scores, extras = self.manager.score(
            list(batch["data_source"]),
            texts,
            list(batch["ground_truth"]),
            extra_infos,
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            tokenizer=self.tokenizer,
        )
        out = torch.tensor(scores, dtype=torch.float32)  # (B,)
        extras.setdefault("acc", [float(s > 0) for s in scores])
        return self._with_penalty(out, extras, mask)

    def _with_penalty(
        self, out: torch.Tensor, extras: dict[str, list[float]], mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, list[float]]]:
        if self.overlong.enable:
            penalty = self._overlong_penalty(mask.sum(-1).float())
            if self.overlong.log:  # as verl: the per-sample penalty becomes a reward_extra metric on request
                extras["overlong_penalty"] = penalty.tolist()
            out = out + penalty
        return out, extras

    def _overlong_penalty(self, lengths: torch.Tensor) -> torch.Tensor:
        """DAPO's soft length penalty: 0 until the buffer, then linear down to -penalty_factor at the end."""
        start = self.max_response_length - self.overlong.len
        over = (lengths - start).clamp(min=0) / max(self.overlong.len, 1)
        return -over.clamp(max=1.0) * self.overlong.penalty_factor

    def close(self) -> None:
        """Stop reward worker processes, if any."""
        self.manager.close()


__all__ = ["Scorer", "build_reward_manager", "default_compute_score", "has_scorer", "known_sources"]
