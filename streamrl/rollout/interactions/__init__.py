"""Multi-turn interactions with simulated feedback, in verl's Interaction API.

An interaction plays the user: after each assistant turn the rollout worker calls
``generate_response(instance_id, messages)`` and gets ``(done, feedback_text, turn_score,
info)``; unless ``done`` (or a turn limit is reached) the feedback becomes the next user
message. A verl interaction class works unchanged: name it by its dotted path in
``rollout.interaction.name``.
"""

from __future__ import annotations

import importlib
from typing import Any

from streamrl.errors import ConfigError
from streamrl.rollout.interactions.base import BaseInteraction

#: Short names for the interactions streamrl ships.
REGISTRY = {
    "gsm8k": "streamrl.rollout.interactions.gsm8k.Gsm8kInteraction",
}

__all__ = ["BaseInteraction", "REGISTRY", "load_interaction"]


def load_interaction(name: str, kwargs: dict[str, Any] | None = None) -> BaseInteraction:
    """The interaction ``name`` (a registered short name or ``package.module.Class``),
    constructed as verl does: ``Class(config)`` with ``config = {"name": name, **kwargs}``."""
    path = REGISTRY.get(name, name)
    module_name, _, class_name = path.rpartition(".")
    if not module_name:
        raise ConfigError(f"config field 'rollout.interaction.name': {name!r} is neither one of "
                          f"{sorted(REGISTRY)} nor a dotted path package.module.Class")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"config field 'rollout.interaction.name': cannot load {path!r}: {exc}") from None
    return cls({"name": name, **(kwargs or {})})
