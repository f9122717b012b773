"""Weight following: the latest record of the policy topic, read by every rollout worker.

The topic is compacted with one key, so its last record is the learner's current version. Each
worker reads it from the beginning without a consumer group (every worker needs every record)
and keeps the last one it has seen; the worker loads it between generations. The last record
wins, not the highest number, so a learner that restarts from version 0 is followed too.
"""

from __future__ import annotations

import asyncio
import logging

from streamrl.bus import Bus
from streamrl.records import PolicyVersion, RecordError

log = logging.getLogger(__name__)


class PolicyFollower:
    def __init__(self, bus: Bus, stage: str = "rollout"):
        self.consumer = bus.consumer(["policy"], None, stage)
        self.latest: PolicyVersion | None = None
        self.latest_offset = -1  # offset of ``latest`` in the policy topic
        self.updated = asyncio.Event()  # set on every new record; cleared by whoever waits
        self._task: asyncio.Task | None = None

    @property
    def version(self) -> int:
        """The learner's latest version (0 before it has announced any)."""
        return self.latest.version if self.latest is not None else 0

    async def start(self) -> "PolicyFollower":
        await self.consumer.start()
        self._task = asyncio.create_task(self._follow())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.consumer.stop()

    async def _follow(self) -> None:
        while True:
            for msg in await self.consumer.getmany(timeout_ms=500):
                try:
                    record = PolicyVersion.decode(msg.value)
                except RecordError as exc:
                    # Not dead-lettered: every worker reads this topic, and one bad record would
                    # become one dead letter per worker. The learner owns the topic.
                    log.error("policy topic offset %d: unreadable record (%s); ignored", msg.offset, exc)
                    continue
                if msg.offset > self.latest_offset:
                    self.latest, self.latest_offset = record, msg.offset
                    self.updated.set()
