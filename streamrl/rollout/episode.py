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
import logging
import time
from typing import Any, Awaitable, Callable

from streamrl.chat import ChatRenderer
from streamrl.errors import Failure, Unavailable
from streamrl.records import Prompt, Trajectory
from streamrl.rollout.backends import Backend, BackendUnavailable, SamplingParams
from streamrl.rollout.episode_state import EpisodeState
from streamrl.rollout.interactions.registry import call_compat
from streamrl.rollout.multiturn import MultiTurn
from streamrl.rollout.tool_calls import finish_tools, run_tools
from streamrl.rollout.tools import ToolCall, parse_tool_calls
from streamrl.rollout.trajectory import build_trajectory, jsonable, turn_score

log = logging.getLogger(__name__)


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
    episodes = [EpisodeState(index=i, messages=list(base_messages), context=context,
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
    return [build_trajectory(prompt, n, e, started_at, multi) for e in episodes]


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


async def _answer_turn(active: list[EpisodeState], multi: MultiTurn, chosen: tuple[str, Any, dict[str, Any]] | None,
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


async def _next_turn(e: EpisodeState, multi: MultiTurn, chosen: tuple[str, Any, dict[str, Any]] | None,
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
                return await run_tools(e, calls[:multi.max_parallel_calls], multi)
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
    score = turn_score(score)
    if score is not None:
        last["score"] = score
        e.turn_scores.append(score)
    info = jsonable(info if isinstance(info, dict) else {})
    e.turn_info.append(info)
    if info:
        last["info"] = info
    if done or at_limit:
        return None
    content = response if isinstance(response, str) else str(response)
    return [({"role": "user", "content": content}, {"role": "user", "content": content})]


async def _finish(e: EpisodeState, multi: MultiTurn, chosen: tuple[str, Any, dict[str, Any]] | None) -> None:
    """End the episode's tool instances (``calc_reward`` into ``tool_rewards``, then ``release``)
    and its interaction. Runs however the episode ended; failures here are logged, never raised
    over the episode's own outcome."""
    await finish_tools(e, multi)
    if chosen is not None and e.instance_id is not None:
        try:
            result = call_compat(chosen[1].finalize_interaction, e.instance_id)
            if inspect.isawaitable(result):
                await result
        except Exception as exc:  # noqa: BLE001
            log.warning("interaction %r: finalize_interaction failed: %s: %s", chosen[0], type(exc).__name__, exc)
