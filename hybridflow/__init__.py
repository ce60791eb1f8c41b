"""hybridflow: RL post-training for LLMs on the HybridFlow design.

A single controller drives worker groups; the actor trains with FSDP2 and generates with a built-in
rollout engine on the same weights. ``import hybridflow`` stays light: no Ray, no model loading.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
