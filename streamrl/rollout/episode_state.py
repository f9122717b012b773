"""An episode's state (``EpisodeState``): what ``episode``, ``tool_calls`` and ``trajectory``
work on, in a module of its own below the three (no import runs back up to the turn loop)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from streamrl.records import VersionRuns
from streamrl.rollout.backends import Completion


@dataclass
class EpisodeState:
    """One sample's episode as it goes: the conversation so far (``messages``, the policy's
    ``context`` in tokens or text), the response's token ids, behaviour log-probs and mask (1 on
    sampled tokens, 0 on what the policy was given), each turn's record and score, its tool
    instances and calls, the versions that generated it and the time spent per part. The turn
    loop (``episode``) drives it, ``tool_calls`` runs its tools and ``trajectory`` turns it into
    the record: three modules over one concept, which lives here, below them."""

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
    versions: list[int] = field(default_factory=list)  # each model turn's oldest version
    token_versions: VersionRuns = field(default_factory=lambda: VersionRuns([]))  # over response_ids
    answer: str = ""
    answer_ids: list[int] | None = None
    finish_reason: str = ""
    # MoE router replay: the last model turn's routing, which covers every token fed before its
    # last one (each turn's request holds the whole context); None: not recorded
    routed_experts: np.ndarray | None = None
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

    def add_sample(self, s: Completion) -> None:
        runs = s.version_runs()
        self.versions.append(runs.oldest)
        for version, n in runs.runs:
            self.token_versions.extend(version, n)
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
            self.routed_experts = s.routed_experts
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
            self.token_versions.extend(self.versions[-1] if not self.token_versions.runs  # given, not sampled:
                                       else self.token_versions.runs[-1][0], len(ids))  # the version before
            self.logprobs.append(np.zeros(len(ids), dtype=np.float32))
            self.mask += [0] * len(ids)
        else:
            self.context = str(self.context) + rendered
            self.arrays_ok = False  # the new turn cannot be tokenised without a tokenizer
