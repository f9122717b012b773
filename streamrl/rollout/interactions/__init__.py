"""Multi-turn interactions with simulated feedback, in verl's Interaction API.

An interaction plays the user: after each assistant turn the rollout worker calls
``generate_response(instance_id, messages)`` and gets ``(done, feedback_text, turn_score,
info)``; unless ``done`` (or a turn limit is reached) the feedback becomes the next user
message. A verl interaction class works unchanged: name it as `package.module:Class` or `file.py:Class` in
``rollout.interaction.name``.
"""

from __future__ import annotations

from typing import Any

from streamrl.loading import load_object
from streamrl.rollout.interactions.base import BaseInteraction

#: Short names for the interactions streamrl ships.
REGISTRY = {
    "gsm8k": "streamrl.rollout.interactions.gsm8k:Gsm8kInteraction",
}

__all__ = ["BaseInteraction", "REGISTRY", "load_interaction"]


def load_interaction(name: str, kwargs: dict[str, Any] | None = None) -> BaseInteraction:
    """The interaction ``name`` (a registered short name, ``package.module:Class`` or
    ``file.py:Class``; the older dotted ``package.module.Class`` still loads), constructed as verl
    does: ``Class(config)`` with ``config = {"name": name, **kwargs}``."""
    ref = REGISTRY.get(name, name)
    if ":" not in ref and "." in ref:
        ref = ":".join(ref.rsplit(".", 1))
    cls = load_object(ref, "rollout.interaction.name", "class")
    return cls({"name": name, **(kwargs or {})})
