"""Weight following: the learner's current policy on the policy topic, read by every rollout worker.

Each worker reads the topic from the beginning with a ``Reader`` (no consumer group: every
worker needs every record) and keeps the current policy by the one rule the learner uses too
(``streamrl.learner.versions.supersedes``: the highest version of a line, or a new line's
version whatever its number, so a learner that restarts from an older checkpoint or from
version 0 is followed); the worker loads it between generations.
"""

from __future__ import annotations

import asyncio
import logging

from streamrl.bus import Bus, Message, Reader
from streamrl.learner.versions import supersedes
from streamrl.records import PolicyVersion, RecordError

log = logging.getLogger(__name__)


class PolicyFollower:
    def __init__(self, bus: Bus, stage: str = "rollout"):
        self.reader = Reader(bus, ["policy"], stage)
        self.latest: PolicyVersion | None = None
        self.latest_offset = -1  # offset of ``latest`` in the policy topic (a new one: load it)
        self.updated = asyncio.Event()  # set on every new record; cleared by whoever waits
        self._task: asyncio.Task | None = None

    @property
    def version(self) -> int:
        """The learner's latest version (0 before it has announced any)."""
        return self.latest.version if self.latest is not None else 0

    async def start(self, catch_up_s: float = 10.0) -> "PolicyFollower":
        """Start following; first read what the topic already holds (for up to ``catch_up_s``),
        so a worker that joins a running pipeline starts on the learner's current version."""
        await self.reader.start()
        try:
            await asyncio.wait_for(self._catch_up(), catch_up_s)
        except asyncio.TimeoutError:
            log.warning("policy topic: not read to its end in %.0f s; following from where it got", catch_up_s)
        self._task = asyncio.create_task(self._follow())
        return self

    async def _catch_up(self) -> None:
        async for batch in self.reader.read():
            self._take(batch)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.reader.stop()

    async def _follow(self) -> None:
        while True:
            self._take(await self.reader.fetch(timeout_ms=500))

    def _take(self, messages: list[Message]) -> None:
        for msg in messages:
            try:
                record = PolicyVersion.decode(msg.value)
            except RecordError as exc:
                # Not dead-lettered: every worker reads this topic, and one bad record would
                # become one dead letter per worker. The learner owns the topic.
                log.error("policy topic offset %d: unreadable record (%s); ignored", msg.offset, exc)
                continue
            if supersedes(record, self.latest):
                self.latest, self.latest_offset = record, msg.offset
                self.updated.set()
