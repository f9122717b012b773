"""The in-memory transport: a broker inside this process, with the bytes-level interface of the
Kafka transport (``base``), so ``StageLoop``, ``Checkpoint``, ``Reader`` and the stages run on it
unchanged, in milliseconds and without a broker process. Select it with
``bus.bootstrap_servers: memory://NAME``: every ``Bus`` of this process naming the same NAME
shares one broker (``streamrl.testing.memory_bus`` makes a fresh one with the topics created).

What it keeps of Kafka: topics of numbered partitions, each an append-only log; a key always
lands on the same partition (CRC-32 of the key, not Kafka's murmur2: the partition of a key
differs from Kafka's, never its stability); a consumer group's committed offsets, which a new
member resumes from; fetch positions, seek, pause/resume, the high watermark a fetch reports;
delivery futures that resolve when the record is in the log.

Its limits, by design: one process and one event loop; nothing is persisted, retained or
compacted; **a group has one member at a time, which gets every partition of its topics at
start** (no rebalancing: a second member of a live group is refused); topics are never
auto-created (sending to a missing one raises ``LookupError``). What is about the broker itself
(rebalances, faults, compaction, the wire protocol) is tested on a real broker.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from streamrl.bus.base import DeliveryCallback, Message, PartitionsCallback, TopicPartition, TopicSettings

SCHEME = "memory://"


@dataclass(frozen=True)
class MemoryDelivery:
    topic: str
    partition: int
    offset: int


@dataclass
class _Topic:
    logs: list[list[Message]]
    config: dict[str, str]
    next_partition: itertools.count = field(default_factory=itertools.count)


class MemoryBroker:
    """Topics, logs and committed offsets of one ``memory://NAME``."""

    def __init__(self, name: str = ""):
        self.name = name
        self.topics: dict[str, _Topic] = {}
        self.committed: dict[str, dict[TopicPartition, int]] = {}  # group -> offsets
        self.members: dict[str, "MemoryConsumer"] = {}  # group -> its one member
        self._waiters: set[asyncio.Future] = set()

    def create_topic(self, name: str, partitions: int, config: Mapping[str, str] | None = None) -> bool:
        """Create ``name`` unless it exists; True if created."""
        if name in self.topics:
            return False
        if partitions < 1:
            raise ValueError(f"topic {name!r}: {partitions} partitions")
        self.topics[name] = _Topic([[] for _ in range(partitions)], dict(config or {}))
        return True

    def log(self, tp: TopicPartition) -> list[Message]:
        topic = self.topics.get(tp.topic)
        if topic is None or not 0 <= tp.partition < len(topic.logs):
            raise LookupError(f"no partition {tp.topic}[{tp.partition}] on {SCHEME}{self.name}")
        return topic.logs[tp.partition]

    def append(self, topic: str, value: bytes, key: bytes | None,
               headers: Sequence[tuple[str, bytes]] | None, partition: int | None = None) -> MemoryDelivery:
        t = self.topics.get(topic)
        if t is None:
            raise LookupError(f"topic {topic!r} does not exist on {SCHEME}{self.name}")
        n = len(t.logs)
        if partition is not None and not 0 <= partition < n:
            raise LookupError(f"no partition {topic}[{partition}] on {SCHEME}{self.name}")
        if partition is None:
            partition = zlib.crc32(key) % n if key is not None else next(t.next_partition) % n
        log = t.logs[partition]
        log.append(Message(topic, partition, len(log), int(time.time() * 1000), key, value,
                                 tuple(headers or ())))
        for waiter in list(self._waiters):
            waiter.get_loop().call_soon_threadsafe(_wake, waiter)
        return MemoryDelivery(topic, partition, len(log) - 1)

    async def wait(self, timeout_s: float) -> None:
        """Until something is appended, or ``timeout_s``."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.add(waiter)
        try:
            await asyncio.wait_for(waiter, timeout_s)
        except asyncio.TimeoutError:
            pass
        finally:
            self._waiters.discard(waiter)


def _wake(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


_BROKERS: dict[str, MemoryBroker] = {}


def broker(name: str) -> MemoryBroker:
    """The broker of ``memory://name`` in this process (made on first use)."""
    if name not in _BROKERS:
        _BROKERS[name] = MemoryBroker(name)
    return _BROKERS[name]


def is_transient(exc: BaseException) -> bool:
    """Nothing in memory is worth waiting out."""
    return False


def is_unreachable(exc: BaseException) -> bool:
    return False


class MemoryProducer:
    """``send`` appends at once; the future it returns is already resolved, and ``on_delivery``
    runs as its callback (as with Kafka, after ``send`` returned)."""

    def __init__(self, broker: MemoryBroker, *, on_delivery: DeliveryCallback | None = None):
        self.broker, self.on_delivery = broker, on_delivery

    async def start(self) -> "MemoryProducer":
        return self

    async def stop(self) -> None:
        await self.flush()

    async def send(self, topic: str, value: bytes, key: bytes | None = None,
                   headers: list[tuple[str, bytes]] | None = None, partition: int | None = None) -> asyncio.Future:
        delivery = self.broker.append(topic, value, key, headers, partition)
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(delivery)
        if self.on_delivery is not None:
            size = len(value)
            fut.add_done_callback(lambda f: self.on_delivery(topic, size, None))  # type: ignore[misc]
        return fut

    async def partition_count(self, topic: str) -> int | None:
        t = self.broker.topics.get(topic)
        return len(t.logs) if t is not None else None

    async def flush(self) -> None:
        await asyncio.sleep(0)  # the delivery callbacks run


@dataclass
class _Position:
    offset: int | None = None  # None: not yet resolved (committed offset, or the reset rule)
    highwater: int | None = None


class MemoryConsumer:
    """A group member (it gets every partition of ``topics`` at ``start``) or, with
    ``group=None``, a plain reader of the partitions it is ``assign``-ed. Keyword arguments the
    Kafka client takes and that mean nothing here (``fetch_max_wait_ms``, ...) are accepted."""

    def __init__(self, broker: MemoryBroker, topics: Sequence[str], group: str | None, *,
                 on_assigned: PartitionsCallback | None = None, on_revoked: PartitionsCallback | None = None,
                 from_beginning: bool = True, **_kafka_settings: Any):
        self.broker, self.topics, self.group = broker, list(topics), group
        self.on_assigned, self.on_revoked = on_assigned, on_revoked  # revoked: never (no rebalances)
        self.from_beginning = from_beginning
        self._positions: dict[TopicPartition, _Position] = {}
        self._paused: set[TopicPartition] = set()
        self._member = False
        self._turn = 0  # which partition is fetched from first: each in turn

    async def start(self, subscribe: bool = True) -> "MemoryConsumer":
        if not subscribe:
            return self
        if self.group is not None:
            other = self.broker.members.get(self.group)
            if other is not None and other is not self:
                raise RuntimeError(f"group {self.group!r} already has a member on {SCHEME}{self.broker.name}: "
                                   "the in-memory transport gives one member every partition (no rebalancing)")
            self.broker.members[self.group] = self
            self._member = True
        self.assign(tp for t in self.topics if t in self.broker.topics
                    for tp in (TopicPartition(t, p) for p in range(len(self.broker.topics[t].logs))))
        if self.on_assigned is not None:
            result = self.on_assigned(set(self._positions))
            if inspect.isawaitable(result):
                await result
        return self

    async def stop(self) -> None:
        if self._member and self.broker.members.get(self.group or "") is self:
            del self.broker.members[self.group or ""]
        self._member = False

    def _offset(self, tp: TopicPartition) -> int:
        state = self._positions[tp]
        if state.offset is None:
            committed = self.broker.committed.get(self.group, {}).get(tp) if self.group else None
            state.offset = (committed if committed is not None
                            else 0 if self.from_beginning else len(self.broker.log(tp)))
        return state.offset

    async def getmany(self, timeout_ms: int = 200, max_records: int | None = None,
                      partitions: Iterable[TopicPartition] = ()) -> list[Any]:
        wanted = [tp for tp in (list(partitions) or list(self._positions))
                  if tp in self._positions and tp not in self._paused]
        deadline = time.monotonic() + timeout_ms / 1000
        while True:
            out: list[Message] = []
            if wanted:
                self._turn = (self._turn + 1) % len(wanted)
            for tp in wanted[self._turn:] + wanted[:self._turn]:
                log, start = self.broker.log(tp), self._offset(tp)
                room = None if max_records is None else max_records - len(out)
                if room == 0:
                    break
                got = log[start:] if room is None else log[start:start + room]
                out.extend(got)
                self._positions[tp].offset = start + len(got)
                self._positions[tp].highwater = len(log)
            left = deadline - time.monotonic()
            if out or left <= 0:
                return out
            await self.broker.wait(left)

    async def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        if self.group is not None:
            self.broker.committed.setdefault(self.group, {}).update(offsets)

    def assignment(self) -> set[TopicPartition]:
        return set(self._positions)

    def assign(self, partitions: Iterable[TopicPartition]) -> None:
        self._positions = {TopicPartition(*tp): _Position() for tp in partitions}
        self._paused &= set(self._positions)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self._positions[tp].offset = offset

    async def position(self, tp: TopicPartition) -> int:
        return self._offset(tp)

    def highwater(self, tp: TopicPartition) -> int | None:
        state = self._positions.get(tp)
        return None if state is None else state.highwater

    def pause(self, partitions: Iterable[TopicPartition]) -> None:
        self._paused |= set(partitions) & set(self._positions)

    def resume(self, partitions: Iterable[TopicPartition]) -> None:
        self._paused -= set(partitions)

    def paused(self) -> set[TopicPartition]:
        return set(self._paused)

    def partitions_for_topic(self, topic: str) -> set[int]:
        t = self.broker.topics.get(topic)
        return set(range(len(t.logs))) if t is not None else set()

    async def partitions(self, topic: str) -> list[TopicPartition]:
        parts = self.partitions_for_topic(topic)
        if not parts:
            raise LookupError(f"topic {topic!r} does not exist on {SCHEME}{self.broker.name}")
        return [TopicPartition(topic, p) for p in sorted(parts)]

    async def beginning_offsets(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        return {TopicPartition(*tp): 0 for tp in partitions}

    async def listed_end_offsets(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        return {TopicPartition(*tp): len(self.broker.log(tp)) for tp in partitions}

    async def offsets_for_times(self, partitions: Iterable[TopicPartition],
                                timestamp_ms: int) -> dict[TopicPartition, int | None]:
        return {TopicPartition(*tp): next((m.offset for m in self.broker.log(tp) if m.timestamp >= timestamp_ms), None)
                for tp in partitions}

    async def probe(self) -> None:
        """The broker is this process: always there."""


class MemoryAdmin:
    """``base.Admin`` on an in-memory broker."""

    def __init__(self, broker: MemoryBroker):
        self.broker = broker

    async def __aenter__(self) -> "MemoryAdmin":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        pass

    async def list_topics(self) -> set[str]:
        return set(self.broker.topics)

    async def create_topics(self, topics: Mapping[str, TopicSettings]) -> None:
        for name, settings in topics.items():
            self.broker.create_topic(name, settings.partitions, settings.config)

    async def partition_counts(self, topics: Sequence[str]) -> dict[str, int]:
        return {t: len(self.broker.topics[t].logs) for t in topics if t in self.broker.topics}

    async def topic_configs(self, topics: Sequence[str]) -> dict[str, dict[str, str]]:
        return {t: dict(self.broker.topics[t].config) for t in topics if t in self.broker.topics}

    async def committed(self, group: str, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int | None]:
        offsets = self.broker.committed.get(group, {})
        return {TopicPartition(*tp): offsets.get(TopicPartition(*tp)) for tp in partitions}
