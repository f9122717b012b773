"""Scoring without the bus: a trajectory in, a ``Rewarded`` record or a ``Failure`` out.

The reward stage, replay and ``streamrl.testing`` all score through ``Scoring``, so they share
one path:

1. look the record's ``data_source`` up in the scorer table (``reward.table``); none serves it:
   ``Failure("unknown_data_source")``;
   A record that carries ``reward_score`` (an agent loop's own reward) is not scored: that is
   its reward (``reward_info.status = "given"``, ``scorer`` ``reward_score``), under the bounds;
2. score it. A failing scorer (``Failure`` or any exception) is retried ``max_attempts`` times
   with backoff, then fails with its reason, unless the config allows a fallback score for that
   reason (``reward_info.status = "fallback:<reason>"``). A scorer whose backend is down
   (``Unavailable``) is retried without end: the record is held (the stage's loop stops
   fetching once ``max_in_flight`` records are held). An outage is never scored 0;
3. a NaN or infinite reward (in fp32) is never published: ``Failure("non_finite_reward")``, nor
   one beyond ``reward.max_abs_reward``: ``Failure("reward_out_of_range")``;
   With ``reward.turn_scores`` a multi-turn record's reward is the scorer's plus ``weight *
   reduce(turn scores)`` (``reward_info.turn_reward``), under the same two bounds;
4. with a group hook, wait for the rest of the group (``groups.GroupCollector``);
5. a ``Rewarded`` with the fp32 reward, ``reward_info`` (the scorer's extra fields and
   ``status``) and ``scorer`` {name, version}.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import numpy as np
from tenacity import (
    AsyncRetrying,
    retry_if_exception_type,
    retry_if_not_exception_type,
    stop_after_attempt,
    wait_exponential_jitter,
)

from streamrl import metrics
from streamrl.errors import Failure, Unavailable
from streamrl.records import Rewarded, Trajectory
from streamrl.reward.bounds import check_reward
from streamrl.reward.config import GroupHookConfig, OverlongBufferConfig, RewardConfig, TurnScoresConfig
from streamrl.reward.groups import GroupCollector, post_process_hook
from streamrl.reward.table import Entry, ScorerTable, build_table
from streamrl.scorers.base import numeric_info, split_result

log = logging.getLogger(__name__)


#: the ``scorer`` of a record published with its producer's own reward (``reward_score``)
GIVEN = {"name": "reward_score", "version": "given"}


class _BadValue(Failure):
    """A scorer returned NaN / inf in fp32, or a reward past ``reward.max_abs_reward``: not worth
    a retry, never worth publishing (the learner's advantages would be NaN)."""


class Scoring:
    """The reward config's scorer table and group hook, with the stage's retries, holds and
    fallbacks. Built from a config (a bad one raises ``ConfigError`` naming the field);
    ``await start()`` before scoring, ``await close()`` after. ``group_hook=False`` leaves the
    hook out (replay compares scorers, not adjusted rewards)."""

    def __init__(self, rc: RewardConfig, group_hook: bool = True):
        self.rc = rc.validate()
        self.table: ScorerTable = build_table(rc)
        self.groups = GroupCollector(rc.group_hook) if group_hook and rc.group_hook.function else None
        # a reward class's post_process_scores is the group hook of its own entry
        self.hooks = {e.name: GroupCollector(GroupHookConfig(function=f"{e.name}.post_process_scores",
                                                             timeout_s=rc.group_hook.timeout_s),
                                             post_process_hook(e.post_process))
                      for e in self.table.entries.values() if group_hook and e.post_process is not None}

    async def start(self) -> None:
        await self.table.start()

    async def close(self) -> None:
        await self.table.close()

    def entry_for(self, traj: Trajectory) -> Entry:
        """The entry that serves ``traj``'s data source, or ``Failure("unknown_data_source")``."""
        entry = self.table.lookup(traj.data_source)
        if entry is None:
            known = ", ".join(sorted(self.table.routes)[:20])
            raise Failure("unknown_data_source", f"no scorer serves data_source {traj.data_source!r} (known: {known})")
        return entry

    async def reward(self, traj: Trajectory) -> Rewarded:
        """``traj`` scored (and settled with its group, under a hook), or a ``Failure``."""
        if traj.reward_score is not None:
            return await self._given(traj)
        entry = None
        try:
            entry = self.entry_for(traj)
            reward, info = await self.score(entry, traj)
        except Failure as exc:
            metrics.REWARD_FAILED.labels(entry.name if entry else "", exc.reason).inc()
            hook = self.hooks.get(entry.name, self.groups) if entry else self.groups
            if hook is not None:
                await hook.failed(traj)
            raise
        metrics.REWARD_SCORED.labels(entry.name, info["status"]).inc()
        metrics.REWARD_VALUE.labels(entry.name).observe(reward)
        observe_info(traj.data_source, info)
        rewarded = Rewarded.from_trajectory(traj, reward=reward, reward_info=info, scorer=entry.label)
        hook = self.hooks.get(entry.name, self.groups)
        if hook is not None and hook.applies(traj):
            rewarded = await hook.settle(rewarded)
        return rewarded

    async def _given(self, traj: Trajectory) -> Rewarded:
        """A record that carries its producer's reward (``reward_score``: an agent loop scored its
        own episode) is published with it, unscored, as verl's reward loop returns a sample's
        ``rm_scores`` without calling the reward function; the same bounds hold, and the group
        hook (``reward.group_hook``) still settles its group."""
        try:
            check_reward(traj.reward_score, self.rc.max_abs_reward, "reward.max_abs_reward",
                         what=f"reward_score {traj.reward_score!r}")
        except Failure as exc:
            metrics.REWARD_FAILED.labels(GIVEN["name"], exc.reason).inc()
            if self.groups is not None:
                await self.groups.failed(traj)
            raise
        metrics.REWARD_SCORED.labels(GIVEN["name"], "given").inc()
        metrics.REWARD_VALUE.labels(GIVEN["name"]).observe(traj.reward_score)
        rewarded = Rewarded.from_trajectory(traj, reward=traj.reward_score, reward_info={"status": "given"},
                                            scorer=dict(GIVEN))
        if self.groups is not None and self.groups.applies(traj):
            rewarded = await self.groups.settle(rewarded)
        return rewarded

    async def score(self, entry: Entry, traj: Trajectory) -> tuple[float, dict[str, Any]]:
        """The record's reward and ``reward_info``, or ``Failure``. Holds (retries
        without end) while the scorer is unavailable."""
        rc = self.rc
        held = False

        def on_hold(state: Any) -> None:
            nonlocal held
            metrics.REWARD_UNAVAILABLE.labels(entry.name).inc()
            if not held:
                held = True
                metrics.REWARD_HELD.labels(entry.name).inc()
            # once per record at warning level: an outage holds up to max_in_flight records
            log.log(logging.WARNING if state.attempt_number == 1 else logging.DEBUG,
                    "%s unavailable (%s): holding record %s, try %d", entry.name,
                    state.outcome.exception(), traj.id, state.attempt_number)

        hold = AsyncRetrying(
            retry=retry_if_exception_type(Unavailable), reraise=True, before_sleep=on_hold,
            wait=wait_exponential_jitter(multiplier=rc.retry_backoff_s, max=rc.unavailable_backoff_max_s,
                                      jitter=rc.retry_backoff_s))
        try:
            async for attempt in hold:
                with attempt:
                    reward, info = await self._score_bounded(entry, traj)
                    return self._with_turn_reward(traj, reward, info)
        finally:
            if held:
                metrics.REWARD_HELD.labels(entry.name).dec()
        raise AssertionError("unreachable")

    def _with_turn_reward(self, traj: Trajectory, reward: float, info: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        """``reward`` plus ``reward.turn_scores``' reduction of the record's turn scores, checked
        against the same bounds as a scorer's reward."""
        cfg = self.rc.turn_scores
        if cfg.reducer == "none":
            return reward, info
        scores = turn_scores(traj)
        if scores is None:  # no transcript: a single-turn or text-only record
            return reward, info
        reduced = reduce_turn_scores(scores, cfg)
        added = cfg.weight * reduced
        total = reward + added
        info.update(turn_reward=added, turn_scores={"reducer": cfg.reducer, "weight": cfg.weight, "scores": scores,
                                                    "reduced": reduced, "scorer_reward": reward})
        if cfg.reducer == "discounted":
            info["turn_scores"]["gamma"] = cfg.gamma
        check_reward(total, self.rc.max_abs_reward, "reward.max_abs_reward",
                     what=f"reward {reward!r} + turn reward {added!r}")
        return total, info

    async def _score_bounded(self, entry: Entry, traj: Trajectory) -> tuple[float, dict[str, Any]]:
        rc = self.rc
        tries = 0

        def count(state: Any) -> None:
            exc = state.outcome.exception()
            log.warning("%s failed on %s (%s: %s); retry %d of %d", entry.name, traj.id,
                        type(exc).__name__, exc, state.attempt_number, rc.max_attempts - 1)

        retrying = AsyncRetrying(
            stop=stop_after_attempt(rc.max_attempts), reraise=True, before_sleep=count,
            retry=retry_if_not_exception_type((Unavailable, _BadValue, asyncio.CancelledError)),
            wait=wait_exponential_jitter(multiplier=rc.retry_backoff_s, max=10.0, jitter=rc.retry_backoff_s))
        try:
            async for attempt in retrying:
                with attempt:
                    tries += 1
                    score, extras = await self._score_once(entry, traj)
        except (Unavailable, asyncio.CancelledError):
            raise
        except _BadValue as exc:
            raise Failure(exc.reason, f"{entry.name}: {exc.detail}") from None
        except Exception as exc:  # noqa: BLE001 - every scorer failure ends here, named
            reason = exc.reason if isinstance(exc, Failure) else "scorer_error"
            detail = exc.detail if isinstance(exc, Failure) else f"{type(exc).__name__}: {exc}"
            if reason in entry.fallbacks:
                score = entry.fallbacks[reason]
                return float(np.float32(score)), {"status": f"fallback:{reason}", "error": detail[:500],
                                                  "attempts": tries}
            raise Failure(reason, f"{entry.name}: {detail} (after {tries} attempts)") from None
        info = {**extras, "status": "ok"}
        if tries > 1:
            info["attempts"] = tries
        if entry.overlong.enable:
            score = overlong_penalty(entry.overlong, traj, score, info)
        return score, info

    async def _score_once(self, entry: Entry, traj: Trajectory) -> tuple[float, dict[str, Any]]:
        started = time.monotonic()
        try:
            extra = {"record": traj} if getattr(entry.scorer, "wants_record", False) else {}  # a reward manager
            result = await entry.scorer(traj.data_source, traj.response, traj.ground_truth,
                                        traj.extra_info, prompt=traj.prompt, **extra)
            score, extras = split_result(result, entry.name)
        except Unavailable:
            raise
        except Exception as exc:
            reason = exc.reason if isinstance(exc, Failure) else "scorer_error"
            metrics.REWARD_ATTEMPT_ERRORS.labels(entry.name, reason).inc()
            raise
        metrics.REWARD_SCORE_SECONDS.labels(entry.name).observe(time.monotonic() - started)
        try:
            check_reward(score, self.rc.max_abs_reward, "reward.max_abs_reward", error=_BadValue)
        except _BadValue as bad:
            metrics.REWARD_ATTEMPT_ERRORS.labels(entry.name, bad.reason).inc()
            raise
        return score, extras


_info_series: set[tuple[str, str]] = set()


def observe_info(data_source: str, info: dict[str, Any]) -> None:
    """``streamrl_reward_info{data_source, field}``, for at most ``REWARD_INFO_MAX_SERIES``
    pairs in this process (a scorer that returns ever new keys cannot grow the registry)."""
    for key, value in numeric_info(info).items():
        pair = (data_source, key)
        if pair not in _info_series:
            if len(_info_series) >= metrics.REWARD_INFO_MAX_SERIES:
                continue
            _info_series.add(pair)
        metrics.REWARD_INFO.labels(data_source, key).observe(value)


def overlong_penalty(cfg: OverlongBufferConfig, traj: Trajectory, score: float, info: dict[str, Any]) -> float:
    """DAPO's soft overlong punishment on ``score`` (``OverlongBufferConfig``), recording
    ``acc`` (the scorer's own score, unless it gave one), ``overlong_reward`` and ``overlong`` in
    ``info`` as verl's DAPO reward manager does."""
    if traj.response_ids is None:
        raise Failure("no_response_ids", "overlong_buffer counts response tokens: the record has no response_ids")
    exceed = len(traj.array("response_ids")) - (cfg.max_resp_len - cfg.len)
    penalty = min(-exceed / cfg.len * cfg.penalty_factor, 0.0)
    info.setdefault("acc", score)
    info.update(overlong_reward=penalty, overlong=penalty < 0)
    return score + penalty


def turn_scores(traj: Trajectory) -> list[float] | None:
    """The per-turn scores of a multi-turn record, in transcript order: every ``turns[i].score``
    (the interaction's score of an answer, a tool call's step reward). A record written before
    turns carried scores gives its ``extra_info.turn_scores``. None: the record has no turns."""
    if not traj.turns:
        return None
    scores = [float(t["score"]) for t in traj.turns
              if isinstance(t, dict) and isinstance(t.get("score"), (int, float)) and not isinstance(t["score"], bool)]
    if not scores and not any(isinstance(t, dict) and "score" in t for t in traj.turns):
        legacy = (traj.extra_info or {}).get("turn_scores")
        if isinstance(legacy, list):
            scores = [float(x) for x in legacy if isinstance(x, (int, float)) and not isinstance(x, bool)]
    return scores


def reduce_turn_scores(scores: list[float], cfg: TurnScoresConfig) -> float:
    """One number from a record's turn scores (``TurnScoresConfig``); 0 when there are none."""
    if not scores:
        return 0.0
    if cfg.reducer == "last":
        return scores[-1]
    if cfg.reducer == "sum":
        return float(sum(scores))
    if cfg.reducer == "mean":
        return float(sum(scores) / len(scores))
    if cfg.reducer == "max":
        return max(scores)
    if cfg.reducer == "discounted":
        return float(sum(cfg.gamma ** t * s for t, s in enumerate(scores)))
    raise ValueError(f"turn score reducer {cfg.reducer!r}")
