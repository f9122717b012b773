"""A calculator tool: arithmetic on numbers with ``+ - * / **`` and parentheses.

The expression is text the policy wrote, so it is never evaluated as Python: it is parsed with
``ast`` and a small evaluator walks the tree, accepting only numeric literals, the four
operators, ``**``, unary ``+``/``-`` and parentheses. A name, a call, an attribute, a string or a
subscript is refused with a message the model reads as the tool's answer. Limits keep a call
cheap whatever the model writes: the expression's length, its node count, the size of every
intermediate value (checked before a power is computed, so ``9**9**9`` is refused, not run).
"""

from __future__ import annotations

import ast
import math
import uuid
from typing import Any

from streamrl.rollout.tools.base import BaseTool
from streamrl.rollout.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

MAX_CHARS = 256  # expression length
MAX_NODES = 128  # syntax-tree nodes
MAX_MAGNITUDE = 1e100  # of any literal, intermediate value or result

SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression with numbers, + - * / ** and parentheses, "
                       "e.g. 2*(3+4)/7. Returns the value.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "the arithmetic expression"}},
            "required": ["expression"],
        },
    },
}


class CalculationError(ValueError):
    """The expression is not plain arithmetic, or breaks a limit; the message is for the model."""


_BINARY = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.Pow: "**"}


def calculate(expression: str) -> int | float:
    """The value of ``expression`` (see the module doc), or ``CalculationError``."""
    if not isinstance(expression, str):
        raise CalculationError("the expression must be a string")
    if len(expression) > MAX_CHARS:
        raise CalculationError(f"the expression is longer than {MAX_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise CalculationError("not a valid arithmetic expression") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalculationError(f"the expression has more than {MAX_NODES} parts")
    return _checked(_evaluate(tree.body))


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CalculationError(f"only numbers are allowed, not {type(value).__name__} literals")
        return _checked(value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand)
        return value if isinstance(node.op, ast.UAdd) else -value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        try:
            if isinstance(node.op, ast.Add):
                return _checked(left + right)
            if isinstance(node.op, ast.Sub):
                return _checked(left - right)
            if isinstance(node.op, ast.Mult):
                return _checked(left * right)
            if isinstance(node.op, ast.Div):
                if right == 0:
                    raise CalculationError("division by zero")
                return _checked(left / right)
            return _power(left, right)
        except OverflowError:
            raise CalculationError("the result is too large") from None
    raise CalculationError(f"only numbers, + - * / ** and parentheses are allowed (found {_describe(node)})")


def _power(base: int | float, exponent: int | float) -> int | float:
    """``base ** exponent``, refused before it is computed if the result would be too large."""
    if base == 0 and exponent < 0:
        raise CalculationError("division by zero")
    if base < 0 and not float(exponent).is_integer():
        raise CalculationError("a negative number to a fractional power is not a real number")
    if abs(base) > 1 and abs(exponent) * math.log10(abs(base)) > math.log10(MAX_MAGNITUDE):
        if exponent > 0:
            raise CalculationError("the result is too large")
        return 0.0
    if isinstance(exponent, int) and exponent < 0:
        exponent = float(exponent)
    return _checked(base ** exponent)


def _checked(value: int | float) -> int | float:
    if isinstance(value, complex) or not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
        raise CalculationError("the result is too large")
    return value


def _describe(node: ast.AST) -> str:
    names = {ast.Call: "a function call", ast.Attribute: "an attribute access", ast.Name: "a name",
             ast.Subscript: "a subscript", ast.Lambda: "a lambda", ast.Compare: "a comparison",
             ast.BoolOp: "a boolean operator"}
    for kind, text in names.items():
        if isinstance(node, kind):
            return text
    if isinstance(node, ast.BinOp):
        return f"the operator {type(node.op).__name__}"
    if isinstance(node, ast.UnaryOp):
        return f"the operator {type(node.op).__name__}"
    return type(node).__name__


def format_number(value: int | float) -> str:
    """An integer-valued result without ``.0``; others to 12 significant digits."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:.12g}"


class CalculatorTool(BaseTool):
    """verl's tool contract around ``calculate``. Stateless: ``create`` / ``release`` only hand
    out ids. Its step reward is always 0; a refused expression comes back as ``Error: ...`` text,
    which the model reads like any answer."""

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: OpenAIFunctionToolSchema | None = None):
        super().__init__(config or {}, tool_schema)

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return getattr(self, "tool_schema", None) or OpenAIFunctionToolSchema.model_validate(SCHEMA)

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> tuple[str, ToolResponse]:
        return (instance_id if instance_id is not None else str(uuid.uuid4())), ToolResponse()

    async def execute(self, instance_id: str, parameters: dict[str, Any],
                      **kwargs: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
        expression = parameters.get("expression") if isinstance(parameters, dict) else None
        if isinstance(expression, (int, float)) and not isinstance(expression, bool):
            expression = str(expression)
        if not isinstance(expression, str):
            return ToolResponse(text="Error: call calculator with {\"expression\": \"...\"}"), 0.0, {"error": 1}
        try:
            value = calculate(expression)
        except CalculationError as exc:
            return ToolResponse(text=f"Error: {exc}"), 0.0, {"error": 1}
        return ToolResponse(text=format_number(value)), 0.0, {}
