"""verl's tool config files (``rollout.multi_turn.tool_config_path``), read as verl's
``tool_registry`` reads them::

    tools:
      - class_name: streamrl.rollout.tools.calculator.CalculatorTool
        config: {type: native}
        tool_schema: {type: function, function: {name: calculator, description: ..., parameters: {...}}}

Each entry becomes ``Class(config=config, tool_schema=schema)``; its name is the schema's
``function.name``. ``tool_schema`` may be left out when the class gives its own
(``get_openai_tool_schema``). ``config.type`` is ``native`` (verl's MCP tools are not supported).
Class names load as in ``streamrl.rollout.interactions.registry``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from streamrl.errors import ConfigError
from streamrl.rollout.interactions.registry import (check_methods, construct, load_class, read_entries,
                                                    resolve_config_file, verl_installed)
from streamrl.rollout.tools.schemas import OpenAIFunctionToolSchema, SchemaError

_TOOL_KEYS = {"class_name", "config", "tool_schema"}


@dataclass
class LoadedTool:
    """A tool object and the schema dict the chat template renders."""

    name: str
    tool: Any
    schema: dict[str, Any]


def _schema_class(cls: type) -> Any:
    """verl's pydantic schema for a subclass of verl's ``BaseTool`` (it reads pydantic fields),
    streamrl's otherwise."""
    if verl_installed():
        try:
            from verl.tools.base_tool import BaseTool as VerlBaseTool
            from verl.tools.schemas import OpenAIFunctionToolSchema as VerlSchema
        except Exception:  # noqa: BLE001 - a broken verl install: use streamrl's shapes
            return OpenAIFunctionToolSchema
        if issubclass(cls, VerlBaseTool):
            return VerlSchema
    return OpenAIFunctionToolSchema


def load_tool_config(path: str, field: str = "rollout.multi_turn.tool_config_path") -> list[LoadedTool]:
    """Every tool of the tool config at ``path``, in order."""
    file = resolve_config_file(path, field)
    out: list[LoadedTool] = []
    for i, entry in enumerate(read_entries(file, "tools", field)):
        where = f"{field}: {file}: tools[{i}]"
        unknown = set(entry) - _TOOL_KEYS
        if unknown:
            raise ConfigError(f"config field {where!r}: unknown keys {sorted(unknown)} (an entry has {sorted(_TOOL_KEYS)})")
        cls, defaults = load_class(entry.get("class_name", ""), f"{where}.class_name", file.parent)
        config = entry.get("config") or {}
        if not isinstance(config, dict):
            raise ConfigError(f"config field '{where}.config': must be a mapping")
        kind = config.get("type", "native")
        if kind != "native":
            raise ConfigError(f"config field '{where}.config.type': {kind!r} is not supported (native only; "
                              "verl's mcp tools need verl's MCP client manager)")
        schema = None
        if entry.get("tool_schema") is not None:
            try:
                schema = _schema_class(cls).model_validate(entry["tool_schema"])
            except (SchemaError, ValueError) as exc:
                raise ConfigError(f"config field '{where}.tool_schema': {str(exc).splitlines()[0]}") from None
        tool = construct(cls, where, config={**defaults, **config}, tool_schema=schema)
        check_methods(tool, ("create", "execute", "release"), where)
        name = getattr(tool, "name", None)
        if not isinstance(name, str) or not name:
            raise ConfigError(f"config field {where!r}: the tool has no name (tool_schema.function.name)")
        if any(t.name == name for t in out):
            raise ConfigError(f"config field {where!r}: duplicate tool name {name!r}")
        schema_dict = tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True)
        out.append(LoadedTool(name=name, tool=tool, schema=schema_dict))
    if not out:
        raise ConfigError(f"config field {field!r}: {file}: no tools")
    return out
