"""The GSM8K feedback interaction, as verl's ``Gsm8kInteraction``: after each assistant turn it
checks the answer against the ground truth with verl's ``gsm8k`` rule; right ends the episode
with turn score 1, wrong asks again with score 0.

``config.method`` picks the extraction: ``flexible`` (the last number of the answer; streamrl's
default, kept for ``rollout.interaction.name: gsm8k``) or ``strict`` (``#### N`` only, what
verl's class uses since July 2025; the packaged ``configs/interaction_config/gsm8k.yaml`` sets
it, and verl's own config, naming verl's class, gets it when verl is not installed)."""

from __future__ import annotations

from typing import Any

from streamrl.rollout.interactions.base import BaseInteraction
from streamrl.scorers.gsm8k import verl_compute_score, verl_ground_truth

CORRECT = "Your response is correct!"
INCORRECT = "Your response is incorrect! You need to reflect on your answer and try again."
METHODS = ("flexible", "strict")


def gsm8k_score(response: str, ground_truth: str | None, method: str = "flexible") -> float:
    """A turn's score: verl's gsm8k rule with ``method`` extraction, no format score."""
    if ground_truth is None:
        return 0.0
    return float(verl_compute_score(response, verl_ground_truth(str(ground_truth)), method=method,
                                    format_score=0.0, score=1.0))


class Gsm8kInteraction(BaseInteraction):
    def __init__(self, config: dict[str, Any]):
        super().__init__(config)
        self.method: str = config.get("method", "flexible")
        if self.method not in METHODS:
            raise ValueError(f"gsm8k interaction: config.method must be one of {METHODS}, got {self.method!r}")
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

    async def calculate_score(self, instance_id: str | None = None, **kwargs: Any) -> float:
        state = self._instances[instance_id]
        return gsm8k_score(state["response"], state["ground_truth"], self.method)

    async def finalize_interaction(self, instance_id: str | None = None, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)
