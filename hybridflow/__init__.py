"""hybridflow: RL post-training for LLMs on the HybridFlow design.

A single controller drives worker groups; the actor trains with FSDP2 and generates with a built-in
rollout engine on the same weights. ``import hybridflow`` stays light: no Ray, no model loading.
"""

__version__ = "0.1.0"

__all__ = ["RLTrainer", "Trainer", "__version__"]


def __getattr__(name: str):
    # The trainers pull in torch and transformers: load them on first use so `import hybridflow` stays light.
    if name == "RLTrainer":
        from hybridflow.trainer.api import RLTrainer

        return RLTrainer
    if name == "Trainer":  # the step-wise API (generate, critic_score, update_actor, save)
        from hybridflow.trainer.stepwise import Trainer

        return Trainer
    raise AttributeError(f"module 'hybridflow' has no attribute {name!r}")
