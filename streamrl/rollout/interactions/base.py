"""verl's ``BaseInteraction`` contract (``verl/interactions/base.py``), so its interactions and
ours are interchangeable."""

from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from typing import Any


class BaseInteraction(ABC):
    """One object serves many episodes at once, told apart by ``instance_id``."""

    def __init__(self, config: dict[str, Any]):
        self.config = config
        self.name: str = config.get("name", "interaction_agent")

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Begin an episode; ``kwargs`` carry the prompt's ``ground_truth`` and the prompt's
        ``extra_info["interaction_kwargs"]``."""
        return instance_id or str(uuid.uuid4())

    @abstractmethod
    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs: Any) -> tuple[bool, str, float, dict[str, Any]]:
        """After an assistant turn: ``(done, feedback_text, turn_score, info)``."""

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        return None
