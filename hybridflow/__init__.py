"""hybridflow: RL post-training for LLMs on the HybridFlow design.

A single controller drives worker groups; the actor trains with FSDP2 and generates with a built-in
rollout engine on the same weights. ``import hybridflow`` stays light: no Ray, no model loading.
"""

__version__ = "0.1.0"

__all__ = ["RLTrainer", "Trainer", "__version__"]


def __getattr__(name: str):
    # The trainers pull in torch and transformers: load them on first use so `import hybridflow` stays light.
    if name == "RLTrainer":
        from hybridflow.api.notebook import RLTrainer

        return RLTrainer
    if name == "Trainer":  # the step-wise API (generate, critic_score, update_actor, save)
        from hybridflow.api.stepwise import Trainer

        return Trainer
    if name == "HybridDataFlow":  # the write-ups' class: an ImportError that says what to use instead
        raise ImportError(HYBRID_DATAFLOW_POINTER, name="hybridflow")
    raise AttributeError(f"module 'hybridflow' has no attribute {name!r}")


HYBRID_DATAFLOW_POINTER = (
    "hybridflow has no HybridDataFlow (the HybridFlow write-ups' name): its built-in dataflow is that step. "
    "Every algorithm's training step is already a list of stages (gen, reward, old_log_prob, ref, values, adv, "
    "update_critic, update_actor) run by hybridflow.trainer.dataflow.Dataflow; each stage is "
    "Stage(name, reads, writes, run) and runs after the stages that write what it reads, so there is no "
    "dependencies= to write. To add a stage, build a Dataflow of your own from Stage objects, or write the "
    "training loop with the step-wise hybridflow.Trainer (generate, critic_score, update_actor) and run your "
    "stage between its calls; docs/dataflow.md shows both"
)
