"""'Did you mean' for an unknown key: the closest of our keys, verl's and the short spellings, and the notebook
API's keywords, which people also type on the command line (``learning_rat=1e-6`` -> ``actor.optim.lr``)."""

from __future__ import annotations

import difflib

from hybridflow.config import aliases
from hybridflow.config.errors import Problem
from hybridflow.config.schema import schema_index

# The notebook API's keywords (the HybridFlow write-ups' and TRL's) that set one config key each;
# hybridflow.api.keywords takes them from here. gradient_accumulation_steps is not among them: it sets
# the mini-batch from three values.
KEYWORD_KEYS: dict[str, str] = {
    "model_name": "model.path",
    "algorithm": "algorithm.adv_estimator",
    "max_steps": "trainer.total_training_steps",
    "learning_rate": "actor.optim.lr",
    "num_generations": "rollout.n",
    "per_device_train_batch_size": "actor.ppo_micro_batch_size_per_gpu",
    "max_prompt_length": "data.max_prompt_length",
    "max_completion_length": "data.max_response_length",
    "output_dir": "trainer.default_local_dir",
    "use_3d_hybrid": "actor.hybrid_engine",
}


def all_keys() -> list[str]:
    """Every key a config takes as written: our fields and sections, verl's keys and the short spellings."""
    leaves, sections = schema_index()
    return [*leaves, *sections, *aliases.VERL_ALIASES, *aliases.SHORTHANDS]


def _keyword_matches(name: str) -> list[str]:
    """'key' (the notebook API's keyword=) for the keywords closest to ``name``."""
    close = difflib.get_close_matches(name, list(KEYWORD_KEYS), n=2, cutoff=0.75)
    return [f"'{KEYWORD_KEYS[k]}' (the notebook API's {k}=)" for k in close]


def _key_matches(path: str) -> list[str]:
    """The keys closest to ``path``, by the whole path, else by its last name (a dotted key is never offered
    a section: ``algorithm.grpo_n`` -> ``algorithm`` helps nobody)."""
    sections = schema_index()[1]
    keys = [k for k in all_keys() if "." not in path or k not in sections]
    close = difflib.get_close_matches(path, keys, n=3, cutoff=0.6)
    if not close:  # compare the last component: 'temprature' finds 'rollout.temperature'
        last = path.rsplit(".", 1)[-1]
        by_last = {k.rsplit(".", 1)[-1]: k for k in reversed(keys)}
        close = [by_last[m] for m in difflib.get_close_matches(last, list(by_last), n=3, cutoff=0.75)]
    return [repr(c) for c in close]


def unknown_key(path: str) -> Problem:
    """An unknown-key problem whose fix names the closest keys (a keyword's key first for an undotted name)."""
    keywords = _keyword_matches(path.rsplit(".", 1)[-1])
    keys = _key_matches(path)
    close = [*keywords, *keys] if "." not in path else (keys or keywords)
    fix = f"did you mean {' or '.join(close[:3])}?" if close else "see docs/config.md for all keys"
    return Problem(path, "unknown config key", fix)
