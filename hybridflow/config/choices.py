"""The valid names of every enumerated config field.

These lists live here, not in ``hybridflow.algos``, because config (L1) must not import the algorithms
(L2). The names follow verl's registries. A user who registers a custom estimator or policy loss also
calls ``add_choice`` (the trainer does it for everything in the algos registries) so the name validates.
"""

from __future__ import annotations

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
]
POLICY_LOSSES = ["vanilla", "gspo", "gpg", "clip_cov", "kl_cov", "cispo", "reinforce"]
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
DTYPES = ["auto", "float32", "fp32", "bfloat16", "bf16", "float16", "fp16"]
LOGGERS = ["console", "jsonl", "tensorboard", "wandb"]

CHOICES: dict[str, list[str]] = {
    "model.tiny_arch": ["qwen2", "llama"],
    "model.attn_implementation": ["sdpa", "eager", "flex_attention", "flash_attention_2"],
    "data.task": ["arithmetic", "countdown"],
    "data.truncation": ["error", "left", "right", "middle"],
    "rollout.engine": ["native", "hf"],
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
    "critic.loss_agg_mode": LOSS_AGG_MODES,
    "actor.kl_loss_type": KL_PENALTIES,
    "algorithm.adv_estimator": ADV_ESTIMATORS,
    "algorithm.kl_penalty": KL_PENALTIES,
    "algorithm.kl_ctrl.type": ["fixed", "adaptive"],
    "algorithm.rollout_correction.rollout_is": ["token", "sequence"],
    "algorithm.rollout_correction.rollout_rs": ["token", "sequence", "geometric"],
    "reward.manager": ["naive", "batch", "dapo", "prime"],
    "reward.on_error": ["raise", "zero"],
    "trainer.logger": LOGGERS,
    "trainer.resume_mode": ["auto", "disable", "resume_path"],
    "trainer.device": ["auto", "cuda", "cpu"],
    "trainer.backend": ["local", "ray"],
    "trainer.placement": ["colocated", "split"],
    "preference.loss_type": ["sigmoid", "ipo"],
    "preference.truncation": ["error", "left", "right", "filter"],
}


def add_choice(path: str, name: str) -> None:
    """Accept ``name`` as a value of the enumerated field ``path`` (e.g. a custom advantage estimator)."""
    if path not in CHOICES:
        raise ValueError(
            f"{path!r} is not an enumerated config field; those are: {', '.join(sorted(CHOICES))}"
        )
    if name not in CHOICES[path]:
        CHOICES[path].append(name)
