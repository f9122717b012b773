"""One prompt to ``group_size`` trajectories: single turn, or multi-turn with an interaction
playing the user.

The policy's context is kept at token level whenever the backend has a tokenizer: the prompt is
rendered once (the chat template, or a plain ``role: content`` layout for a tokenizer without
one), and each turn appends the sampled response tokens exactly as generated, then the feedback
turn's tokens. So ``prompt_ids + response_ids`` is exactly what the policy saw, the learner can
recompute log-probs on it, and ``response_mask`` is 1 on the tokens the policy sampled and 0 on
the feedback it was given (log-prob 0 there). A text-only backend (an OpenAI server) keeps the
context as text; its multi-turn trajectories carry no token arrays.

All episodes of a group generate each turn together, as one batch. Before every turn the
worker's ``before_turn`` hook runs (it loads a newer policy version if there is one), so a
version can change inside an episode; the trajectory is stamped with the oldest version used.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import numpy as np

from streamrl.records import Prompt, Trajectory
from streamrl.rollout.backends import Backend, Sample, SamplingParams
from streamrl.rollout.interactions import BaseInteraction

log = logging.getLogger(__name__)


class ChatRenderer:
    """Chat messages to the text the policy conditions on, and the text of a feedback turn."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.template = tokenizer is not None and getattr(tokenizer, "chat_template", None) is not None
        self._warned = False

    def prompt_text(self, prompt: str | list[dict[str, Any]]) -> str:
        if isinstance(prompt, str):
            return prompt
        if self.template:
            return self.tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
        return "".join(f"{m['role']}: {m.get('content') or ''}\n" for m in prompt) + "assistant: "

    def feedback_text(self, before: list[dict[str, Any]], answer: str, feedback: str, stopped: bool) -> str:
        """What follows the sampled answer: the end of the assistant turn (unless the policy
        already sampled it), the feedback as a user turn, and the next generation prompt."""
        if not self.template:
            return f"\nuser: {feedback}\nassistant: "
        render = self.tokenizer.apply_chat_template
        head = render(before, add_generation_prompt=True, tokenize=False)
        answered = before + [{"role": "assistant", "content": answer}]
        with_answer = render(answered, tokenize=False)
        full = render(answered + [{"role": "user", "content": feedback}], add_generation_prompt=True, tokenize=False)
        if with_answer.startswith(head + answer) and full.startswith(with_answer):
            closing = with_answer[len(head) + len(answer):]
            eos = self.tokenizer.eos_token or ""
            if stopped and eos and closing.startswith(eos):
                closing = closing[len(eos):]
            return closing + full[len(with_answer):]
        if not self._warned:  # e.g. a template that rewrites earlier turns
            log.warning("the chat template does not extend turn by turn; feedback turns use the "
                        "plain 'role: content' layout")
            self._warned = True
        return ("" if stopped else (self.tokenizer.eos_token or "")) + f"\nuser: {feedback}\nassistant: "


@dataclass
class _Episode:
    index: int
    messages: list[dict[str, Any]]
    context: list[int] | str
    prompt_ids: list[int] | None
    token_level: bool
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[np.ndarray] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    arrays_ok: bool = True
    turns: list[dict[str, Any]] = field(default_factory=list)
    turn_scores: list[float] = field(default_factory=list)
    turn_info: list[dict[str, Any]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    answer: str = ""
    finish_reason: str = ""
    user_turns: int = 0
    done: bool = False
    instance_id: str | None = None
    generation_s: float = 0.0
    interaction_s: float = 0.0

    def add_sample(self, s: Sample) -> None:
        self.versions.append(s.policy_version)
        self.answer, self.finish_reason = s.text, s.finish_reason
        self.turns.append({"role": "assistant", "content": s.text})
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

    def add_feedback(self, text: str, rendered: str, tokenizer: Any) -> None:
        self.turns.append({"role": "user", "content": text})
        self.messages.append({"role": "user", "content": text})
        self.user_turns += 1
        if self.token_level:
            ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
            self.context = list(self.context) + ids
            self.response_ids += ids
            self.logprobs.append(np.zeros(len(ids), dtype=np.float32))
            self.mask += [0] * len(ids)
        else:
            self.context = str(self.context) + rendered
            self.arrays_ok = False  # feedback cannot be tokenised without a tokenizer


class InteractionRunner:
    """An interaction with its turn limits (``rollout.interaction``)."""

    def __init__(self, interaction: BaseInteraction, name: str, max_assistant_turns: int, max_user_turns: int):
        self.interaction, self.name = interaction, name
        self.max_assistant_turns, self.max_user_turns = max_assistant_turns, max_user_turns


async def run_group(prompt: Prompt, n: int, backend: Backend, params: SamplingParams, renderer: ChatRenderer,
                    interaction: InteractionRunner | None = None,
                    before_turn: Callable[[], Awaitable[None]] | None = None) -> list[Trajectory]:
    """Sample ``n`` episodes of ``prompt`` and return them as trajectories (not yet sent)."""
    started_at = time.time()
    tokenizer = backend.tokenizer
    text = renderer.prompt_text(prompt.prompt)
    if tokenizer is not None:
        prompt_ids = tokenizer(text, add_special_tokens=isinstance(prompt.prompt, str))["input_ids"]
        context: list[int] | str = prompt_ids
    else:
        prompt_ids, context = None, text
    base_messages = ([{"role": "user", "content": prompt.prompt}] if isinstance(prompt.prompt, str)
                     else [dict(m) for m in prompt.prompt])
    episodes = [_Episode(index=i, messages=list(base_messages), context=context,
                         prompt_ids=None if prompt_ids is None else list(prompt_ids),
                         token_level=tokenizer is not None) for i in range(n)]
    max_turns = interaction.max_assistant_turns if interaction else 1
    try:
        if interaction is not None:
            kwargs = {"ground_truth": prompt.ground_truth, **(prompt.extra_info.get("interaction_kwargs") or {})}
            for e in episodes:
                e.instance_id = await interaction.interaction.start_interaction(None, **kwargs)
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
                if interaction is None:
                    e.done = True
            if interaction is not None:
                await _interact(active, interaction, renderer, tokenizer)
    finally:
        if interaction is not None:
            for e in episodes:
                if e.instance_id is not None:
                    await interaction.interaction.finalize_interaction(e.instance_id)
    return [_trajectory(prompt, n, e, started_at, interaction) for e in episodes]


async def _interact(active: list[_Episode], runner: InteractionRunner, renderer: ChatRenderer, tokenizer: Any) -> None:
    """Ask the interaction about each episode's latest answer (all episodes at once: a simulated
    user may be a remote model); extend the unfinished ones with its feedback."""

    async def ask(e: _Episode) -> tuple[bool, str, float, dict[str, Any]]:
        t0 = time.monotonic()
        try:
            return await runner.interaction.generate_response(e.instance_id, e.messages)
        finally:
            e.interaction_s += time.monotonic() - t0

    replies = await asyncio.gather(*(ask(e) for e in active))
    for e, (done, feedback, score, info) in zip(active, replies):
        e.turn_scores.append(float(score))
        e.turn_info.append(dict(info or {}))
        assistant_turns = len(e.versions)
        if done or assistant_turns >= runner.max_assistant_turns or e.user_turns >= runner.max_user_turns:
            e.done = True
            continue
        rendered = renderer.feedback_text(e.messages[:-1], e.answer, feedback, stopped=e.finish_reason == "stop")
        e.add_feedback(feedback, rendered, tokenizer)


def _trajectory(prompt: Prompt, n: int, e: _Episode, started_at: float,
                interaction: InteractionRunner | None) -> Trajectory:
    extra = dict(prompt.extra_info)
    extra.update(sample_index=e.index, finish_reason=e.finish_reason)
    if interaction is not None:
        extra.update(interaction=interaction.name, num_turns=len(e.versions), turn_scores=e.turn_scores)
        if any(e.turn_info):
            extra["turn_info"] = e.turn_info
    arrays = e.arrays_ok and e.prompt_ids is not None
    timings = {"generation_started_at": started_at, "generation_s": e.generation_s}
    if interaction is not None:
        timings["interaction_s"] = e.interaction_s
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
        response_mask=np.asarray(e.mask, dtype=np.uint8) if arrays and interaction is not None else None,
        turns=e.turns if interaction is not None else None,
        timings=timings)
