"""Tool calls in the model's text, in the Hermes format verl parses by default
(``rollout.multi_turn.format: hermes``; Qwen2.5/3 and most open chat models are trained on it)::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2*(3+4)/7"}}
    </tool_call>

Each block is JSON read with ``json.loads`` (data, never code). A block that is not a JSON
object with a string ``name`` and an object ``arguments`` (a JSON string holding an object is
accepted, as some models write it) becomes a ``ToolCallError``: the episode returns it to the
model as a tool message instead of dropping it silently.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

FORMATS = ("hermes",)

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_MAX_CALL_CHARS = 65536  # one block; a longer one is refused, not parsed


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass
class ToolCallError:
    """A ``<tool_call>`` block that could not be read; ``message`` is for the model."""

    message: str
    raw: str = ""


def parse_tool_calls(text: str, fmt: str = "hermes") -> list[ToolCall | ToolCallError]:
    """The tool calls in ``text``, in order (an empty list: the model called no tool)."""
    if fmt not in FORMATS:
        raise ValueError(f"tool call format {fmt!r} is not one of {FORMATS}")
    if "<tool_call>" not in text:
        return []
    out: list[ToolCall | ToolCallError] = []
    for block in _HERMES.findall(text):
        raw = block.strip()
        if len(raw) > _MAX_CALL_CHARS:
            out.append(ToolCallError(f"the tool call is longer than {_MAX_CALL_CHARS} characters", raw[:200]))
            continue
        try:
            obj = json.loads(raw)
        except (json.JSONDecodeError, RecursionError) as exc:
            out.append(ToolCallError(f"the tool call is not valid JSON ({exc})", raw[:200]))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            out.append(ToolCallError('a tool call is {"name": <tool name>, "arguments": {...}}', raw[:200]))
            continue
        args = obj.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (json.JSONDecodeError, RecursionError):
                out.append(ToolCallError(f"the arguments of {obj['name']!r} are not valid JSON", raw[:200]))
                continue
        if args is None:
            args = {}
        if not isinstance(args, dict):
            out.append(ToolCallError(f"the arguments of {obj['name']!r} must be a JSON object", raw[:200]))
            continue
        out.append(ToolCall(name=obj["name"], arguments=args))
    return out
