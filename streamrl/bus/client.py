"""The record layer, above a transport (``kafka``, or ``memory``): what stages use.

- ``Bus``: one process's connection settings; picks the transport from ``bus.bootstrap_servers``
  (``HOST:PORT[,...]``: Kafka; ``memory://NAME``: the in-process broker of ``memory``) and builds
  the clients;
- ``Producer``: ``send(record)`` encodes a record with its codec and sends it to its type's
  topic (``records.TOPICS``); ``dead_letter`` sends the original bytes with the reason; counts
  what the broker acknowledged; ``on_delivery`` tells the caller each record's fate;
- ``Consumer``: the transport's consumer, counted (records consumed, commits, whether the
  broker answers).

Topic arguments are ``Topic`` handles or short names (``"rollouts"``); the bus adds the prefix.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

from streamrl import metrics
from streamrl.bus import kafka, memory
from streamrl.bus.base import (Admin, ByteConsumer, ByteProducer, CommitFailed, Delivery, Message,
                               PartitionsCallback, TopicPartition)
from streamrl.config import BusConfig
from streamrl.records import DeadLetter, RecordError, _Record, topic_of
from streamrl.topics import Topic

log = logging.getLogger(__name__)

#: How often an idle consumer asks the broker whether it is there (``Consumer.check_broker``).
BROKER_PROBE_INTERVAL_S = 5.0
_MEMORY_NAME = re.compile(r"[A-Za-z0-9_.-]*")

#: Told each record's fate, once per ``send``: the topic (short name) and the error (None: the
#: broker has it).
OnDelivery = Callable[[str, "BaseException | None"], None]


class Bus:
    """Connection settings, the transport, and client factories for one process."""

    def __init__(self, config: BusConfig):
        servers = config.bootstrap_servers
        if not servers:
            raise ValueError("bus.bootstrap_servers is empty: start the embedded broker first "
                             "(streamrl broker) or pass --bootstrap-servers")
        self.config = config
        self.broker: memory.MemoryBroker | None = None
        if servers.startswith(memory.SCHEME):
            name = servers[len(memory.SCHEME):]
            if not _MEMORY_NAME.fullmatch(name):
                raise ValueError(f"bus.bootstrap_servers {servers!r}: an in-process broker is "
                                 f"memory://NAME, NAME of letters, digits, '_', '.', '-'")
            self.broker = memory.broker(name)
        elif "://" in servers:
            raise ValueError(f"bus.bootstrap_servers {servers!r}: HOST:PORT[,HOST:PORT...] for Kafka, "
                             f"or memory://NAME for the in-process broker")
        self._transport = memory if self.broker is not None else kafka
        #: Makes each checkpoint's ``on_commit`` when its stage names none. The runtime sets it
        #: (``bus.lag.ConsumerLag``: the lag gauges), so stages need not know who observes them.
        self.commit_observer: Callable[[], Callable[..., None]] | None = None

    def topic(self, topic: Topic | str) -> str:
        """The full name of ``topic`` (a handle, or a name short or full)."""
        return self.config.topic(topic.name if isinstance(topic, Topic) else topic)

    def is_transient(self, exc: BaseException) -> bool:
        """A transport error worth waiting out (a leader change, a timeout, a broker restarting)."""
        return self._transport.is_transient(exc)

    def is_unreachable(self, exc: BaseException) -> bool:
        return self._transport.is_unreachable(exc)

    # -- clients --------------------------------------------------------------------------------
    def admin(self) -> Admin:
        return memory.MemoryAdmin(self.broker) if self.broker is not None else kafka.KafkaAdmin(self.config)

    def producer(self, stage: str, *, on_delivery: OnDelivery | None = None, **overrides: Any) -> "Producer":
        return Producer(self, stage, on_delivery=on_delivery, **overrides)

    def consumer(self, topics: Sequence[Topic | str], group: str | None, stage: str, **kwargs: Any) -> "Consumer":
        return Consumer(self, topics, group, stage, **kwargs)

    def _byte_producer(self, on_delivery: Any, **overrides: Any) -> ByteProducer:
        if self.broker is not None:
            return memory.MemoryProducer(self.broker, on_delivery=on_delivery)
        return kafka.KafkaProducer(self.config, on_delivery=on_delivery,
                                   max_request_bytes=self.largest_record + 64 * 1024, **overrides)

    def _byte_consumer(self, topics: list[str], group: str | None, **kwargs: Any) -> ByteConsumer:
        if self.broker is not None:
            return memory.MemoryConsumer(self.broker, topics, group, **kwargs)
        return kafka.KafkaConsumer(self.config, topics, group, max_fetch_bytes=self.largest_record, **kwargs)

    @property
    def largest_record(self) -> int:
        """The largest message on any topic: a dead letter carrying a record of the limit."""
        return DeadLetter.size_limit(self.config.max_record_bytes)


class Producer:
    """Sends records (each to its type's topic) and bytes; ``send`` returns once the record is
    queued, with a future of its ``Delivery``; a record over the limit fails at once.

    ``on_delivery(topic, error)`` is called once for every record given to ``send``, when its
    fate is known: acknowledged (``error`` None), refused, or failed before it was queued (the
    rollout worker hands a trajectory's gate reservation back there)."""

    def __init__(self, bus: Bus, stage: str, *, on_delivery: OnDelivery | None = None, **overrides: Any):
        self.bus, self.stage, self.on_delivery = bus, stage, on_delivery
        self._transport = bus._byte_producer(self._delivered, **overrides)
        #: per full topic name: its short name and the counters of what the broker acknowledged
        #: (a prometheus ``labels`` lookup per record was a tenth of the producer's Python time)
        self._counted: dict[str, tuple[str, Any, Any]] = {}
        self._reachable = metrics.BUS_BROKER_REACHABLE.labels(stage, "producer")

    async def start(self) -> "Producer":
        await self._transport.start()
        return self

    async def stop(self) -> None:
        await self._transport.stop()  # flushes what is queued

    async def __aenter__(self) -> "Producer":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    async def send(self, record: _Record, *, topic: Topic | str | None = None,
                   key: bytes | None = None, spread: int | None = None) -> asyncio.Future:
        """Queue ``record`` on its type's topic (``topic``: another one, as replay publishes
        rewarded records to a topic of the user's). Returns a future of its ``Delivery``.

        ``spread``: records given the same number land on one partition, ``spread`` modulo the
        topic's partitions (a stage spreads its outputs by where their input was read:
        ``StageLoop``'s ``spread``); None: where the key's hash puts them."""
        name = self.bus.topic(topic if topic is not None else topic_of(record))
        try:
            value = record.encode(record.size_limit(self.bus.config.max_record_bytes))
        except Exception as exc:
            self._delivered(name, 0, exc)
            raise
        partition = None
        if spread is not None:
            count = await self._transport.partition_count(name)
            partition = spread % count if count else None
        return await self._send(name, value, record.key if key is None else key, partition=partition)

    async def send_bytes(self, topic: Topic | str, value: bytes, key: bytes | None = None,
                         headers: list[tuple[str, bytes]] | None = None) -> asyncio.Future:
        """Queue bytes as they are (a producer that is not streamrl, a test's malformed record)."""
        name = self.bus.topic(topic)
        limit = self.bus.config.max_record_bytes
        if len(value) > limit:
            exc = RecordError("oversize", f"{len(value)} bytes, limit {limit}")
            self._delivered(name, 0, exc)
            raise exc
        return await self._send(name, value, key, headers)

    async def _send(self, name: str, value: bytes, key: bytes | None,
                    headers: list[tuple[str, bytes]] | None = None, partition: int | None = None) -> asyncio.Future:
        try:
            return await self._transport.send(name, value, key, headers, partition)
        except Exception as exc:
            self._delivered(name, len(value), exc)
            raise

    def _delivered(self, topic: str, size: int, error: BaseException | None) -> None:
        counted = self._counted.get(topic)
        if counted is None:
            counted = self._counted[topic] = (
                self.bus.config.short_topic(topic), metrics.BUS_PRODUCED.labels(self.stage, topic),
                metrics.BUS_PRODUCED_BYTES.labels(self.stage, topic))
        short, produced, produced_bytes = counted
        if error is None:
            produced.inc()
            produced_bytes.inc(size)
            self._reachable.set(1)
        elif self.bus.is_unreachable(error):
            self._reachable.set(0)
        if self.on_delivery is not None:
            self.on_delivery(short, error)

    async def send_and_wait(self, record: _Record, *, topic: Topic | str | None = None,
                            key: bytes | None = None, spread: int | None = None) -> Delivery:
        return await (await self.send(record, topic=topic, key=key, spread=spread))

    async def send_all(self, records: Iterable[_Record], *, topic: Topic | str | None = None,
                       window: int = 1000) -> int:
        """Send every record of ``records`` (any iterable, consumed lazily) and return their
        number once the broker has all of them. At most ``window`` records wait for their
        acknowledgement at a time, so a feed of millions holds ``window`` futures, not
        millions, and a refused record stops the publish within a window."""
        pending: list[asyncio.Future] = []
        sent = 0
        for record in records:
            pending.append(await self.send(record, topic=topic))
            sent += 1
            if len(pending) >= window:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
        return sent

    async def dead_letter(self, *, reason: str, detail: str = "", message: Message | None = None,
                          value: bytes | None = None, key: bytes | None = None,
                          record_id: str | None = None, routine: bool = False) -> asyncio.Future:
        """Queue a dead letter carrying the original bytes, where they came from, and why.
        ``routine``: an algorithm's choice (a group dynamic sampling filtered), logged at INFO,
        not as the warning a failure is."""
        letter = DeadLetter.for_message(
            stage=self.stage, reason=reason, detail=detail,
            topic=message.topic if message else None,
            partition=message.partition if message else None,
            offset=message.offset if message else None,
            key=message.key if message else key, value=message.value if message else value,
            record_id=record_id)
        metrics.BUS_DEADLETTERS.labels(self.stage, reason).inc()
        (log.info if routine else log.warning)("dead letter from %s: %s %s", self.stage, reason, detail[:200])
        return await self.send(letter)

    async def flush(self) -> None:
        """Return once every record queued so far is acknowledged (or has failed)."""
        await self._transport.flush()


class Consumer:
    """The transport's consumer (see ``kafka.KafkaConsumer``: a group member committing by hand,
    or with ``group=None`` a plain reader), counted. ``stage`` labels the metrics; an empty
    stage is an internal client that exports none. ``commit`` returns False where the group
    refused it (a rebalance moved the partitions: their records will be redelivered)."""

    def __init__(self, bus: Bus, topics: Sequence[Topic | str], group: str | None, stage: str, *,
                 on_assigned: PartitionsCallback | None = None, on_revoked: PartitionsCallback | None = None,
                 from_beginning: bool = True, **overrides: Any):
        self.bus, self.stage, self.group = bus, stage, group
        self.topics = [bus.topic(t) for t in topics]
        self._on_revoked = on_revoked
        self.transport = bus._byte_consumer(self.topics, group, on_assigned=on_assigned,
                                            on_revoked=self._revoked, from_beginning=from_beginning, **overrides)
        #: per partition held: where this member's last commit (or, before one, its first record)
        #: was, so each commit counts the records it moved the group past (``_count_committed``)
        self._counted_from: dict[TopicPartition, int] = {}
        self._probe: asyncio.Task | None = None
        self._last_probe = 0.0

    async def start(self, subscribe: bool = True) -> "Consumer":
        """Connect; subscribe to ``topics`` (join the group) unless ``subscribe`` is False (then
        partitions are read only once ``assign``-ed)."""
        await self.transport.start(subscribe)
        if self.group is not None and self.stage:
            for topic in self.topics:  # exported at 0 from the start: a member that gets no work shows
                metrics.BUS_COMMITTED_RECORDS.labels(self.stage, topic)
        return self

    async def stop(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
        await self.transport.stop()  # leaves the group

    async def getmany(self, timeout_ms: int = 200, max_records: int | None = None,
                      partitions: Iterable[TopicPartition] = ()) -> list[Message]:
        """The records fetched so far (waiting up to ``timeout_ms`` for some), from
        ``partitions`` only if given."""
        msgs = await self.transport.getmany(timeout_ms, max_records, partitions)
        if self.stage:
            by_topic: dict[str, int] = {}
            for m in msgs:
                by_topic[m.topic] = by_topic.get(m.topic, 0) + 1
            for topic, n in by_topic.items():
                metrics.BUS_CONSUMED.labels(self.stage, topic).inc(n)
            self.check_broker()
            if self.group is not None:
                counted_from = self._counted_from
                for m in msgs:
                    if (m.topic, m.partition) not in counted_from:
                        counted_from[TopicPartition(m.topic, m.partition)] = m.offset
        return msgs

    async def _revoked(self, revoked: set[TopicPartition]) -> None:
        """The stage's own callback (it commits what is finished), then forget the partitions:
        if they come back, their count starts from where the group is then."""
        try:
            if self._on_revoked is not None:
                result = self._on_revoked(revoked)
                if asyncio.iscoroutine(result):
                    await result
        finally:
            for tp in revoked:
                self._counted_from.pop(tp, None)

    def _count_committed(self, offsets: Mapping[TopicPartition, int]) -> None:
        """``streamrl_bus_committed_records_total``: how far a commit moved this member's
        partitions, so ``streamrl run`` shows each member's share of its group's work."""
        for tp, offset in offsets.items():
            start = self._counted_from.get(tp)
            if start is not None and offset > start:
                metrics.BUS_COMMITTED_RECORDS.labels(self.stage, tp.topic).inc(offset - start)
            self._counted_from[tp] = offset

    async def commit(self, offsets: Mapping[TopicPartition, int]) -> bool:
        """Commit ``offsets`` (the next offset to read, per partition). False if the group has
        moved on (a rebalance): those records will be redelivered to their new owner."""
        if not offsets or self.group is None:
            return True
        try:
            await self.transport.commit(offsets)
        except CommitFailed as exc:
            metrics.BUS_COMMIT_ERRORS.labels(self.stage).inc()
            if exc.unreachable:
                metrics.BUS_BROKER_REACHABLE.labels(self.stage, "consumer").set(0)
            log.warning("%s: commit failed (%s); records since the last commit will be redelivered",
                        self.stage, exc)
            return False
        metrics.BUS_COMMITS.labels(self.stage).inc()
        metrics.BUS_BROKER_REACHABLE.labels(self.stage, "consumer").set(1)
        if self.stage:
            self._count_committed(offsets)
        return True

    # -- positions and metadata: the transport's ------------------------------------------------
    def assignment(self) -> set[TopicPartition]:
        return self.transport.assignment()

    def assign(self, partitions: Iterable[TopicPartition]) -> None:
        """Read exactly these partitions, without a group (replaces any earlier assignment,
        with fresh partition states)."""
        self.transport.assign(partitions)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        """Read ``tp`` from ``offset`` next (in a rebalance callback too)."""
        self.transport.seek(tp, offset)

    async def position(self, tp: TopicPartition) -> int:
        return await self.transport.position(tp)

    def highwater(self, tp: TopicPartition) -> int | None:
        """The log end the last fetch of ``tp`` reported (exact on every broker); None before one."""
        return self.transport.highwater(tp)

    def pause(self, partitions: Iterable[TopicPartition]) -> None:
        self.transport.pause(partitions)

    def resume(self, partitions: Iterable[TopicPartition]) -> None:
        self.transport.resume(partitions)

    def paused(self) -> set[TopicPartition]:
        return self.transport.paused()

    def partitions_for_topic(self, topic: str) -> set[int]:
        """The partition numbers of ``topic`` (full name) the client already knows (no request)."""
        return self.transport.partitions_for_topic(topic)

    async def partitions(self, topic: str) -> list[TopicPartition]:
        """Every partition of ``topic`` (full name); ``LookupError`` if there is no such topic."""
        return await self.transport.partitions(topic)

    async def beginning_offsets(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        return await self.transport.beginning_offsets(partitions)

    async def listed_end_offsets(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        """End offsets as the broker lists them (see ``Reader.end_offsets``, exact everywhere)."""
        return await self.transport.listed_end_offsets(partitions)

    async def offsets_for_times(self, partitions: Iterable[TopicPartition],
                                timestamp_ms: int) -> dict[TopicPartition, int | None]:
        return await self.transport.offsets_for_times(partitions, timestamp_ms)

    # -- broker health --------------------------------------------------------------------------
    def check_broker(self) -> None:
        """At most every ``BROKER_PROBE_INTERVAL_S`` (``getmany`` calls it), ask the broker for
        metadata in the background and export whether it answered: a stage that is idle or
        paused (sending and committing nothing) still notices that it lost the broker."""
        if self._probe is not None or time.monotonic() - self._last_probe < BROKER_PROBE_INTERVAL_S:
            return
        self._last_probe = time.monotonic()
        self._probe = asyncio.create_task(self.transport.probe())
        self._probe.add_done_callback(self._probed)

    def _probed(self, task: asyncio.Task) -> None:
        self._probe = None
        if task.cancelled():
            return
        reachable = task.exception() is None
        if not reachable:
            log.warning("%s: broker unreachable: %s", self.stage, task.exception())
        metrics.BUS_BROKER_REACHABLE.labels(self.stage, "consumer").set(1 if reachable else 0)
