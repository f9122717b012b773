"""The one commit unit of a consuming stage: flush outputs, save state, commit offsets.

Why this order. A stage's offsets say "everything before here is done", and done means its
outputs are in Kafka (and, for the learner, in a saved checkpoint). So:

1. flush: wait until the broker has acknowledged every record produced so far. A record
   whose output is still in the producer's buffer is not done, and a commit past it would lose
   the output in a crash (the input would never be read again);
2. save: write the stage's own state (the learner's weights, optimizer and offsets). If it
   is saved but the commit below never happens, the stage restarts from the saved offsets;
3. commit the offsets to Kafka, last. A crash between any two steps re-delivers records whose
   outputs may already exist (duplicates, which the learner drops by ``id``), never loses one:
   delivery is at-least-once.

Replay commits nothing (it reads without a group), so it has no checkpoint.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Iterable

from streamrl.bus.base import TopicPartition
from streamrl.bus.client import Consumer, Producer

log = logging.getLogger(__name__)

#: Step 2: called with the positions about to be committed (the next offset per partition).
SaveState = Callable[[dict[TopicPartition, int]], Awaitable[object]]
#: Called after every commit with the consumer, the positions of every partition held (committed
#: or not) and the oldest unfinished record's timestamp per partition: ``bus.lag.ConsumerLag``.
OnCommit = Callable[[Consumer, dict[TopicPartition, int], dict[TopicPartition, float]], None]


@dataclass
class _Partition:
    pending: dict[int, float] = field(default_factory=dict)  # offset -> record timestamp (unix s)
    next_offset: int = -1  # one past the last offset taken
    committed: int = -1


class _Offsets:
    """Per partition: which offsets are taken but unfinished. The commit position is the lowest
    unfinished offset, or one past the last taken, so a commit never skips a record."""

    def __init__(self) -> None:
        self.parts: dict[TopicPartition, _Partition] = {}

    def take(self, tp: TopicPartition, offset: int, timestamp_ms: int | None = None) -> None:
        p = self.parts.setdefault(tp, _Partition())
        p.pending[offset] = timestamp_ms / 1000 if timestamp_ms and timestamp_ms > 0 else time.time()
        p.next_offset = max(p.next_offset, offset + 1)

    def done(self, tp: TopicPartition, offset: int) -> None:
        p = self.parts.get(tp)
        if p is not None:
            p.pending.pop(offset, None)

    def positions(self, only_changed: bool = True) -> dict[TopicPartition, int]:
        out = {}
        for tp, p in self.parts.items():
            pos = min(p.pending) if p.pending else p.next_offset
            if pos >= 0 and (pos != p.committed or not only_changed):
                out[tp] = pos
        return out

    def oldest(self) -> dict[TopicPartition, float]:
        return {tp: min(p.pending.values()) for tp, p in self.parts.items() if p.pending}

    def mark_committed(self, offsets: dict[TopicPartition, int]) -> None:
        for tp, pos in offsets.items():
            if tp in self.parts:
                self.parts[tp].committed = pos


class Checkpoint:
    """Commits a consumer's offsets as far as records are finished, in the order above. The
    stage marks each record ``take``-n when it reads it and ``done`` when its outputs are
    delivered (or ``done_when_acked``); a partition's commit position is its lowest unfinished
    offset, or one past the last taken, so a commit never skips a record.

    ``on_commit`` (``bus.lag.ConsumerLag``, say) is told the positions after every commit:
    the bus exports no metrics of its own kind, the layer above decides (by default, what the
    bus's ``commit_observer`` makes: the runtime sets it)."""

    def __init__(self, consumer: Consumer, producer: Producer, on_commit: OnCommit | None = None):
        if on_commit is None and consumer.bus.commit_observer is not None:
            on_commit = consumer.bus.commit_observer()
        self.consumer, self.producer, self.on_commit = consumer, producer, on_commit
        self._offsets = _Offsets()
        self._acks: dict[asyncio.Future, tuple[TopicPartition, int]] = {}

    # -- the records of a partition -------------------------------------------------------------
    def take(self, tp: TopicPartition, offset: int, timestamp_ms: int | None = None) -> None:
        """The record at ``tp``/``offset`` is being worked on: no commit passes it until it is
        ``done``. ``timestamp_ms``: its Kafka timestamp (ms; -1 or None: none, use now), for
        the age of the oldest unfinished record."""
        self._offsets.take(tp, offset, timestamp_ms)

    def done(self, tp: TopicPartition, offset: int) -> None:
        """The record at ``tp``/``offset`` is finished: a commit may pass it."""
        self._offsets.done(tp, offset)

    def holds(self, tp: TopicPartition, offset: int | None = None) -> bool:
        """Whether ``tp`` has records taken and not finished (``offset`` given: that one)."""
        p = self._offsets.parts.get(tp)
        if p is None:
            return False
        return bool(p.pending) if offset is None else offset in p.pending

    @property
    def partitions(self) -> set[TopicPartition]:
        """Every partition a record was taken from (and not ``forget``-ten since)."""
        return set(self._offsets.parts)

    def forget(self, tps: Iterable[TopicPartition]) -> None:
        """Drop what is known of ``tps`` (revoked: their records are the new owner's now)."""
        for tp in tps:
            self._offsets.parts.pop(tp, None)

    def done_when_acked(self, ack: asyncio.Future, tp: TopicPartition, offset: int) -> None:
        """The record at ``tp``/``offset`` is finished once ``ack`` (its output's delivery)
        succeeds. If delivery fails it stays unfinished: not committed, read again later."""
        self._acks[ack] = (tp, offset)
        ack.add_done_callback(self._acked)

    def _acked(self, ack: asyncio.Future) -> None:
        tp, offset = self._acks.pop(ack)
        if not ack.cancelled() and ack.exception() is None:
            self.done(tp, offset)
        else:
            log.error("%s: output of %s[%d]@%d not delivered (%s); the record stays uncommitted",
                      self.consumer.stage, tp.topic, tp.partition, offset,
                      "cancelled" if ack.cancelled() else ack.exception())

    async def commit(self, partitions: Iterable[TopicPartition] | None = None,
                     save: SaveState | None = None) -> bool:
        """Flush, ``save`` (if given) and commit the positions of ``partitions`` (default: the
        consumer's assignment). False if the group refused the commit (a rebalance moved the
        partitions: their records will be redelivered to the new owner)."""
        await self.producer.flush()
        while self._acks:  # their callbacks run before asyncio.wait returns
            await asyncio.wait(list(self._acks))
        keep = set(self.consumer.assignment() if partitions is None else partitions)
        positions = {tp: p for tp, p in self._offsets.positions(only_changed=False).items() if tp in keep}
        if save is not None:
            await save(positions)
        changed = {tp: p for tp, p in self._offsets.positions().items() if tp in keep}
        ok = await self.consumer.commit(changed)
        if ok:
            self._offsets.mark_committed(changed)
        if self.on_commit is not None:
            self.on_commit(self.consumer, self._offsets.positions(only_changed=False), self._offsets.oldest())
        return ok
