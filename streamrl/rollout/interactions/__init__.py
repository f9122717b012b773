"""Multi-turn interactions with simulated feedback, in verl's Interaction API.

An interaction plays the user: after each assistant turn the rollout worker calls
``generate_response(instance_id, messages, **interaction_kwargs)`` and gets ``(should_terminate,
response, turn_score, metadata)``; unless it ends the episode (or a turn limit is reached) the
response becomes the next user message.

Two ways to configure them:

- verl's: ``rollout.multi_turn.interaction_config_path`` names an interaction config file
  (``registry.load_interaction_config``), and each sample picks its interaction with
  ``extra_info.interaction_kwargs.name``, the rest of ``interaction_kwargs`` going to it;
- streamrl's older ``rollout.interaction.name``: one interaction (a short name from
  ``REGISTRY``, ``package.module:Class``, ``file.py:Class`` or a dotted path) for every sample.
"""

from __future__ import annotations

from typing import Any

from streamrl.loading import load_object
from streamrl.rollout.interactions.base import BaseInteraction
from streamrl.rollout.interactions.registry import load_interaction_config

#: Short names for the interactions streamrl ships.
REGISTRY = {
    "gsm8k": "streamrl.rollout.interactions.gsm8k:Gsm8kInteraction",
}

__all__ = ["BaseInteraction", "REGISTRY", "load_interaction", "load_interaction_config"]


def load_interaction(name: str, kwargs: dict[str, Any] | None = None) -> BaseInteraction:
    """The interaction ``name`` (a registered short name, ``package.module:Class`` or
    ``file.py:Class``; the dotted ``package.module.Class`` verl configs use loads too),
    constructed as verl does: ``Class(config=...)`` with ``{"name": name, **kwargs}``."""
    ref = REGISTRY.get(name, name)
    if ":" not in ref and "." in ref:
        ref = ":".join(ref.rsplit(".", 1))
    cls = load_object(ref, "rollout.interaction.name", "class")
    return cls(config={"name": name, **(kwargs or {})})
