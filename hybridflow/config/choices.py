"""The valid names of every enumerated config field.

These lists live here, not in ``hybridflow.algos``, because config (L1) must not import the algorithms
(L2). The names follow verl's registries. A higher layer can add names that exist only at run time through
a choice source: ``register_choice_source(path, source)``, where ``source(cfg)`` returns more valid names
for ``path``; validation asks the sources of a field only for a value outside its built-in list. The
trainer (importing ``hybridflow.trainer`` is enough) registers the algos registries this way, so a name
registered with ``@register_adv_est`` or ``@register_policy_loss`` before a config is validated, or by the
module ``reward.custom_function.path`` names, is a valid ``algorithm.adv_estimator`` or
``actor.policy_loss.loss_mode``. ``add_choice`` adds one fixed name to any enumerated field.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

ADV_ESTIMATORS = [
    "gae",
    "grpo",
    "grpo_passk",
    "rloo",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "remax",
    "opo",
    "gpg",
    "grpo_vectorized",
    "rloo_vectorized",
    "gdpo",
    "optimal_token_baseline",
    "tir_optimal_token_baseline",
]
POLICY_LOSSES = [
    "vanilla",
    "gspo",
    "gpg",
    "clip_cov",
    "kl_cov",
    "cispo",
    "reinforce",
    "dppo_tv",
    "dppo_kl",
    "sapo",
    "geo_mean",
    "dro",
    "bypass_mode",
]
# Estimators that need inputs our PPO trainer does not produce (a per-token sum_pi_squared): refused by
# validation with the reason, still callable from hybridflow.algos.
UNFED_ADV_ESTIMATORS = ["optimal_token_baseline", "tir_optimal_token_baseline"]
LOSS_AGG_MODES = [
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
]
_KL_BASE = ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"]
# A '+' suffix is the straight-through variant: the estimator's value with the gradient of k2.
KL_PENALTIES = _KL_BASE + [f"{name}+" for name in _KL_BASE]
# algorithm.rollout_correction.rollout_rs: one or more of these, comma separated (verl 0.9.1's options),
# or our older names, aliases of the option they equal. Checked in config.rollout_correction.
ROLLOUT_RS_OPTIONS = [
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
]
ROLLOUT_RS_ALIASES = {"token": "token_k1", "sequence": "seq_sum_k1", "geometric": "seq_mean_k1"}
DTYPES = ["auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"]
LOGGERS = ["console", "jsonl", "tensorboard", "wandb"]

CHOICES: dict[str, list[str]] = {
    "model.tiny_arch": ["qwen2", "qwen3", "llama"],
    "model.attn_implementation": ["sdpa", "eager", "flex_attention", "flash_attention_2"],
    "data.task": ["arithmetic", "countdown", "multiply", "squares"],
    "data.truncation": ["error", "left", "right", "middle"],
    "rollout.engine": ["native", "hf"],
    "rollout.lora_merge": ["buffer", "in_place"],
    "rollout.dtype": DTYPES,
    "actor.optim.lr_scheduler_type": ["constant", "cosine"],
    "critic.optim.lr_scheduler_type": ["constant", "cosine"],
    "actor.fsdp.param_dtype": DTYPES,
    "actor.fsdp.reduce_dtype": DTYPES[1:],
    "actor.fsdp.master_dtype": DTYPES,
    "critic.fsdp.param_dtype": DTYPES,
    "critic.fsdp.reduce_dtype": DTYPES[1:],
    "critic.fsdp.master_dtype": DTYPES,
    "ref.fsdp.param_dtype": DTYPES,
    "ref.fsdp.reduce_dtype": DTYPES[1:],
    "ref.fsdp.master_dtype": DTYPES,
    "actor.policy_loss.loss_mode": POLICY_LOSSES,
    "actor.loss_agg_mode": LOSS_AGG_MODES,
    "actor.router_replay": ["off", "r2", "r3"],
    "critic.loss_agg_mode": LOSS_AGG_MODES,
    "actor.kl_loss_type": KL_PENALTIES,
    "algorithm.adv_estimator": ADV_ESTIMATORS,
    "algorithm.kl_penalty": KL_PENALTIES,
    "algorithm.kl_ctrl.type": ["fixed", "adaptive"],
    "algorithm.rollout_correction.rollout_is": ["token", "sequence"],
    "actor.policy_loss.rollout_correction.rollout_is": ["token", "sequence"],
    "actor.policy_loss.rollout_correction.loss_type": ["ppo_clip", "reinforce"],
    "reward.manager": ["naive", "batch", "dapo", "prime"],
    "reward.on_error": ["raise", "zero"],
    "trainer.logger": LOGGERS,
    "trainer.resume_mode": ["auto", "disable", "resume_path"],
    "trainer.device": ["auto", "cuda", "cpu"],
    "trainer.backend": ["local", "ray"],
    "trainer.placement": ["colocated", "split"],
    "trainer.async_mode": ["sync", "colocate", "separate"],
    "rollout.multi_turn.format": ["hermes", "plain"],
    "rollout.harness.on_error": ["zero", "drop"],
    "rollout.harness.tool_format": ["hermes", "plain"],
    "trainer.staleness_policy": ["wait", "drop"],
    "preference.loss_type": ["sigmoid", "ipo"],
    "preference.truncation": ["error", "left", "right", "filter"],
}


# A choice source: called with the Config being validated, returns more valid names for its field. It may
# raise ConfigError when it cannot answer (a module it must import is broken): its problems are reported.
ChoiceSource = Callable[[Any], Iterable[str]]
_SOURCES: dict[str, list[ChoiceSource]] = {}

# How a user adds a name of their own to a field that has choice sources (shown with the unknown-value error).
REGISTER_HINTS: dict[str, str] = {
    "algorithm.adv_estimator": "@register_adv_est(name)",
    "actor.policy_loss.loss_mode": "@register_policy_loss(name)",
}


def _check_enumerated(path: str) -> None:
    if path not in CHOICES:
        raise ValueError(
            f"{path!r} is not an enumerated config field; those are: {', '.join(sorted(CHOICES))}"
        )


def add_choice(path: str, name: str) -> None:
    """Accept ``name`` as a value of the enumerated field ``path`` (e.g. a custom advantage estimator)."""
    _check_enumerated(path)
    if name not in CHOICES[path]:
        CHOICES[path].append(name)


def register_choice_source(path: str, source: ChoiceSource) -> None:
    """Also accept, for the enumerated field ``path``, the names ``source(cfg)`` returns at validation."""
    _check_enumerated(path)
    sources = _SOURCES.setdefault(path, [])
    if source not in sources:
        sources.append(source)


def choices_for(path: str, cfg: Any) -> list[str]:
    """The valid names of ``path`` for ``cfg``: the built-in ones, then those of its sources, in order."""
    names = list(CHOICES[path])
    for source in _SOURCES.get(path, []):
        names += [n for n in source(cfg) if n not in names]
    return names


def unknown_choice_fix(path: str, names: list[str]) -> str:
    """The fix of an unknown value of ``path``: the valid ``names``, and how to register one's own."""
    fix = f"use one of: {', '.join(names)}"
    hint = REGISTER_HINTS.get(path)
    if hint is None:
        return fix
    fix += (
        f"; or register your own with {hint} from hybridflow.algos, before the config is built or in the "
        "module reward.custom_function.path names"
    )
    if path not in _SOURCES:
        fix += " (registered names count once hybridflow.trainer is imported)"
    return fix
