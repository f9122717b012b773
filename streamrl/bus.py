"""The bus: the thin transport layer between streamrl and Kafka, and the loop every consuming
stage runs.

Client: aiokafka (native asyncio). Measured in DESIGN.md and ``streamrl bench bus``: ~90 MB/s of
32 KB records on 2 cores, a group member gets its first record in ~3 s with a 6 s session;
confluent-kafka is faster on raw bytes but its asyncio story is callbacks on threads, and
kafka-python is CPU-bound at ~5 MB/s. Nothing outside this module imports aiokafka, except
the topic admin calls in ``topics.py``.

Delivery is at-least-once: a record's offset is committed only after everything it produced
(outputs or its dead letter) was acknowledged by the broker ("flush outputs, then commit").
Writes downstream must be idempotent: the learner de-duplicates by ``id``.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Generic, Iterable, Sequence, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import (CommitFailedError, KafkaConnectionError, KafkaError, KafkaTimeoutError,
                             NodeNotReadyError, RequestTimedOutError)
from aiokafka.structs import ConsumerRecord, RecordMetadata

from streamrl import metrics
from streamrl.config import BusConfig
from streamrl.records import DeadLetter, RecordError, _Record

log = logging.getLogger(__name__)

# Errors that mean "the broker cannot be reached" (as opposed to a refused request): they flip
# ``streamrl_bus_broker_reachable`` to 0.
_UNREACHABLE = (KafkaConnectionError, KafkaTimeoutError, RequestTimedOutError, NodeNotReadyError,
                asyncio.TimeoutError)
BROKER_PROBE_INTERVAL_S = 5.0

R = TypeVar("R")
Message = ConsumerRecord  # what a consumer hands out: .topic .partition .offset .key .value .timestamp

__all__ = ["Bus", "Producer", "Consumer", "StageLoop", "DeadLetterError", "Message", "TopicPartition"]


class DeadLetterError(Exception):
    """Raised by a stage handler: this record failed for good; dead-letter it with ``reason``."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class Bus:
    """Connection settings and client factories for one process. Topic arguments everywhere are
    short names (``"rollouts"``); the bus adds the configured prefix."""

    def __init__(self, config: BusConfig):
        if not config.bootstrap_servers:
            raise ValueError("bus.bootstrap_servers is empty: start the embedded broker first "
                             "(streamrl broker) or pass --bootstrap-servers")
        self.config = config

    def topic(self, name: str) -> str:
        return self.config.topic(name)

    def client_settings(self) -> dict[str, Any]:
        c = self.config
        out: dict[str, Any] = {"bootstrap_servers": c.bootstrap_servers, "client_id": c.client_id,
                               "security_protocol": c.security_protocol}
        if c.security_protocol in ("SSL", "SASL_SSL"):
            out["ssl_context"] = ssl.create_default_context()
        if c.sasl_mechanism:
            password = c.sasl_password()
            if password is None:
                raise ValueError(f"bus.sasl_mechanism is {c.sasl_mechanism} but the environment "
                                 f"variable {c.sasl_password_env} is not set")
            out.update(sasl_mechanism=c.sasl_mechanism, sasl_plain_username=c.sasl_username,
                       sasl_plain_password=password)
        return out

    def admin_client(self):
        from aiokafka.admin import AIOKafkaAdminClient
        return AIOKafkaAdminClient(**self.client_settings())

    def producer(self, stage: str, **overrides: Any) -> "Producer":
        return Producer(self, stage, **overrides)

    def consumer(self, topics: Sequence[str], group: str | None, stage: str,
                 **overrides: Any) -> "Consumer":
        return Consumer(self, topics, group, stage, **overrides)


class Producer:
    """Keyed, batched, compressed producer. ``send`` returns once the record is queued, with a
    future for the broker's acknowledgement; a record over the limit fails at once."""

    def __init__(self, bus: Bus, stage: str, **overrides: Any):
        c = bus.config
        self.bus, self.stage = bus, stage
        compression = None if c.compression == "none" else c.compression
        self._client = AIOKafkaProducer(
            **bus.client_settings(), acks="all", compression_type=compression,
            linger_ms=c.linger_ms, max_batch_size=c.max_batch_bytes,
            max_request_size=DeadLetter.size_limit(c.max_record_bytes) + 64 * 1024, **overrides)

    async def start(self) -> "Producer":
        await self._client.start()
        return self

    async def stop(self) -> None:
        await self._client.stop()  # flushes what is queued

    async def __aenter__(self) -> "Producer":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.stop()

    async def send(self, topic: str, record: _Record | bytes, key: bytes | None = None,
                   headers: list[tuple[str, bytes]] | None = None) -> asyncio.Future:
        """Queue one record on topic ``topic`` (short name). Returns a future of its
        ``RecordMetadata``; await it to know the broker has the record."""
        if isinstance(record, _Record):
            value = record.encode(record.size_limit(self.bus.config.max_record_bytes))
            key = record.key if key is None else key
        else:
            value = record
            if len(value) > self.bus.config.max_record_bytes:
                raise RecordError("oversize", f"{len(value)} bytes, limit {self.bus.config.max_record_bytes}")
        name = self.bus.topic(topic)
        fut = await self._client.send(name, value, key=key, headers=headers)
        fut.add_done_callback(lambda f, n=len(value): self._count(f, name, n))
        return fut

    def _count(self, fut: asyncio.Future, topic: str, size: int) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is None:
            metrics.BUS_PRODUCED.labels(self.stage, topic).inc()
            metrics.BUS_PRODUCED_BYTES.labels(self.stage, topic).inc(size)
            metrics.BUS_BROKER_REACHABLE.labels(self.stage, "producer").set(1)
        elif isinstance(exc, _UNREACHABLE):
            metrics.BUS_BROKER_REACHABLE.labels(self.stage, "producer").set(0)

    async def send_and_wait(self, topic: str, record: _Record | bytes,
                            key: bytes | None = None) -> RecordMetadata:
        return await (await self.send(topic, record, key))

    async def dead_letter(self, *, reason: str, detail: str = "", message: Message | None = None,
                          value: bytes | None = None, key: bytes | None = None,
                          record_id: str | None = None) -> asyncio.Future:
        """Queue a dead letter carrying the original bytes and where they came from."""
        letter = DeadLetter.for_message(
            stage=self.stage, reason=reason, detail=detail,
            topic=message.topic if message else None,
            partition=message.partition if message else None,
            offset=message.offset if message else None,
            key=message.key if message else key, value=message.value if message else value,
            record_id=record_id)
        metrics.BUS_DEADLETTERS.labels(self.stage, reason).inc()
        log.warning("dead letter from %s: %s %s", self.stage, reason, detail[:200])
        return await self.send("deadletter", letter)

    async def flush(self) -> None:
        await self._client.flush()


class Consumer:
    """A consumer-group member (``group`` set) or a plain reader (``group=None``: no group, no
    commits; replay uses it). Offsets are committed by hand, never automatically."""

    def __init__(self, bus: Bus, topics: Sequence[str], group: str | None, stage: str, *,
                 listener: ConsumerRebalanceListener | None = None, from_beginning: bool = True,
                 **overrides: Any):
        c = bus.config
        self.bus, self.stage, self.group = bus, stage, group
        self.topics = [bus.topic(t) for t in topics]
        self._listener = listener
        self._end_reader: AIOKafkaConsumer | None = None  # side reader for end_offsets
        self._end_lock = asyncio.Lock()
        self._exported: set[TopicPartition] = set()  # partitions with lag/age series
        self._probe: asyncio.Task | None = None
        self._last_probe = 0.0
        self._client = AIOKafkaConsumer(
            **bus.client_settings(), group_id=group, enable_auto_commit=False,
            auto_offset_reset="earliest" if from_beginning else "latest",
            session_timeout_ms=c.session_timeout_ms, heartbeat_interval_ms=c.heartbeat_interval_ms,
            max_poll_interval_ms=c.max_poll_interval_ms,
            max_partition_fetch_bytes=DeadLetter.size_limit(c.max_record_bytes) + 64 * 1024,
            fetch_max_bytes=max(64 * 1024 * 1024, DeadLetter.size_limit(c.max_record_bytes) * 2),
            **overrides)

    @property
    def client(self) -> AIOKafkaConsumer:
        return self._client

    async def start(self, subscribe: bool = True) -> "Consumer":
        await self._client.start()
        if subscribe:
            self._client.subscribe(self.topics, listener=self._listener)
        return self

    async def stop(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
        if self._end_reader is not None:
            await self._end_reader.stop()
        await self._client.stop()  # leaves the group

    async def getmany(self, timeout_ms: int = 200, max_records: int | None = None) -> list[Message]:
        batches = await self._client.getmany(timeout_ms=timeout_ms, max_records=max_records)
        out = [m for msgs in batches.values() for m in msgs]
        for m in out:
            metrics.BUS_CONSUMED.labels(self.stage, m.topic).inc()
        self.check_broker()
        return out

    async def commit(self, offsets: dict[TopicPartition, int]) -> bool:
        """Commit ``offsets`` (the next offset to read, per partition). False if the group has
        moved on (a rebalance): those records will be redelivered to their new owner."""
        if not offsets or self.group is None:
            return True
        try:
            await self._client.commit(offsets)
            metrics.BUS_COMMITS.labels(self.stage).inc()
            metrics.BUS_BROKER_REACHABLE.labels(self.stage, "consumer").set(1)
            return True
        except (CommitFailedError, KafkaError) as exc:
            metrics.BUS_COMMIT_ERRORS.labels(self.stage).inc()
            if isinstance(exc, _UNREACHABLE):
                metrics.BUS_BROKER_REACHABLE.labels(self.stage, "consumer").set(0)
            log.warning("%s: commit failed (%s); records since the last commit will be redelivered",
                        self.stage, exc)
            return False

    def assignment(self) -> set[TopicPartition]:
        return set(self._client.assignment())

    async def end_offsets(self, tps: Sequence[TopicPartition], timeout_s: float = 5.0) -> dict[TopicPartition, int]:
        """Log-end offsets, exact on Kafka and on the embedded broker.

        Tansu answers ListOffsets(latest) with the first offset of the partition's last batch
        plus one (measured: batches of 5, 5, 5, 1, 1 records gave 1, 6, 11, 16, 17). A fetch
        reports the exact high watermark on both, so a side reader fetches at the listed end:
        on Kafka that returns no records (cheap), on Tansu the last batch."""
        listed = await self._client.end_offsets(list(tps))
        need = [tp for tp, end in listed.items() if end > 0]
        if not need:
            return listed
        async with self._end_lock:  # one side reader, one question at a time (it seeks)
            if self._end_reader is None:
                reader = AIOKafkaConsumer(
                    **self.bus.client_settings(), group_id=None, enable_auto_commit=False,
                    fetch_max_wait_ms=10,  # the broker's default 500 ms wait would be paid per question
                    max_partition_fetch_bytes=DeadLetter.size_limit(self.bus.config.max_record_bytes))
                await reader.start()
                self._end_reader = reader
            reader = self._end_reader
            reader.assign(need)  # fresh partition states: no high watermark left from last time
            for tp in need:
                reader.seek(tp, listed[tp])
            exact: dict[TopicPartition, int] = {}
            deadline = time.monotonic() + timeout_s
            while len(exact) < len(need) and time.monotonic() < deadline:
                await reader.getmany(*need, timeout_ms=100)
                exact.update({tp: hw for tp in need if (hw := reader.highwater(tp)) is not None})
        return {tp: max(end, exact.get(tp, end)) for tp, end in listed.items()}

    def update_lag(self, committed: dict[TopicPartition, int],
                   oldest: dict[TopicPartition, float] | None = None) -> None:
        """Export log-end minus committed per partition, from the high watermarks the fetcher
        already knows (no extra request), and the age of the oldest record taken but not
        finished (``oldest``: its Kafka timestamp in unix seconds, per partition; absent: none
        waiting). Series of partitions no longer in ``committed`` (revoked in a rebalance) are
        removed, so a group's summed lag does not count a partition twice."""
        oldest = oldest or {}
        now = time.time()
        group = self.group or ""
        for tp in self._exported - set(committed):
            labels = (self.stage, group, tp.topic, str(tp.partition))
            for gauge in (metrics.CONSUMER_LAG, metrics.CONSUMER_OLDEST_AGE):
                try:
                    gauge.remove(*labels)
                except KeyError:
                    pass
        self._exported = set()
        for tp, pos in committed.items():
            labels = (self.stage, group, tp.topic, str(tp.partition))
            end = self._client.highwater(tp)
            if end is not None:
                metrics.CONSUMER_LAG.labels(*labels).set(max(0, end - pos))
            taken_at = oldest.get(tp)
            metrics.CONSUMER_OLDEST_AGE.labels(*labels).set(
                max(0.0, now - taken_at) if taken_at is not None else 0.0)
            self._exported.add(tp)

    def check_broker(self) -> None:
        """At most every ``BROKER_PROBE_INTERVAL_S`` (``getmany`` calls it), ask the broker for
        metadata in the background and export whether it answered: a stage that is idle or
        paused (sending and committing nothing) still notices that it lost the broker."""
        if self._probe is not None or time.monotonic() - self._last_probe < BROKER_PROBE_INTERVAL_S:
            return
        self._last_probe = time.monotonic()
        self._probe = asyncio.create_task(self._client.topics())
        self._probe.add_done_callback(self._probed)

    def _probed(self, task: asyncio.Task) -> None:
        self._probe = None
        if task.cancelled():
            return
        reachable = task.exception() is None
        if not reachable:
            log.warning("%s: broker unreachable: %s", self.stage, task.exception())
        metrics.BUS_BROKER_REACHABLE.labels(self.stage, "consumer").set(1 if reachable else 0)


@dataclass
class _Partition:
    pending: dict[int, float] = field(default_factory=dict)  # offset -> record timestamp (unix s)
    next_offset: int = -1  # one past the last offset taken
    committed: int = -1


class OffsetTracker:
    """Per partition: which offsets are taken but unfinished. The commit position is the lowest
    unfinished offset, or one past the last taken, so a commit never skips a record."""

    def __init__(self) -> None:
        self.parts: dict[TopicPartition, _Partition] = {}

    def take(self, tp: TopicPartition, offset: int, timestamp_ms: int | None = None) -> None:
        """``timestamp_ms``: the record's Kafka timestamp (ms; -1 or None: none, use now)."""
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
        """Per partition with unfinished records: the timestamp of the oldest one."""
        return {tp: min(p.pending.values()) for tp, p in self.parts.items() if p.pending}

    def mark_committed(self, offsets: dict[TopicPartition, int]) -> None:
        for tp, pos in offsets.items():
            if tp in self.parts:
                self.parts[tp].committed = pos

    def forget(self, tps: Iterable[TopicPartition]) -> None:
        for tp in tps:
            self.parts.pop(tp, None)

    @property
    def in_flight(self) -> int:
        return sum(len(p.pending) for p in self.parts.values())


Handler = Callable[[R, Message], Awaitable[Iterable[tuple[str, _Record]]]]


class StageLoop(Generic[R]):
    """The loop of a consuming stage: the framework owns it, a stage supplies ``decode`` and
    ``handle``.

    For each message: ``decode`` (a ``RecordError`` sends the original bytes to dead letters),
    then ``handle(record, message)`` concurrently, at most ``max_in_flight`` at once; it returns
    ``(topic, record)`` outputs or raises ``DeadLetterError``. A record is finished when its
    outputs (or its dead letter) are acknowledged; offsets are committed every
    ``commit_interval_s`` up to the lowest unfinished one. While ``max_in_flight`` records are
    unfinished the loop stops fetching (back-pressure) but keeps the group membership alive.
    On ``stop()``: stop fetching, let in-flight records finish for up to ``drain_timeout_s``,
    flush, commit, leave the group. Unfinished records are redelivered to whoever takes over.
    Build it inside a running event loop (the Kafka clients bind to it).
    """

    def __init__(self, bus: Bus, *, stage: str, source: str, group: str,
                 decode: Callable[[bytes], R], handle: Handler, max_in_flight: int = 64,
                 drain_timeout_s: float = 30.0, producer: Producer | None = None,
                 on_assign: Callable[[set[TopicPartition]], Any] | None = None,
                 on_revoke: Callable[[set[TopicPartition]], Any] | None = None):
        self.bus, self.stage, self.group = bus, stage, group
        self.decode, self.handle = decode, handle
        self.max_in_flight, self.drain_timeout_s = max_in_flight, drain_timeout_s
        self.producer = producer or bus.producer(stage)
        self._own_producer = producer is None
        self.consumer = bus.consumer([source], group, stage, listener=_Listener(self))
        self.tracker = OffsetTracker()
        self._on_assign, self._on_revoke = on_assign, on_revoke
        self._tasks: set[asyncio.Task] = set()
        self._slot_free = asyncio.Event()
        self._stopping = asyncio.Event()
        self.finished = 0

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        if self._own_producer:
            await self.producer.start()
        await self.consumer.start()
        last_commit = time.monotonic()
        try:
            while not self._stopping.is_set():
                free = self.max_in_flight - len(self._tasks)
                if free <= 0:
                    self._slot_free.clear()
                    self.consumer.client.pause(*self.consumer.assignment())
                    await self.consumer.getmany(timeout_ms=0)  # keeps the member alive
                    try:
                        await asyncio.wait_for(self._slot_free.wait(), 0.5)
                    except asyncio.TimeoutError:
                        pass
                else:
                    if self.consumer.client.paused():
                        self.consumer.client.resume(*self.consumer.client.paused())
                    for msg in await self.consumer.getmany(timeout_ms=100, max_records=free):
                        self._start(msg)
                if time.monotonic() - last_commit >= self.bus.config.commit_interval_s:
                    await self.commit()
                    last_commit = time.monotonic()
        finally:
            await self._drain()
            await self.producer.flush()
            await self.commit()
            await self.consumer.stop()
            if self._own_producer:
                await self.producer.stop()

    def _start(self, msg: Message) -> None:
        tp = TopicPartition(msg.topic, msg.partition)
        self.tracker.take(tp, msg.offset, msg.timestamp)
        task = asyncio.create_task(self._process(msg, tp))
        self._tasks.add(task)
        metrics.BUS_IN_FLIGHT.labels(self.stage).set(len(self._tasks))
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        metrics.BUS_IN_FLIGHT.labels(self.stage).set(len(self._tasks))
        self._slot_free.set()

    async def _process(self, msg: Message, tp: TopicPartition) -> None:
        started = time.monotonic()
        try:
            try:
                record = self.decode(msg.value)
            except RecordError as exc:
                await (await self.producer.dead_letter(reason=exc.reason, detail=exc.detail, message=msg))
            else:
                try:
                    outputs = list(await self.handle(record, msg))
                except DeadLetterError as exc:
                    acks = [await self.producer.dead_letter(
                        reason=exc.reason, detail=exc.detail, message=msg,
                        record_id=getattr(record, "id", None))]
                else:
                    acks = [await self.producer.send(topic, out) for topic, out in outputs]
                await asyncio.gather(*acks)
        except asyncio.CancelledError:
            return  # shutting down: not finished, so not committed; it will be redelivered
        except Exception as exc:  # noqa: BLE001 - a bug in a handler must not lose the record
            log.exception("%s: unexpected error on %s[%d]@%d", self.stage, msg.topic, msg.partition, msg.offset)
            try:
                await (await self.producer.dead_letter(
                    reason="handler_error", detail=f"{type(exc).__name__}: {exc}", message=msg))
            except Exception:  # noqa: BLE001 - cannot even dead-letter: leave it uncommitted
                log.exception("%s: dead letter failed; the record stays uncommitted", self.stage)
                return
        self.tracker.done(tp, msg.offset)
        self.finished += 1
        metrics.BUS_HANDLER_SECONDS.labels(self.stage).observe(time.monotonic() - started)
        metrics.CONSUMER_LAST_PROGRESS.labels(self.stage, self.group).set(time.time())

    async def commit(self, tps: Iterable[TopicPartition] | None = None) -> None:
        positions = self.tracker.positions()
        if tps is not None:
            keep = set(tps)
            positions = {tp: p for tp, p in positions.items() if tp in keep}
        else:
            positions = {tp: p for tp, p in positions.items() if tp in self.consumer.assignment()}
        if await self.consumer.commit(positions):
            self.tracker.mark_committed(positions)
        self.consumer.update_lag(self.tracker.positions(only_changed=False), self.tracker.oldest())

    async def _drain(self) -> None:
        if not self._tasks:
            return
        done, pending = await asyncio.wait(set(self._tasks), timeout=self.drain_timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)


class _Listener(ConsumerRebalanceListener):
    """Commit what is finished before partitions move; forget them after."""

    def __init__(self, loop: StageLoop):
        self.loop = loop

    async def on_partitions_revoked(self, revoked) -> None:
        revoked = set(revoked)
        if revoked:
            await self.loop.commit(revoked)
            self.loop.tracker.forget(revoked)
            if self.loop._on_revoke:
                await _maybe_await(self.loop._on_revoke(revoked))

    async def on_partitions_assigned(self, assigned) -> None:
        if self.loop._on_assign:
            await _maybe_await(self.loop._on_assign(set(assigned)))


async def _maybe_await(value: Any) -> Any:
    return await value if asyncio.iscoroutine(value) else value
