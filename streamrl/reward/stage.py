"""The reward stage: one member of the consumer group on ``rollouts`` that scores each
trajectory and publishes it to ``rewarded``.

The bus's ``StageLoop`` owns consuming, concurrency, back-pressure and commits (an offset is
committed only after the record's output is acknowledged); this module supplies ``handle``:

1. look the record's ``data_source`` up in the scorer table; none serves it: dead letter
   ``unknown_data_source``;
2. score it. A failing scorer (``ScoreError`` or any exception) is retried ``max_attempts``
   times with backoff, then the record is dead-lettered with the reason, unless the config
   allows a fallback score for that reason (``reward_info.status = "fallback:<reason>"``). A
   scorer whose backend is down (``ScorerUnavailable``) is retried without end: the record is
   held and, once ``max_in_flight`` records are held, the member stops fetching. An outage is
   never scored 0;
3. a NaN or infinite reward (in fp32) is never published: dead letter ``non_finite_reward``;
4. with a group hook, wait for the rest of the group (``groups.GroupCollector``);
5. publish a ``Rewarded`` with the fp32 reward, ``reward_info`` (the scorer's extra fields and
   ``status``) and ``scorer`` {name, version}.

A crash redelivers whatever was not committed; duplicates are allowed (the learner
de-duplicates by ``id``).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import numpy as np
from tenacity import (AsyncRetrying, retry_if_exception_type, retry_if_not_exception_type,
                      stop_after_attempt, wait_exponential_jitter)

from streamrl import metrics
from streamrl.bus import Bus, DeadLetterError, Message, StageLoop, TopicPartition
from streamrl.config import ConfigError, PipelineConfig
from streamrl.records import Rewarded, Trajectory
from streamrl.scorers import Entry, ScorerTable, build_table, split_result
from streamrl.scorers.base import ScoreError, ScorerUnavailable

log = logging.getLogger(__name__)

STAGE = "reward"
SOURCE = "rollouts"
SINK = "rewarded"


class _NonFinite(Exception):
    """A scorer returned NaN / inf: not worth a retry, never worth publishing."""


class RewardStage:
    """Build with a config (the scorer table is checked here: a bad config raises
    ``ConfigError`` before anything connects), then ``await run(stop_event)``."""

    def __init__(self, cfg: PipelineConfig, bus: Bus | None = None):
        rc = cfg.reward
        for name in ("max_in_flight", "max_attempts"):
            if getattr(rc, name) < 1:
                raise ConfigError(f"config field 'reward.{name}': must be at least 1")
        self.cfg, self.rc = cfg, rc
        self.table: ScorerTable = build_table(rc)
        self.groups = None
        if rc.group_hook.function:
            from streamrl.reward.groups import GroupCollector

            self.groups = GroupCollector(rc.group_hook)
        self.bus = bus or Bus(cfg.bus)
        self.loop: StageLoop | None = None

    async def run(self, stop: asyncio.Event | None = None) -> None:
        from streamrl.topics import ensure_topics

        await ensure_topics(self.bus)
        await self.table.start()
        try:
            self.loop = StageLoop(
                self.bus, stage=STAGE, source=SOURCE, group=self.rc.group, decode=self._decode,
                handle=self.handle, max_in_flight=self.rc.max_in_flight,
                drain_timeout_s=self.rc.drain_timeout_s,
                on_assign=self._assigned, on_revoke=self._revoked)
            task = asyncio.create_task(self.loop.run())
            if stop is not None:
                stopper = asyncio.create_task(stop.wait())
                await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
                stopper.cancel()
                self.loop.stop()
            await task
        finally:
            await self.table.close()

    def _decode(self, data: bytes) -> Trajectory:
        return Trajectory.decode(data, self.cfg.bus.max_record_bytes)

    # -- partitions: this member's share of group-wide rate limits ---------------------------
    def _assigned(self, assigned: set[TopicPartition]) -> None:
        self._share(len(assigned))

    def _revoked(self, revoked: set[TopicPartition]) -> None:
        assert self.loop is not None
        self._share(len(self.loop.consumer.assignment() - revoked))

    def _share(self, owned: int) -> None:
        assert self.loop is not None
        topic = self.bus.topic(SOURCE)
        total = len(self.loop.consumer.client.partitions_for_topic(topic) or ())
        if not total:
            from streamrl.topics import load_specs

            total = load_specs()[SOURCE].partitions
        fraction = min(1.0, owned / total)
        metrics.REWARD_PARTITION_SHARE.labels(self.rc.group).set(fraction)
        self.table.set_share(fraction)

    # -- one record ----------------------------------------------------------------------------
    async def handle(self, traj: Trajectory, msg: Message) -> list[tuple[str, Rewarded]]:
        entry = self.table.lookup(traj.data_source)
        try:
            if entry is None:
                known = ", ".join(sorted(self.table.routes)[:20])
                raise DeadLetterError("unknown_data_source",
                                      f"no scorer serves data_source {traj.data_source!r} (known: {known})")
            reward, info = await self.score(entry, traj)
        except DeadLetterError as exc:
            metrics.REWARD_FAILED.labels(entry.name if entry else "", exc.reason).inc()
            if self.groups is not None:
                await self.groups.failed(traj)
            raise
        metrics.REWARD_SCORED.labels(entry.name, info["status"]).inc()
        metrics.REWARD_VALUE.labels(entry.name).observe(reward)
        rewarded = Rewarded.from_trajectory(traj, reward=reward, reward_info=info, scorer=entry.label)
        if self.groups is not None and self.groups.applies(traj):
            rewarded = await self.groups.settle(rewarded)
        return [(SINK, rewarded)]

    async def score(self, entry: Entry, traj: Trajectory) -> tuple[float, dict[str, Any]]:
        """The record's reward and ``reward_info``, or ``DeadLetterError``. Holds (retries
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
            retry=retry_if_exception_type(ScorerUnavailable), reraise=True, before_sleep=on_hold,
            wait=wait_exponential_jitter(multiplier=rc.retry_backoff_s, max=rc.unavailable_backoff_max_s,
                                      jitter=rc.retry_backoff_s))
        try:
            async for attempt in hold:
                with attempt:
                    return await self._score_bounded(entry, traj)
        finally:
            if held:
                metrics.REWARD_HELD.labels(entry.name).dec()
        raise AssertionError("unreachable")

    async def _score_bounded(self, entry: Entry, traj: Trajectory) -> tuple[float, dict[str, Any]]:
        rc = self.rc
        tries = 0

        def count(state: Any) -> None:
            exc = state.outcome.exception()
            log.warning("%s failed on %s (%s: %s); retry %d of %d", entry.name, traj.id,
                        type(exc).__name__, exc, state.attempt_number, rc.max_attempts - 1)

        retrying = AsyncRetrying(
            stop=stop_after_attempt(rc.max_attempts), reraise=True, before_sleep=count,
            retry=retry_if_not_exception_type((ScorerUnavailable, _NonFinite, asyncio.CancelledError)),
            wait=wait_exponential_jitter(multiplier=rc.retry_backoff_s, max=10.0, jitter=rc.retry_backoff_s))
        try:
            async for attempt in retrying:
                with attempt:
                    tries += 1
                    score, extras = await self._score_once(entry, traj)
        except (ScorerUnavailable, asyncio.CancelledError):
            raise
        except _NonFinite as exc:
            raise DeadLetterError("non_finite_reward", f"{entry.name}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - every scorer failure ends here, named
            reason = exc.reason if isinstance(exc, ScoreError) else "scorer_error"
            detail = exc.detail if isinstance(exc, ScoreError) else f"{type(exc).__name__}: {exc}"
            if reason in entry.fallbacks:
                score = entry.fallbacks[reason]
                return float(np.float32(score)), {"status": f"fallback:{reason}", "error": detail[:500],
                                                  "attempts": tries}
            raise DeadLetterError(reason, f"{entry.name}: {detail} (after {tries} attempts)") from None
        info = {**extras, "status": "ok"}
        if tries > 1:
            info["attempts"] = tries
        return score, info

    async def _score_once(self, entry: Entry, traj: Trajectory) -> tuple[float, dict[str, Any]]:
        started = time.monotonic()
        try:
            result = await entry.scorer(traj.data_source, traj.response, traj.ground_truth,
                                        traj.extra_info, prompt=traj.prompt)
            score, extras = split_result(result, entry.name)
        except ScorerUnavailable:
            raise
        except Exception as exc:
            reason = exc.reason if isinstance(exc, ScoreError) else "scorer_error"
            metrics.REWARD_ATTEMPT_ERRORS.labels(entry.name, reason).inc()
            raise
        metrics.REWARD_SCORE_SECONDS.labels(entry.name).observe(time.monotonic() - started)
        if not math.isfinite(np.float32(score)):
            metrics.REWARD_ATTEMPT_ERRORS.labels(entry.name, "non_finite_reward").inc()
            raise _NonFinite(f"reward {score!r} is not finite in fp32")
        return score, extras
