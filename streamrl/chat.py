"""Chat messages to the text the policy conditions on: the prompt (the chat template, with the
tools' schemas, or a plain ``role: content`` layout for a tokenizer without a template) and the
text of the turns that answer it, so that each turn extends the token context exactly."""

from __future__ import annotations

import json
import logging
from typing import Any

log = logging.getLogger(__name__)


def tools_preamble(tools: list[dict[str, Any]]) -> str:
    """The tools' schemas and the Hermes calling convention as text, for a tokenizer whose chat
    template does not render ``tools`` itself (and for the plain layout)."""
    schemas = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou can call the functions described below, as JSON, between <tools> and </tools>:\n"
            f"<tools>\n{schemas}\n</tools>\n\n"
            "To call one, write its name and a JSON object of arguments between <tool_call> and </tool_call>:\n"
            '<tool_call>\n{"name": <function name>, "arguments": <arguments object>}\n</tool_call>')


class ChatRenderer:
    """Chat messages to the text the policy conditions on, and the text of the turns that answer
    it (feedback, tool responses). ``tools`` (OpenAI function schemas) go to the chat template as
    ``tools=`` when the template renders them, else into the system message as text."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None) if tokenizer is not None else None
        self.template = template is not None
        texts = template.values() if isinstance(template, dict) else [template] if isinstance(template, str) else []
        self.template_tools = any("tools" in t for t in texts)
        self._warned = False

    def _with_tools(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
        if not tools or (self.template and self.template_tools):
            return messages
        preamble = tools_preamble(tools)
        if messages and messages[0].get("role") == "system":
            first = messages[0]
            return [{**first, "content": f"{first.get('content') or ''}\n\n{preamble}"}, *messages[1:]]
        return [{"role": "system", "content": preamble}, *messages]

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, generation: bool) -> str:
        extra = {"tools": tools} if tools and self.template_tools else {}
        return self.tokenizer.apply_chat_template(self._with_tools(messages, tools), add_generation_prompt=generation,
                                                  tokenize=False, **extra)

    def prompt_text(self, prompt: str | list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        if isinstance(prompt, str):
            return f"{tools_preamble(tools)}\n\n{prompt}" if tools else prompt
        if self.template:
            return self._render(prompt, tools, generation=True)
        return "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in self._with_tools(prompt, tools)) + "assistant: "

    def feedback_text(self, before: list[dict[str, Any]], answer: str, feedback: str, stopped: bool,
                      tools: list[dict[str, Any]] | None = None) -> str:
        """``turn_text`` for one user message (the interaction's feedback)."""
        return self.turn_text(before, answer, [{"role": "user", "content": feedback}], stopped, tools)

    def turn_text(self, before: list[dict[str, Any]], answer: str, new: list[dict[str, Any]], stopped: bool,
                  tools: list[dict[str, Any]] | None = None) -> str:
        """What follows the sampled answer: the end of the assistant turn (unless the policy
        already sampled it), the ``new`` messages (user feedback or tool responses), and the next
        generation prompt."""
        plain = "".join(f"\n{m['role']}: {m.get('content') or ''}" for m in new) + "\nassistant: "
        if not self.template:
            return plain
        head = self._render(before, tools, generation=True)
        answered = before + [{"role": "assistant", "content": answer}]
        with_answer = self._render(answered, tools, generation=False)
        full = self._render(answered + new, tools, generation=True)
        if with_answer.startswith(head + answer) and full.startswith(with_answer):
            closing = with_answer[len(head) + len(answer):]
            eos = self.tokenizer.eos_token or ""
            if stopped and eos and closing.startswith(eos):
                closing = closing[len(eos):]
            return closing + full[len(with_answer):]
        if not self._warned:  # e.g. a template that rewrites earlier turns
            log.warning("the chat template does not extend turn by turn; feedback and tool turns use the "
                        "plain 'role: content' layout")
            self._warned = True
        return ("" if stopped else (self.tokenizer.eos_token or "")) + plain
