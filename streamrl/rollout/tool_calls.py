"""The tool calls of one episode, as verl's agent loop makes them: each tool's instance is
created before its first call, the calls of a turn run concurrently, each within the tool
timeout, and each is answered with one ``tool`` message; at the episode's end the instances
give their reward (``calc_reward``) and are released. Nothing a tool does ends the episode:
its errors go back to the model as text; only its outage (``Unavailable``) holds the prompt."""

from __future__ import annotations

import asyncio
import inspect
import logging
from typing import TYPE_CHECKING, Any, Callable

from streamrl.errors import Failure, Unavailable
from streamrl.rollout.backends import BackendUnavailable
from streamrl.rollout.interactions.registry import call_compat
from streamrl.rollout.tools import LoadedTool, ToolCall, ToolCallError
from streamrl.rollout.trajectory import jsonable, turn_score

if TYPE_CHECKING:
    from streamrl.rollout.episode_state import EpisodeState
    from streamrl.rollout.multiturn import MultiTurn

log = logging.getLogger(__name__)


async def _invoke(fn: Callable[..., Any], timeout: float, /, *args: Any, **kwargs: Any) -> Any:
    """A tool method, async or not, bounded by ``timeout`` (a blocking one runs in a thread)."""
    if inspect.iscoroutinefunction(fn):
        return await asyncio.wait_for(call_compat(fn, *args, **kwargs), timeout)
    result = await asyncio.wait_for(asyncio.to_thread(call_compat, fn, *args, **kwargs), timeout)
    if inspect.isawaitable(result):  # a decorated coroutine function
        result = await asyncio.wait_for(result, timeout)
    return result


def _tool_kwargs(e: EpisodeState, name: str, which: str) -> dict[str, Any]:
    per_tool = e.tools_kwargs.get(name)
    value = per_tool.get(which) if isinstance(per_tool, dict) else None
    return dict(value) if isinstance(value, dict) else {}


async def _create(e: EpisodeState, tool: LoadedTool, timeout: float) -> None:
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


async def run_tools(e: EpisodeState, calls: list[ToolCall | ToolCallError],
                     multi: MultiTurn) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Execute ``calls`` concurrently; each answers with one ``tool`` message. Nothing a tool
    does ends the episode: an unknown tool, bad arguments, an exception or a timeout come back
    as the message's text (``Error when executing tool: ...``, verl's wording)."""
    needed = {c.name for c in calls if isinstance(c, ToolCall) and c.name in multi.tool_map
              and c.name not in e.tool_instances and c.name not in e.tool_create_errors}
    await asyncio.gather(*(_create(e, multi.tool_map[name], multi.tool_timeout_s) for name in sorted(needed)))
    return list(await asyncio.gather(*(_call(e, c, multi) for c in calls)))


async def _call(e: EpisodeState, call: ToolCall | ToolCallError, multi: MultiTurn) -> tuple[dict[str, Any], dict[str, Any]]:
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
        reward = turn_score(result[1]) if len(result) > 1 else None
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
    return text, reward, jsonable(metrics)


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


async def finish_tools(e: EpisodeState, multi: MultiTurn) -> None:
    """End the episode's tool instances: ``calc_reward`` into ``tool_rewards``, then ``release``.
    Failures here are logged, never raised over the episode's own outcome."""
    for name, instance in e.tool_instances.items():
        tool = multi.tool_map[name].tool
        if callable(getattr(tool, "calc_reward", None)):
            try:
                value = turn_score(await _invoke(tool.calc_reward, multi.tool_timeout_s, instance,
                                                 **_tool_kwargs(e, name, "calc_reward_kwargs")))
                if value is not None:
                    e.tool_rewards[name] = value
            except Exception as exc:  # noqa: BLE001
                log.warning("tool %r: calc_reward failed: %s: %s", name, type(exc).__name__, exc)
        try:
            await _invoke(tool.release, multi.tool_timeout_s, instance, **_tool_kwargs(e, name, "release_kwargs"))
        except Exception as exc:  # noqa: BLE001
            log.warning("tool %r: release failed: %s: %s", name, type(exc).__name__, exc)
