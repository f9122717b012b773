"""Rollout: the prompt feed, generation backends, multi-turn interactions, weight following and
the staleness gate. ``RolloutWorker`` composes them on the bus; ``streamrl rollout`` runs one.
Heavy dependencies (torch, transformers, vLLM) are imported only by the backend that needs them.
"""

from streamrl.rollout.config import FeedConfig, InteractionConfig, RolloutConfig

__all__ = ["FeedConfig", "InteractionConfig", "RolloutConfig"]
