"""verl's ``BaseInteraction`` (``verl/interactions/base.py``): the same methods, arguments and
defaults, so an interaction written for verl subclasses this one unchanged (or verl's own, when
verl is installed: streamrl only calls the methods, it never checks the base class)."""

from __future__ import annotations

import uuid
from typing import Any


class BaseInteraction:
    """Plays the user in a multi-turn episode. One object serves many episodes at once, told
    apart by ``instance_id``. Built as verl builds it: ``Class(config=...)`` with the entry's
    ``config`` plus its ``name``."""

    def __init__(self, config: dict[str, Any]):
        self.config = config
        self.name: str = config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Begin an episode. ``kwargs`` are the sample's ``extra_info.interaction_kwargs``
        (``name``, ``query``, ``ground_truth``, ...); streamrl adds the prompt's
        ``ground_truth`` when they carry none."""
        return instance_id if instance_id is not None else str(uuid.uuid4())

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs: Any) -> tuple[bool, str, float, dict[str, Any]]:
        """After an assistant turn: ``(should_terminate, response, turn_score, metadata)``.
        ``messages`` is the conversation so far; ``kwargs`` the sample's interaction_kwargs.
        This default (verl's) accepts every answer as acceptable, score 0.8."""
        return False, "Your current result seems acceptable.", 0.8, {}

    async def calculate_score(self, instance_id: str | None = None, **kwargs: Any) -> float:
        """The interaction's own score of an episode; called by the interaction itself (neither
        verl's loops nor streamrl's call it)."""
        return 0.0

    async def finalize_interaction(self, instance_id: str | None = None, **kwargs: Any) -> None:
        """The episode is over: release its state."""
        return None
