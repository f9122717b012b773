"""One prompt to ``group_size`` trajectories: single turn, or multi-turn with an interaction
playing the user and tools the policy calls (verl's multi-turn rollout, ``MultiTurn``).

The policy's context is kept at token level whenever the backend has a tokenizer: the prompt is
rendered once (the chat template, with the tools' schemas when tools are configured, or a plain
``role: content`` layout for a tokenizer without one), and each turn appends the sampled
response tokens exactly as generated, then the tokens of the turn that answers it (the
interaction's feedback as a ``user`` message, or the tools' answers as ``tool`` messages). So
``prompt_ids + response_ids`` is exactly what the policy saw, the learner can recompute
log-probs on it, and ``response_mask`` is 1 on the tokens the policy sampled and 0 on what it
was given (log-prob 0 there: the learner trains only where the mask is 1). A text-only backend
(an OpenAI server) keeps the context as text; its multi-turn trajectories carry no token arrays.

After each model turn, in verl's order: tool calls in the answer (Hermes ``<tool_call>``) are
executed and answered; otherwise the sample's interaction, if it has one, judges the answer
(its score is that turn's ``score``) and either ends the episode or gives feedback; otherwise
the episode ends. Every turn is recorded in the trajectory's ``turns`` with its score, tool
calls and tool step rewards, which ``reward.turn_scores`` can fold into the reward.

All episodes of a group generate each turn together, as one batch. Before every turn the
worker's ``before_turn`` hook runs (it loads a newer policy version if there is one), so a
version can change inside an episode; the trajectory is stamped with the oldest version used.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import numpy as np
import orjson

from streamrl.errors import Failure, Unavailable
from streamrl.records import Prompt, Trajectory
from streamrl.rollout.backends import Backend, BackendUnavailable, Sample, SamplingParams
from streamrl.rollout.interactions import BaseInteraction, load_interaction, load_interaction_config
from streamrl.rollout.interactions.registry import call_compat
from streamrl.rollout.tools import LoadedTool, ToolCall, ToolCallError, load_tool_config, parse_tool_calls

if TYPE_CHECKING:
    from streamrl.rollout.config import RolloutConfig

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


@dataclass
class MultiTurn:
    """What an episode may do beyond one answer: the interactions samples pick by name, the
    tools, and verl's limits (``rollout.multi_turn``). ``every_sample`` names the one interaction
    that serves every sample (``rollout.interaction.name``, streamrl's older form)."""

    interactions: dict[str, Any] = field(default_factory=dict)
    tools: list[LoadedTool] = field(default_factory=list)
    max_assistant_turns: int = 3
    max_user_turns: int = 2
    max_parallel_calls: int = 1
    max_tool_response_length: int = 256
    tool_response_truncate_side: str = "middle"
    tool_timeout_s: float = 30.0
    tool_format: str = "hermes"
    every_sample: str | None = None

    def __post_init__(self) -> None:
        self.tool_map = {t.name: t for t in self.tools}

    @classmethod
    def from_config(cls, cfg: "RolloutConfig") -> "MultiTurn | None":
        """The rollout config's interactions and tools, loaded (a bad file, class or schema is a
        ``ConfigError`` naming the field), or None for single-turn rollouts."""
        mt, ic = cfg.multi_turn, cfg.interaction
        if not mt.enabled and not ic.name:
            return None
        interactions: dict[str, Any] = {}
        limits = (mt.max_assistant_turns, mt.max_user_turns)
        if ic.name:
            interactions = {ic.name: load_interaction(ic.name, dict(ic.kwargs))}
            limits = (ic.max_assistant_turns, ic.max_user_turns)
        if mt.interaction_config_path:
            interactions = load_interaction_config(mt.interaction_config_path)
        tools = load_tool_config(mt.tool_config_path) if mt.tool_config_path else []
        return cls(interactions=interactions, tools=tools, max_assistant_turns=limits[0], max_user_turns=limits[1],
                   max_parallel_calls=mt.max_parallel_calls, max_tool_response_length=mt.max_tool_response_length,
                   tool_response_truncate_side=mt.tool_response_truncate_side, tool_timeout_s=mt.tool_timeout_s,
                   tool_format=mt.format, every_sample=ic.name or None)

    @property
    def tool_schemas(self) -> list[dict[str, Any]] | None:
        return [t.schema for t in self.tools] or None

    def interaction_for(self, prompt: Prompt) -> tuple[str, Any, dict[str, Any]] | None:
        """``(name, interaction, kwargs)`` for ``prompt``, or None (no interaction: the sample
        carries no ``interaction_kwargs``). A name that is not configured fails the prompt
        (``Failure``: a dead letter naming the known ones)."""
        if not self.interactions:
            return None
        given = prompt.extra_info.get("interaction_kwargs")
        if given is not None and not isinstance(given, dict):
            raise Failure("bad_interaction_kwargs", f"extra_info.interaction_kwargs is a {type(given).__name__}, "
                                                    "not an object")
        if self.every_sample:
            name = self.every_sample
        elif given is None:
            return None
        else:
            name = given.get("name")
            if name is None and len(self.interactions) == 1:
                name = next(iter(self.interactions))
            if name not in self.interactions:
                raise Failure("unknown_interaction", f"extra_info.interaction_kwargs.name is {name!r}; the "
                                                     f"interaction config has {sorted(self.interactions)}")
        kwargs = dict(given or {})
        if kwargs.get("ground_truth") is None and prompt.ground_truth is not None:
            kwargs["ground_truth"] = prompt.ground_truth
        return name, self.interactions[name], kwargs


class InteractionRunner(MultiTurn):
    """One interaction for every sample, with its turn limits (the older ``rollout.interaction``
    form; kept for callers that build one by hand)."""

    def __init__(self, interaction: BaseInteraction, name: str, max_assistant_turns: int, max_user_turns: int):
        super().__init__(interactions={name: interaction}, max_assistant_turns=max_assistant_turns,
                         max_user_turns=max_user_turns, every_sample=name)
        self.interaction, self.name = interaction, name


@dataclass
class _Episode:
    index: int
    messages: list[dict[str, Any]]
    context: list[int] | str
    prompt_ids: list[int] | None
    token_level: bool
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[np.ndarray] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    arrays_ok: bool = True
    turns: list[dict[str, Any]] = field(default_factory=list)
    turn_scores: list[float] = field(default_factory=list)
    turn_info: list[dict[str, Any]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    answer: str = ""
    answer_ids: list[int] | None = None
    finish_reason: str = ""
    user_turns: int = 0
    done: bool = False
    instance_id: str | None = None
    interaction_name: str | None = None
    tools_kwargs: dict[str, Any] = field(default_factory=dict)
    tool_instances: dict[str, str] = field(default_factory=dict)
    tool_create_errors: dict[str, str] = field(default_factory=dict)
    tool_rewards: dict[str, float] = field(default_factory=dict)
    tool_calls: int = 0
    generation_s: float = 0.0
    interaction_s: float = 0.0
    tool_s: float = 0.0

    def add_sample(self, s: Sample) -> None:
        self.versions.append(s.policy_version)
        self.answer, self.finish_reason, self.answer_ids = s.text, s.finish_reason, s.response_ids
        self.turns.append({"role": "assistant", "content": s.text, "policy_version": s.policy_version})
        self.messages.append({"role": "assistant", "content": s.text})
        if s.response_ids is None or s.response_logprobs is None:
            self.arrays_ok = False
        else:
            self.response_ids += s.response_ids
            self.logprobs.append(np.asarray(s.response_logprobs, dtype=np.float32))
            self.mask += [1] * len(s.response_ids)
            if self.prompt_ids is None and s.prompt_ids is not None:
                self.prompt_ids = list(s.prompt_ids)
        if self.token_level:
            self.context = list(self.context) + list(s.response_ids or [])
        else:
            self.context = str(self.context) + s.text

    def add_turn(self, new: list[tuple[dict[str, Any], dict[str, Any]]], rendered: str, tokenizer: Any) -> None:
        """The messages that answer the last model turn (``(message, turn record)`` pairs),
        rendered as ``rendered``: given to the policy, not trained on (mask 0, log-prob 0)."""
        for message, record in new:
            self.messages.append(message)
            self.turns.append(record)
        self.user_turns += 1
        if self.token_level:
            ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
            self.context = list(self.context) + ids
            self.response_ids += ids
            self.logprobs.append(np.zeros(len(ids), dtype=np.float32))
            self.mask += [0] * len(ids)
        else:
            self.context = str(self.context) + rendered
            self.arrays_ok = False  # the new turn cannot be tokenised without a tokenizer


async def run_group(prompt: Prompt, n: int, backend: Backend, params: SamplingParams, renderer: ChatRenderer,
                    interaction: MultiTurn | None = None,
                    before_turn: Callable[[], Awaitable[None]] | None = None) -> list[Trajectory]:
    """Sample ``n`` episodes of ``prompt`` and return them as trajectories (not yet sent).
    ``interaction``: the worker's ``MultiTurn`` (or an ``InteractionRunner``); None: one turn.
    A sample that names an interaction that is not configured raises ``Failure``."""
    multi = interaction
    started_at = time.time()
    tokenizer = backend.tokenizer
    tools = multi.tool_schemas if multi is not None else None
    chosen = multi.interaction_for(prompt) if multi is not None else None
    text = renderer.prompt_text(prompt.prompt, tools)
    if tokenizer is not None:
        prompt_ids = tokenizer(text, add_special_tokens=isinstance(prompt.prompt, str))["input_ids"]
        context: list[int] | str = prompt_ids
    else:
        prompt_ids, context = None, text
    base_messages = ([{"role": "user", "content": prompt.prompt}] if isinstance(prompt.prompt, str)
                     else [dict(m) for m in prompt.prompt])
    tools_kwargs = prompt.extra_info.get("tools_kwargs") if multi is not None and multi.tools else None
    episodes = [_Episode(index=i, messages=list(base_messages), context=context,
                         prompt_ids=None if prompt_ids is None else list(prompt_ids),
                         token_level=tokenizer is not None,
                         tools_kwargs=tools_kwargs if isinstance(tools_kwargs, dict) else {}) for i in range(n)]
    max_turns = multi.max_assistant_turns if multi is not None else 1
    try:
        if chosen is not None:
            name, it, kwargs = chosen
            for e in episodes:
                e.interaction_name = name
                iid = await _guarded(name, it.start_interaction, e.uid, **kwargs)
                e.instance_id = iid if isinstance(iid, str) else e.uid
        for turn in range(max_turns):
            active = [e for e in episodes if not e.done]
            if not active:
                break
            if before_turn is not None:
                await before_turn()
            t0 = time.monotonic()
            if turn == 0:  # one prompt, n samples: let the backend share the prompt
                samples = (await backend.generate([context], n, params))[0]
            else:
                samples = [group[0] for group in await backend.generate([e.context for e in active], 1, params)]
            took = time.monotonic() - t0
            for e, s in zip(active, samples):
                e.generation_s += took
                e.add_sample(s)
                if multi is None:
                    e.done = True
            if multi is not None:
                await _answer_turn(active, multi, chosen, renderer, tokenizer, tools)
    finally:
        if multi is not None:
            await asyncio.gather(*(_finish(e, multi, chosen) for e in episodes))
    return [_trajectory(prompt, n, e, started_at, multi) for e in episodes]


async def _guarded(name: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """An interaction's method, called with what its signature takes (``call_compat``); its
    failure fails the prompt (``Failure``), its outage (``streamrl.errors.Unavailable``) holds
    it like a backend outage."""
    try:
        result = call_compat(fn, *args, **kwargs)
        return await result if inspect.isawaitable(result) else result
    except (Failure, BackendUnavailable, asyncio.CancelledError):
        raise
    except Unavailable as exc:
        raise BackendUnavailable(f"interaction {name!r}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - a user's interaction: any error fails this prompt, named
        raise Failure("interaction_error", f"interaction {name!r}: {type(exc).__name__}: {exc}") from None


async def _answer_turn(active: list[_Episode], multi: MultiTurn, chosen: tuple[str, Any, dict[str, Any]] | None,
                       renderer: ChatRenderer, tokenizer: Any, tools: list[dict[str, Any]] | None) -> None:
    """Answer each episode's latest model turn (all episodes at once: a simulated user or a tool
    may be remote) and extend the unfinished ones with the answer."""
    replies = await asyncio.gather(*(_next_turn(e, multi, chosen, tokenizer) for e in active))
    for e, new in zip(active, replies):
        if new is None:
            e.done = True
            continue
        rendered = renderer.turn_text(e.messages[:-1], e.answer, [m for m, _ in new],
                                      stopped=e.finish_reason == "stop", tools=tools)
        e.add_turn(new, rendered, tokenizer)


async def _next_turn(e: _Episode, multi: MultiTurn, chosen: tuple[str, Any, dict[str, Any]] | None,
                     tokenizer: Any) -> list[tuple[dict[str, Any], dict[str, Any]]] | None:
    """The messages that answer ``e``'s latest model turn, or None: the episode ends."""
    last = e.turns[-1]
    at_limit = len(e.versions) >= multi.max_assistant_turns or e.user_turns >= multi.max_user_turns
    if multi.tools:
        text = e.answer
        if tokenizer is not None and e.answer_ids:  # special tokens kept: some models' <tool_call> is one
            text = tokenizer.decode(e.answer_ids, skip_special_tokens=False)
        calls = parse_tool_calls(text, multi.tool_format)
        if calls:  # as verl: a turn with tool calls is answered by the tools, not the interaction
            last["tool_calls"] = [{"name": c.name, "arguments": c.arguments} if isinstance(c, ToolCall)
                                  else {"error": c.message} for c in calls]
            if at_limit:
                return None
            if len(calls) > multi.max_parallel_calls:
                last["ignored_tool_calls"] = len(calls) - multi.max_parallel_calls
            t0 = time.monotonic()
            try:
                return await _run_tools(e, calls[:multi.max_parallel_calls], multi)
            finally:
                e.tool_s += time.monotonic() - t0
    if chosen is None:
        return None
    name, it, kwargs = chosen
    t0 = time.monotonic()
    try:
        reply = await _guarded(name, it.generate_response, e.instance_id, list(e.messages), **kwargs)
    finally:
        e.interaction_s += time.monotonic() - t0
    try:
        done, response, score, info = reply
    except (TypeError, ValueError):
        raise Failure("interaction_error", f"interaction {name!r}: generate_response returned {type(reply).__name__}, "
                                           "not (should_terminate, response, score, metadata)") from None
    score = _number(score)
    if score is not None:
        last["score"] = score
        e.turn_scores.append(score)
    info = _jsonable(info if isinstance(info, dict) else {})
    e.turn_info.append(info)
    if info:
        last["info"] = info
    if done or at_limit:
        return None
    content = response if isinstance(response, str) else str(response)
    return [({"role": "user", "content": content}, {"role": "user", "content": content})]


async def _invoke(fn: Callable[..., Any], timeout: float, /, *args: Any, **kwargs: Any) -> Any:
    """A tool method, async or not, bounded by ``timeout`` (a blocking one runs in a thread)."""
    if inspect.iscoroutinefunction(fn):
        return await asyncio.wait_for(call_compat(fn, *args, **kwargs), timeout)
    result = await asyncio.wait_for(asyncio.to_thread(call_compat, fn, *args, **kwargs), timeout)
    if inspect.isawaitable(result):  # a decorated coroutine function
        result = await asyncio.wait_for(result, timeout)
    return result


def _tool_kwargs(e: _Episode, name: str, which: str) -> dict[str, Any]:
    per_tool = e.tools_kwargs.get(name)
    value = per_tool.get(which) if isinstance(per_tool, dict) else None
    return dict(value) if isinstance(value, dict) else {}


async def _create(e: _Episode, tool: LoadedTool, timeout: float) -> None:
    """The episode's instance of ``tool``, created before its first call with the sample's
    ``create_kwargs`` (as keywords, and as ``create_kwargs=`` the way verl's agent loop passes
    them: a tool takes whichever its signature names)."""
    create_kwargs = _tool_kwargs(e, tool.name, "create_kwargs")
    kwargs = {**create_kwargs}
    kwargs.setdefault("create_kwargs", create_kwargs)
    try:
        result = await _invoke(tool.tool.create, timeout, e.uid, **kwargs)
    except (Failure, asyncio.CancelledError):
        raise
    except Unavailable as exc:
        raise BackendUnavailable(f"tool {tool.name!r}: {exc}") from None
    except asyncio.TimeoutError:
        e.tool_create_errors[tool.name] = f"creating the tool timed out after {timeout:g}s"
        return
    except Exception as exc:  # noqa: BLE001 - a user's tool: any error goes back to the model
        e.tool_create_errors[tool.name] = f"{type(exc).__name__}: {exc}"
        return
    instance = result[0] if isinstance(result, tuple) and result else result
    e.tool_instances[tool.name] = instance if isinstance(instance, str) else e.uid


async def _run_tools(e: _Episode, calls: list[ToolCall | ToolCallError],
                     multi: MultiTurn) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Execute ``calls`` concurrently; each answers with one ``tool`` message. Nothing a tool
    does ends the episode: an unknown tool, bad arguments, an exception or a timeout come back
    as the message's text (``Error when executing tool: ...``, verl's wording)."""
    needed = {c.name for c in calls if isinstance(c, ToolCall) and c.name in multi.tool_map
              and c.name not in e.tool_instances and c.name not in e.tool_create_errors}
    await asyncio.gather(*(_create(e, multi.tool_map[name], multi.tool_timeout_s) for name in sorted(needed)))
    return list(await asyncio.gather(*(_call(e, c, multi) for c in calls)))


async def _call(e: _Episode, call: ToolCall | ToolCallError, multi: MultiTurn) -> tuple[dict[str, Any], dict[str, Any]]:
    record: dict[str, Any] = {"role": "tool"}
    error = None
    reward = None
    metrics: dict[str, Any] = {}
    text = ""
    if isinstance(call, ToolCallError):
        error = f"the tool call could not be read: {call.message}"
    else:
        record["name"] = call.name
        e.tool_calls += 1
        loaded = multi.tool_map.get(call.name)
        if loaded is None:
            error = f"no tool named {call.name!r} (tools: {', '.join(sorted(multi.tool_map))})"
        elif call.name in e.tool_create_errors:
            error = e.tool_create_errors[call.name]
        else:
            try:
                result = await _invoke(loaded.tool.execute, multi.tool_timeout_s, e.tool_instances[call.name],
                                       call.arguments, **_tool_kwargs(e, call.name, "execute_kwargs"))
                text, reward, metrics = _unpack_tool_result(result)
            except (Failure, asyncio.CancelledError):
                raise
            except Unavailable as exc:
                raise BackendUnavailable(f"tool {call.name!r}: {exc}") from None
            except asyncio.TimeoutError:
                error = f"timed out after {multi.tool_timeout_s:g}s"
            except Exception as exc:  # noqa: BLE001 - a user's tool: any error goes back to the model
                error = f"{type(exc).__name__}: {exc}"
    if error is not None:
        text = f"Error when executing tool: {error}"
        record["error"] = error[:1000]
    text = truncate(text, multi.max_tool_response_length, multi.tool_response_truncate_side)
    record["content"] = text
    if reward is not None:
        record["score"] = reward
    if metrics:
        record["metrics"] = metrics
    return {"role": "tool", "content": text}, record


def _unpack_tool_result(result: Any) -> tuple[str, float | None, dict[str, Any]]:
    """``execute``'s ``(response, step_reward, metrics)``: the response a ``ToolResponse``
    (verl >= 0.5), a dict with ``text`` or a string (older verl tools)."""
    if isinstance(result, tuple):
        response = result[0] if result else None
        reward = _number(result[1]) if len(result) > 1 else None
        metrics = result[2] if len(result) > 2 and isinstance(result[2], dict) else {}
    else:
        response, reward, metrics = result, None, {}
    if isinstance(response, str):
        text = response
    elif isinstance(response, dict):
        text = str(response.get("text") or "")
    elif response is None:
        text = ""
    else:
        text = str(getattr(response, "text", None) or "")
    return text, reward, _jsonable(metrics)


def truncate(text: str, limit: int, side: str) -> str:
    """verl's truncation of a tool answer to ``limit`` characters: ``left`` keeps the start,
    ``right`` the end, ``middle`` both halves."""
    if len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-limit:]
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[len(text) - half:]


def _number(value: Any) -> float | None:
    """A finite score, or None (verl skips a None turn score; NaN cannot travel in JSON)."""
    if value is None or isinstance(value, bool):
        return None if value is None else float(value)
    try:
        number = float(value)
    except (TypeError, ValueError):
        log.warning("a turn score %r is not a number: not recorded", value)
        return None
    if not math.isfinite(number):
        log.warning("a turn score %r is not finite: not recorded", value)
        return None
    return number


def _jsonable(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` as it can travel in a record: values JSON cannot carry become their repr."""
    try:
        orjson.dumps(data)
        return dict(data)
    except TypeError:
        return {str(k): (v if v is None or isinstance(v, (bool, int, float, str)) else repr(v)[:200])
                for k, v in data.items()}


async def _finish(e: _Episode, multi: MultiTurn, chosen: tuple[str, Any, dict[str, Any]] | None) -> None:
    """End the episode's tool instances (``calc_reward`` into ``tool_rewards``, then ``release``)
    and its interaction. Runs however the episode ended; failures here are logged, never raised
    over the episode's own outcome."""
    for name, instance in e.tool_instances.items():
        tool = multi.tool_map[name].tool
        if callable(getattr(tool, "calc_reward", None)):
            try:
                value = _number(await _invoke(tool.calc_reward, multi.tool_timeout_s, instance,
                                              **_tool_kwargs(e, name, "calc_reward_kwargs")))
                if value is not None:
                    e.tool_rewards[name] = value
            except Exception as exc:  # noqa: BLE001
                log.warning("tool %r: calc_reward failed: %s: %s", name, type(exc).__name__, exc)
        try:
            await _invoke(tool.release, multi.tool_timeout_s, instance, **_tool_kwargs(e, name, "release_kwargs"))
        except Exception as exc:  # noqa: BLE001
            log.warning("tool %r: release failed: %s: %s", name, type(exc).__name__, exc)
    if chosen is not None and e.instance_id is not None:
        try:
            result = call_compat(chosen[1].finalize_interaction, e.instance_id)
            if inspect.isawaitable(result):
                await result
        except Exception as exc:  # noqa: BLE001
            log.warning("interaction %r: finalize_interaction failed: %s: %s", chosen[0], type(exc).__name__, exc)


def _trajectory(prompt: Prompt, n: int, e: _Episode, started_at: float, multi: MultiTurn | None) -> Trajectory:
    extra = dict(prompt.extra_info)
    extra.update(sample_index=e.index, finish_reason=e.finish_reason)
    if multi is not None:
        extra["num_turns"] = len(e.versions)
        if e.interaction_name is not None:
            extra.update(interaction=e.interaction_name, turn_scores=e.turn_scores)
            if any(e.turn_info):
                extra["turn_info"] = e.turn_info
        if e.tool_calls:
            extra["tool_calls"] = e.tool_calls
        if e.tool_rewards:
            extra["tool_rewards"] = e.tool_rewards
    arrays = e.arrays_ok and e.prompt_ids is not None
    timings = {"generation_started_at": started_at, "generation_s": e.generation_s}
    if e.interaction_name is not None:
        timings["interaction_s"] = e.interaction_s
    if e.tool_calls:
        timings["tool_s"] = e.tool_s
    return Trajectory(
        # One id per (prompt group, sample slot): a prompt redelivered after a crash yields the
        # same ids, so the learner's de-duplication keeps each slot once.
        id=f"{prompt.group_id}-{e.index}",
        group_id=prompt.group_id, group_size=n, policy_version=min(e.versions),
        data_source=prompt.data_source, prompt=prompt.prompt, response=e.answer,
        ground_truth=prompt.ground_truth, extra_info=extra,
        prompt_ids=np.asarray(e.prompt_ids, dtype=np.int32) if arrays else None,
        response_ids=np.asarray(e.response_ids, dtype=np.int32) if arrays else None,
        response_logprobs=(np.concatenate(e.logprobs) if e.logprobs else np.zeros(0, np.float32)) if arrays else None,
        response_mask=np.asarray(e.mask, dtype=np.uint8) if arrays and multi is not None else None,
        turns=e.turns if multi is not None else None,
        timings=timings)
