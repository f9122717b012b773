"""Reading partitions without a consumer group: replay, weight following, the staleness gate, the
learner's look at the policy topic, ``streamrl run``'s observer and the benchmarks all read this
way. A reader assigns partitions to itself, so it never joins a group, never triggers a
rebalance and never moves anybody's committed offsets.

End offsets are exact here, on every broker. Kafka answers ListOffsets(latest) with the log
end; the embedded broker answers the first offset of the partition's last batch plus one
(measured: batches of 5, 5, 5, 1, 1 records list ends 1, 6, 11, 16, 17). A fetch reports the
exact high watermark on both, so ``end_offsets`` fetches once from the listed end minus one
with a side client: that is the last record on Kafka and the first of the last batch on the
embedded broker, so a record always comes back, and with it a high watermark that is fresh
(librdkafka keeps a partition's last known watermark across assignments: only one that came
with a record of this question is trusted).
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Iterable, Mapping, Sequence

from streamrl.bus.base import Message, TopicPartition
from streamrl.bus.client import Bus, Consumer
from streamrl.topics import Topic

#: ``read`` gives up when no partition advances for this long (a broker that stopped answering).
STALL_TIMEOUT_S = 60.0


class Reader:
    """Reads ``topics`` (short names; every partition of each, or only ``partitions``) as a
    plain reader, from the beginning unless ``read`` is told where to start.

    ``read(start, stop)`` yields the records of a range and ends; ``fetch()`` follows: each call
    returns what arrived since. A reader that only asks ``end_offsets`` fetches nothing.
    Build and use it inside one running event loop."""

    def __init__(self, bus: Bus, topics: Sequence[Topic | str], stage: str, *,
                 partitions: Iterable[TopicPartition] | None = None):
        self.bus, self.stage = bus, stage
        self.topics = [bus.topic(t) for t in topics]
        self.partitions: list[TopicPartition] = list(partitions) if partitions is not None else []
        self._resolve = partitions is None
        self._consumer = bus.consumer(topics, None, stage)
        self._assigned = False
        self._side: Consumer | None = None  # fetches at the listed ends (``end_offsets``)
        self._side_lock = asyncio.Lock()

    async def start(self) -> "Reader":
        """Connect and learn the partitions; ``LookupError`` if a topic does not exist."""
        await self._consumer.start(subscribe=False)
        if self._resolve:
            self.partitions = [tp for topic in self.topics for tp in await self._consumer.partitions(topic)]
        return self

    async def partitions_of(self, topic: Topic | str) -> list[TopicPartition]:
        """Every partition of ``topic`` (any topic, not only those read), as the broker has them."""
        return sorted(await self._consumer.partitions(self.bus.topic(topic)))

    async def stop(self) -> None:
        if self._side is not None:
            await self._side.stop()
        await self._consumer.stop()

    async def __aenter__(self) -> "Reader":
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- offsets ------------------------------------------------------------------------------
    async def end_offsets(self, partitions: Iterable[TopicPartition] | None = None,
                          timeout_s: float = 5.0) -> dict[TopicPartition, int]:
        """The log end (the offset the next record will get) of each of ``partitions`` (any
        partitions, the reader's own by default), exact on Kafka and on the embedded broker."""
        tps = list(self.partitions if partitions is None else partitions)
        listed = await self._consumer.listed_end_offsets(tps)
        need = [tp for tp, end in listed.items() if end > 0]
        if not need:
            return listed
        async with self._side_lock:  # one side client, one question at a time (it seeks)
            if self._side is None:
                # fetch_max_wait_ms: the broker's default 500 ms wait would be paid per question
                self._side = await self.bus.consumer([], None, "", fetch_max_wait_ms=10).start(subscribe=False)
            side = self._side
            side.assign(need)  # fresh partition states
            for tp in need:
                side.seek(tp, listed[tp] - 1)
            exact: dict[TopicPartition, int] = {}
            deadline = time.monotonic() + timeout_s
            while len(exact) < len(need) and time.monotonic() < deadline:
                for m in await side.getmany(timeout_ms=100, partitions=need):
                    tp = TopicPartition(m.topic, m.partition)
                    exact[tp] = max(exact.get(tp, 0), m.offset + 1, side.highwater(tp) or 0)
            side.assign([])  # stop its fetchers: at the log end they would ask every 10 ms meanwhile
        return {tp: max(end, exact.get(tp, end)) for tp, end in listed.items()}

    async def beginning_offsets(self, partitions: Iterable[TopicPartition] | None = None) -> dict[TopicPartition, int]:
        return await self._consumer.beginning_offsets(self.partitions if partitions is None else partitions)

    async def offsets_for_times(self, time_s: float, partitions: Iterable[TopicPartition] | None = None
                                ) -> dict[TopicPartition, int | None]:
        """Per partition, the first offset stored at or after ``time_s`` (unix seconds; None:
        nothing that late). The embedded broker maps every time to offset 0: use it to skip
        ahead, never to decide what is in a range."""
        return await self._consumer.offsets_for_times(self.partitions if partitions is None else partitions,
                                                      max(0, int(time_s * 1000)))

    # -- reading ------------------------------------------------------------------------------
    def _assign(self) -> None:
        if not self._assigned:
            self._consumer.assign(self.partitions)
            self._assigned = True

    async def fetch(self, timeout_ms: int = 500, max_records: int | None = None) -> list[Message]:
        """Follow: the records that arrived since the last call (waiting up to ``timeout_ms``)."""
        self._assign()
        return await self._consumer.getmany(timeout_ms=timeout_ms, max_records=max_records)

    async def read(self, start: Mapping[TopicPartition, int] | None = None,
                   stop: Mapping[TopicPartition, int] | None = None, *,
                   stall_timeout_s: float = STALL_TIMEOUT_S) -> AsyncIterator[list[Message]]:
        """Yield, batch by batch, the records at offsets ``start <= offset < stop`` of each
        partition in ``stop`` (default: every partition, to its end as it is now), starting
        where ``start`` says (default: where the reader is). Ends when every partition has
        reached its stop, and leaves the reader there, so ``fetch`` goes on from the stops.
        ``TimeoutError`` if no partition advances for ``stall_timeout_s``. Iterate it to its
        end (or cancel it): it keeps other partitions paused meanwhile."""
        self._assign()
        c = self._consumer
        stop = dict(stop) if stop is not None else await self.end_offsets()
        begin: dict[TopicPartition, int] = {}
        for tp in stop:
            if start is not None and tp in start:
                c.seek(tp, start[tp])
                begin[tp] = start[tp]
            else:
                begin[tp] = await c.position(tp)
        position = dict(begin)
        pending = {tp for tp in stop if begin[tp] < stop[tp]}
        paused = [tp for tp in self.partitions if tp not in pending]
        c.pause(paused)  # fetch only what is still to be read
        last_move = time.monotonic()
        try:
            while pending:
                msgs = await c.getmany(timeout_ms=500, partitions=pending)
                batch = [m for m in msgs if begin[tp := TopicPartition(m.topic, m.partition)] <= m.offset < stop[tp]]
                if batch:
                    yield batch
                moved = bool(msgs)
                for tp in list(pending):
                    now_at = await c.position(tp)
                    moved = moved or now_at != position[tp]
                    position[tp] = now_at
                    if now_at >= stop[tp]:
                        pending.discard(tp)
                        c.pause([tp])
                        paused.append(tp)
                if moved:
                    last_move = time.monotonic()
                elif time.monotonic() - last_move > stall_timeout_s:
                    where = ", ".join(f"{tp.topic}[{tp.partition}]@{position[tp]}/{stop[tp]}" for tp in sorted(pending))
                    raise TimeoutError(f"no progress for {stall_timeout_s:.0f} s "
                                       f"(partition@position/stop: {where})")
        finally:
            for tp in stop:
                if tp not in pending:
                    c.seek(tp, stop[tp])  # a fetch may have run past the stop (whole batches)
            c.resume(paused)
