"""verl's GSM8K answer-check tool (``verl/tools/gsm8k_tool.py``), on streamrl's gsm8k rule.

The model submits an answer (``{"answer": "72"}``) and reads back whether it parses as right:
the rule is verl's gsm8k score, ``flexible`` extraction, on ``#### <answer>``. Each call's step
reward is 0 when the answer scores better than the episode's previous submission and -0.05
otherwise (verl's penalty for resubmitting without improving); ``calc_reward`` is the latest
submission's score. The ground truth comes from the sample's
``tools_kwargs.calc_gsm8k_reward.create_kwargs.ground_truth``, as verl's preprocessing writes it.
"""

from __future__ import annotations

import uuid
from typing import Any

from streamrl.rollout.tools.base import BaseTool
from streamrl.rollout.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from streamrl.scorers.gsm8k import verl_compute_score, verl_ground_truth

NO_IMPROVEMENT_PENALTY = -0.05

SCHEMA = {
    "type": "function",
    "function": {
        "name": "calc_gsm8k_reward",
        "description": "A tool for calculating the reward of gsm8k. (1.0 if parsed answer is correct, "
                       "0.0 if parsed answer is incorrect or not correctly parsed)",
        "parameters": {
            "type": "object",
            "properties": {"answer": {"type": "string",
                                      "description": "The model's answer to the GSM8K math problem, must be a digits"}},
            "required": ["answer"],
        },
    },
}


class Gsm8kTool(BaseTool):
    def __init__(self, config: dict[str, Any] | None = None, tool_schema: OpenAIFunctionToolSchema | None = None):
        super().__init__(config or {}, tool_schema)
        self.method: str = self.config.get("method", "flexible")
        self._instances: dict[str, dict[str, Any]] = {}

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return getattr(self, "tool_schema", None) or OpenAIFunctionToolSchema.model_validate(SCHEMA)

    async def create(self, instance_id: str | None = None, ground_truth: str | None = None,
                     **kwargs: Any) -> tuple[str, ToolResponse]:
        """``ground_truth`` as a keyword (the per-episode form) or inside ``create_kwargs`` (verl's
        agent loop passes it that way)."""
        if instance_id is None:
            instance_id = str(uuid.uuid4())
        if ground_truth is None:
            ground_truth = (kwargs.get("create_kwargs") or {}).get("ground_truth")
        self._instances[instance_id] = {"answer": "", "ground_truth": ground_truth, "reward": 0.0}
        return instance_id, ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
        state = self._instances[instance_id]
        answer = parameters.get("answer", "") if isinstance(parameters, dict) else ""
        answer = answer if isinstance(answer, str) else str(answer)
        state["answer"] = answer if answer.startswith("#### ") else "#### " + answer
        reward = await self.calc_reward(instance_id)
        step = 0.0 if reward > state["reward"] else NO_IMPROVEMENT_PENALTY
        state["reward"] = reward
        return ToolResponse(text=f"Current parsed answer={answer!r} reward={reward}"), step, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        state = self._instances[instance_id]
        if state["ground_truth"] is None:
            return 0.0
        return float(verl_compute_score(state["answer"], verl_ground_truth(str(state["ground_truth"])),
                                        method=self.method, format_score=0.0, score=1.0))

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self._instances.pop(instance_id, None)
