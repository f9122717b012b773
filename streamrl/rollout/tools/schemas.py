"""The shapes of verl's tool contract (``verl/tools/schemas.py``) without pydantic, which streamrl
does not depend on: a tool's OpenAI function schema and what ``execute`` returns.

A tool written against verl reads ``self.tool_schema.function.name`` and returns
``ToolResponse(text=...)``; these classes answer the same attributes and methods
(``model_validate``, ``model_dump``, ``is_empty``), so such a tool runs on streamrl's base
unchanged. When verl is installed, a class that subclasses verl's own ``BaseTool`` gets verl's
pydantic schema instead (``streamrl.rollout.tools.registry``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any


class SchemaError(ValueError):
    """A tool schema that is not an OpenAI function schema; the message says which part."""


class OpenAIFunctionSchema:
    """``function`` of a tool schema: ``name``, ``description``, ``parameters`` (a JSON Schema
    object, kept as given: the chat template renders it as the model should see it)."""

    def __init__(self, name: str, description: str = "", parameters: dict[str, Any] | None = None,
                 strict: bool = False, **extra: Any):
        self.name, self.description, self.strict = name, description, strict
        self.parameters = parameters if parameters is not None else {"type": "object", "properties": {},
                                                                     "required": []}
        self.extra = extra

    def model_dump(self, exclude_unset: bool = False, exclude_none: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "description": self.description,
                               "parameters": copy.deepcopy(self.parameters)}
        if self.strict or not exclude_unset:
            out["strict"] = self.strict
        out.update(copy.deepcopy(self.extra))
        return {k: v for k, v in out.items() if not (exclude_none and v is None)}


class OpenAIFunctionToolSchema:
    """One tool as the OpenAI API and chat templates describe it:
    ``{"type": "function", "function": {"name", "description", "parameters"}}``."""

    def __init__(self, type: str, function: OpenAIFunctionSchema):  # noqa: A002 - verl's field name
        self.type, self.function = type, function

    @classmethod
    def model_validate(cls, data: Any) -> "OpenAIFunctionToolSchema":
        """Check ``data`` (a dict, as a tool config's ``tool_schema``) and build the schema."""
        if isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            raise SchemaError(f"a tool schema is a mapping, got {type(data).__name__}")
        if data.get("type") != "function":
            raise SchemaError(f"tool_schema.type must be 'function', got {data.get('type')!r}")
        fn = data.get("function")
        if not isinstance(fn, dict):
            raise SchemaError("tool_schema.function must be a mapping")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise SchemaError("tool_schema.function.name must be a non-empty string")
        description = fn.get("description", "")
        if not isinstance(description, str):
            raise SchemaError("tool_schema.function.description must be a string")
        params = fn.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
            raise SchemaError("tool_schema.function.parameters must be a JSON Schema object ({type: object, ...})")
        extra = {k: v for k, v in fn.items() if k not in ("name", "description", "parameters", "strict")}
        return cls(type="function", function=OpenAIFunctionSchema(
            name=name, description=description, parameters=copy.deepcopy(params),
            strict=bool(fn.get("strict", False)), **copy.deepcopy(extra)))

    def model_dump(self, exclude_unset: bool = False, exclude_none: bool = False) -> dict[str, Any]:
        return {"type": self.type, "function": self.function.model_dump(exclude_unset, exclude_none)}


@dataclass
class ToolResponse:
    """What a tool's ``execute`` returns (verl's ``ToolResponse``). streamrl's policies are
    text-only: ``image`` / ``video`` are accepted but not shown to the model."""

    text: str | None = None
    image: list[Any] | None = None
    video: list[Any] | None = None

    def is_empty(self) -> bool:
        return not self.text and not self.image and not self.video

    def is_text_only(self) -> bool:
        return bool(self.text) and not self.image and not self.video
