"""What an episode may do beyond one answer (``rollout.multi_turn``): the interactions samples
pick by name, the tools, and verl's turn limits, loaded once from the rollout config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from streamrl.errors import Failure
from streamrl.records import Prompt
from streamrl.rollout.interactions import BaseInteraction, load_interaction, load_interaction_config
from streamrl.rollout.tools import LoadedTool, load_tool_config

if TYPE_CHECKING:
    from streamrl.rollout.config import RolloutConfig


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
