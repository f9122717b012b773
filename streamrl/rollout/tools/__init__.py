"""Tools the policy calls during an episode, in verl's tool API (``verl/tools``).

A tool config file (``rollout.multi_turn.tool_config_path``) lists the tools; their OpenAI
function schemas go into the chat template (``tools=``), the model calls them in the Hermes
format (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``), and each call's answer
comes back as a ``tool`` message (not trained on: response mask 0). Shipped examples:
``calculator.CalculatorTool`` (arithmetic, parsed, never evaluated as code) and
``gsm8k.Gsm8kTool`` (verl's GSM8K answer check); ``configs/tool_config/gsm8k.yaml`` names both.
"""

from __future__ import annotations

from streamrl.rollout.tools.base import BaseTool
from streamrl.rollout.tools.parser import ToolCall, ToolCallError, parse_tool_calls
from streamrl.rollout.tools.registry import LoadedTool, load_tool_config
from streamrl.rollout.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["BaseTool", "LoadedTool", "OpenAIFunctionToolSchema", "ToolCall", "ToolCallError", "ToolResponse",
           "load_tool_config", "parse_tool_calls"]
