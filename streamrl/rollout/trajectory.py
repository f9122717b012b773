"""An episode as a trajectory record, and the values a record can carry (a finite score;
JSON-able metadata)."""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from streamrl.records import Prompt, Trajectory
from streamrl.routing import pack as pack_routes

if TYPE_CHECKING:
    from streamrl.rollout.episode_state import EpisodeState
    from streamrl.rollout.multiturn import MultiTurn

log = logging.getLogger(__name__)


def turn_score(value: Any) -> float | None:
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


def jsonable(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` as it can travel in a record: values JSON cannot carry become their repr."""
    try:
        orjson.dumps(data)
        return dict(data)
    except TypeError:
        return {str(k): (v if v is None or isinstance(v, (bool, int, float, str)) else repr(v)[:200])
                for k, v in data.items()}


def build_trajectory(prompt: Prompt, n: int, e: EpisodeState, started_at: float, multi: MultiTurn | None) -> Trajectory:
    """The trajectory record of episode ``e`` (sample ``e.index`` of ``prompt``'s group of ``n``),
    stamped with the oldest policy version it used (and, spanning several, each token's:
    ``token_versions``); token arrays only where every turn has them."""
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
    routes = shape = None
    if arrays and e.routed_experts is not None:
        routes, shape = pack_routes(e.routed_experts)
    return Trajectory(
        # One id per (prompt group, sample slot): a prompt redelivered after a crash yields the
        # same ids, so the learner's de-duplication keeps each slot once.
        id=f"{prompt.group_id}-{e.index}",
        group_id=prompt.group_id, group_size=n, policy_version=min(e.versions),
        token_versions=e.token_versions.as_field() if arrays else None,
        data_source=prompt.data_source, prompt=prompt.prompt, response=e.answer,
        ground_truth=prompt.ground_truth, extra_info=extra,
        prompt_ids=np.asarray(e.prompt_ids, dtype=np.int32) if arrays else None,
        response_ids=np.asarray(e.response_ids, dtype=np.int32) if arrays else None,
        response_logprobs=(np.concatenate(e.logprobs) if e.logprobs else np.zeros(0, np.float32)) if arrays else None,
        response_mask=np.asarray(e.mask, dtype=np.uint8) if arrays and multi is not None else None,
        routed_experts=routes, routed_experts_shape=shape,
        turns=e.turns if multi is not None else None,
        timings=timings)
