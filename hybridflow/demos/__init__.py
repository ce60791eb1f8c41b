"""The built-in demos, above the trainer: a tiny model, a built-in task, an SFT warm-up and then RL, on a CPU.

``text`` is ``hybridflow train`` (and ``hybridflow dpo``) with no config: the arithmetic (or countdown) task,
GRPO (or DPO) after the warm-up, and the warm-up path the other demos share; ``tool_use`` is
``data.task=multiply``, whose episodes call the ``calc`` tool; ``vision`` is ``data.task=squares``, a tiny
vision-language model counting coloured squares.
"""
