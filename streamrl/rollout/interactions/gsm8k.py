"""The GSM8K feedback interaction, as verl's ``Gsm8kInteraction``: after each assistant turn it
checks the last number of the answer against the ground truth (verl's ``gsm8k`` rule,
``flexible`` extraction); right ends the episode with turn score 1, wrong asks again with
score 0."""

from __future__ import annotations

import re
from typing import Any

from streamrl.rollout.interactions.base import BaseInteraction

CORRECT = "Your response is correct!"
INCORRECT = "Your response is incorrect! You need to reflect on your answer and try again."

_NUMBER = re.compile(r"(\-?[0-9\.\,]+)")
_CLIP_CHARS = 300  # verl scores only the tail: regexes on very long strings are slow


def last_number(text: str) -> str | None:
    """verl's ``extract_solution(method="flexible")``: the last number in the last 300
    characters (a lone ``.`` or empty match does not count)."""
    for candidate in reversed(_NUMBER.findall(text[-_CLIP_CHARS:])):
        if candidate not in ("", "."):
            return candidate
    return None


def gsm8k_score(response: str, ground_truth: str | None) -> float:
    answer = last_number(response)
    return 1.0 if answer is not None and answer == ground_truth else 0.0


class Gsm8kInteraction(BaseInteraction):
    def __init__(self, config: dict[str, Any]):
        super().__init__(config)
        self._instances: dict[str, dict[str, Any]] = {}

    async def start_interaction(self, instance_id: str | None = None, ground_truth: str | None = None,
                                **kwargs: Any) -> str:
        instance_id = await super().start_interaction(instance_id)
        self._instances[instance_id] = {"response": "", "ground_truth": ground_truth}
        return instance_id

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]],
                                **kwargs: Any) -> tuple[bool, str, float, dict[str, Any]]:
        content = next((m.get("content") or "" for m in reversed(messages) if m.get("role") == "assistant"), "")
        self._instances[instance_id]["response"] = content
        score = await self.calculate_score(instance_id)
        if score == 1.0:
            return True, CORRECT, score, {}
        return False, INCORRECT, score, {}

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        state = self._instances[instance_id]
        return gsm8k_score(state["response"], state["ground_truth"])

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)
