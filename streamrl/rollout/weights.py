"""Weight following: the latest record of the policy topic, read by every rollout worker.

The topic is compacted with one key, so its last record is the learner's current version. Each
worker reads it from the beginning without a consumer group (every worker needs every record)
and keeps the last one it has seen; the worker loads it between generations. The last record
wins, not the highest number, so a learner that restarts from version 0 is followed too.
"""

from __future__ import annotations

import asyncio
import logging
import time

from streamrl.bus import Bus, TopicPartition
from streamrl.records import PolicyVersion, RecordError

log = logging.getLogger(__name__)


class PolicyFollower:
    def __init__(self, bus: Bus, stage: str = "rollout"):
        self.consumer = bus.consumer(["policy"], None, stage)
        self.latest: PolicyVersion | None = None
        self.latest_offset = -1  # offset of ``latest`` in the policy topic
        self.updated = asyncio.Event()  # set on every new record; cleared by whoever waits
        self._task: asyncio.Task | None = None
        self._read_to = 0  # one past the last offset read, readable or not

    @property
    def version(self) -> int:
        """The learner's latest version (0 before it has announced any)."""
        return self.latest.version if self.latest is not None else 0

    async def start(self, catch_up_s: float = 10.0) -> "PolicyFollower":
        """Start following; first read what the topic already holds (for up to ``catch_up_s``),
        so a worker that joins a running pipeline starts on the learner's current version."""
        await self.consumer.start()
        client = self.consumer.client
        topic = self.consumer.topics[0]
        await client.topics()  # metadata
        parts = [TopicPartition(topic, p) for p in sorted(client.partitions_for_topic(topic) or ())]
        ends = await self.consumer.end_offsets(parts) if parts else {}
        deadline = time.monotonic() + catch_up_s
        while any(end > 0 for end in ends.values()) and time.monotonic() < deadline:
            self._take(await self.consumer.getmany(timeout_ms=200))
            if all(self._read_to >= end for end in ends.values()):
                break
        self._task = asyncio.create_task(self._follow())
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.consumer.stop()

    async def _follow(self) -> None:
        while True:
            self._take(await self.consumer.getmany(timeout_ms=500))

    def _take(self, messages) -> None:
        for msg in messages:
            self._read_to = max(self._read_to, msg.offset + 1)
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
