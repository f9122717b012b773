"""The reward stage: one member of the consumer group on ``rollouts`` that scores each
trajectory and publishes it to ``rewarded``.

It composes two pieces: the bus's ``StageLoop`` owns consuming, concurrency, back-pressure and
commits (an offset is committed only after the record's output is acknowledged, or after it
went to dead letters), and ``scoring.Scoring`` turns each trajectory into a rewarded record or a
``Failure`` (see there), which goes to dead letters with its reason.

A crash redelivers whatever was not committed; duplicates are allowed (the learner
de-duplicates by ``id``).
"""

from __future__ import annotations

import asyncio
from typing import ClassVar, Protocol

from streamrl import metrics
from streamrl.bus import Bus, Message, StageLoop, TopicPartition
from streamrl.config import BusConfig
from streamrl.reward.config import RewardConfig
from streamrl.records import ROLLOUTS, Rewarded, Trajectory
from streamrl.reward.scoring import Scoring

STAGE = "reward"


class RewardSections(Protocol):
    """What the reward stage reads of the pipeline's config (a ``PipelineConfig`` is one): its
    own section and the bus's, never the whole pipeline's."""

    bus: BusConfig
    reward: RewardConfig


def same_partition(msg: Message) -> int:
    """A rewarded record goes to its trajectory's partition number (modulo ``rewarded``'s): a
    group stays whole (its trajectories share a rollouts partition), and ``rewarded`` is spread
    as ``rollouts`` is (``rollout.worker.prompt_position`` says why not the key's hash)."""
    return msg.partition


class RewardStage:
    """Build with a config (the scorer table is checked here: a bad config raises
    ``ConfigError`` before anything connects), then ``await run(stop_event)``."""

    name: ClassVar[str] = STAGE

    def __init__(self, cfg: RewardSections, bus: Bus | None = None):
        self.cfg, self.rc = cfg, cfg.reward
        self.group = cfg.bus.group(STAGE, cfg.reward.group)
        self.scoring = Scoring(cfg.reward)
        self.table = self.scoring.table
        self.bus = bus or Bus(cfg.bus)
        self.loop: StageLoop | None = None

    @classmethod
    def from_config(cls, cfg: RewardSections, bus: Bus) -> "RewardStage":
        return cls(cfg, bus)

    def validate(self) -> None:
        self.rc.validate()

    def describe(self) -> str:
        return f"group {self.group}, scorers {', '.join(self.table.entries)}"

    async def run(self, stop: asyncio.Event | None = None) -> None:
        await self.scoring.start()
        try:
            self.loop = StageLoop(
                self.bus, stage=STAGE, source=ROLLOUTS, group=self.group, handle=self.handle, max_in_flight=self.rc.max_in_flight,
                drain_timeout_s=self.rc.drain_timeout_s,
                on_assign=self._assigned, on_revoke=self._revoked, spread=same_partition)
            await self.loop.run_until(stop)
        finally:
            await self.scoring.close()

    # -- partitions: this member's share of group-wide rate limits ---------------------------
    def _assigned(self, assigned: set[TopicPartition]) -> None:
        self._share(len(assigned))

    def _revoked(self, revoked: set[TopicPartition]) -> None:
        assert self.loop is not None
        self._share(len(self.loop.consumer.assignment() - revoked))

    def _share(self, owned: int) -> None:
        assert self.loop is not None
        topic = self.bus.topic(ROLLOUTS)
        total = len(self.loop.consumer.partitions_for_topic(topic))
        if not total:
            total = ROLLOUTS.spec.partitions
        fraction = min(1.0, owned / total)
        metrics.REWARD_PARTITION_SHARE.labels(self.group).set(fraction)
        self.table.set_share(fraction)

    # -- one record ----------------------------------------------------------------------------
    async def handle(self, traj: Trajectory, msg: Message) -> list[Rewarded]:
        return [await self.scoring.reward(traj)]
