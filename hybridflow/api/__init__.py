"""The Python APIs, above the trainer: ``RLTrainer`` and the step-wise ``Trainer``.

``RLTrainer(model_name=DIR, reward_fn=fn, ...).train(dataset)`` (``notebook``) is the write-ups' and TRL's
notebook call; ``Trainer`` (``stepwise``) runs one stage at a time (generate, critic_score, update_actor,
save) for a loop of the user's own. Both take the same keywords (``keywords``), size prompts and responses
from the model and the data (``lengths``) and give each run its own directory (``run_dirs``). Both are also
``hybridflow.RLTrainer`` and ``hybridflow.Trainer``; they load torch and transformers on first use.
"""

__all__ = ["RLTrainer", "Trainer"]


def __getattr__(name: str):
    # The trainers pull in torch and transformers: load them on first use, as ``hybridflow`` does.
    if name == "RLTrainer":
        from hybridflow.api.notebook import RLTrainer

        return RLTrainer
    if name == "Trainer":
        from hybridflow.api.stepwise import Trainer

        return Trainer
    raise AttributeError(f"module 'hybridflow.api' has no attribute {name!r}")
