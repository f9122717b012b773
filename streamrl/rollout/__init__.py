"""Rollout: generation backends, multi-turn interactions, weight following and the staleness
gate. ``RolloutWorker`` composes them on the bus; ``streamrl rollout`` runs one. (The prompt feed
that fills the prompts topic is ``streamrl.feed``.) Heavy dependencies (torch, transformers,
vLLM) are imported only by the backend that needs them.
"""

from streamrl.rollout.config import InteractionConfig, RolloutConfig

__all__ = ["InteractionConfig", "RolloutConfig"]
