"""verl's tool contract (``verl/tools/base_tool.py``), so a tool written for verl runs here
unchanged and one written here runs in verl.

One tool object serves many episodes at once, told apart by ``instance_id``. The rollout worker
drives it per episode as verl's SGLang rollout did: ``create`` before the episode's first call of
the tool (with the sample's ``tools_kwargs[name]["create_kwargs"]``), ``execute`` once per call
(``execute_kwargs``), ``calc_reward`` and ``release`` when the episode ends
(``calc_reward_kwargs``, ``release_kwargs``). ``execute`` returns ``(response, step_reward,
metrics)``; the response is a ``ToolResponse`` (verl since 0.5) or, as older verl tools return
it, a plain string.
"""

from __future__ import annotations

import uuid
from typing import Any

from streamrl.rollout.tools.schemas import OpenAIFunctionToolSchema, ToolResponse


class BaseTool:
    """A tool the policy can call. Subclass it and override ``execute`` (and ``create`` /
    ``release`` for per-episode state)."""

    def __init__(self, config: dict[str, Any], tool_schema: OpenAIFunctionToolSchema | None = None):
        self.config = config if config is not None else {}
        self.tool_schema = tool_schema or self.get_openai_tool_schema()
        if self.tool_schema is None:
            raise ValueError(f"{type(self).__name__}: no tool_schema in the tool config, and the class gives none")
        self.name: str = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema | None:
        """The schema shown to the model; a subclass may give a default here."""
        return getattr(self, "tool_schema", None)

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        """Start the tool's state for one episode; ``(instance_id, creation_response)``."""
        return (instance_id if instance_id is not None else str(uuid.uuid4())), ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
        """One call with the model's ``parameters``: ``(response, step_reward, metrics)``."""
        return ToolResponse(text="Updated the tool state."), 0.0, {}

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """The tool's reward for the whole episode (reported in ``extra_info.tool_rewards``)."""
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Drop the episode's state."""
        return None
