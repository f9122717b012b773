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
from typing import TYPE_CHECKING, Awaitable, Callable, Iterable

from streamrl.bus.transport import Consumer, Producer, TopicPartition

if TYPE_CHECKING:
    from streamrl.bus.loop import OffsetTracker

log = logging.getLogger(__name__)

#: Step 2: called with the positions about to be committed (the next offset per partition).
SaveState = Callable[[dict[TopicPartition, int]], Awaitable[object]]


class Checkpoint:
    """Commits a consumer's offsets as far as ``tracker`` says records are finished, in the
    order above. ``tracker`` is shared with the stage, which marks records taken and done."""

    def __init__(self, consumer: Consumer, producer: Producer, tracker: "OffsetTracker"):
        self.consumer, self.producer, self.tracker = consumer, producer, tracker
        self._acks: dict[asyncio.Future, tuple[TopicPartition, int]] = {}

    def done_when_acked(self, ack: asyncio.Future, tp: TopicPartition, offset: int) -> None:
        """The record at ``tp``/``offset`` is finished once ``ack`` (its output's delivery)
        succeeds. If delivery fails it stays unfinished: not committed, read again later."""
        self._acks[ack] = (tp, offset)
        ack.add_done_callback(self._acked)

    def _acked(self, ack: asyncio.Future) -> None:
        tp, offset = self._acks.pop(ack)
        if not ack.cancelled() and ack.exception() is None:
            self.tracker.done(tp, offset)
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
        positions = {tp: p for tp, p in self.tracker.positions(only_changed=False).items() if tp in keep}
        if save is not None:
            await save(positions)
        changed = {tp: p for tp, p in self.tracker.positions().items() if tp in keep}
        ok = await self.consumer.commit(changed)
        if ok:
            self.tracker.mark_committed(changed)
        self.consumer.update_lag(self.tracker.positions(only_changed=False), self.tracker.oldest())
        return ok
