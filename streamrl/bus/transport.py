"""The Kafka client, wrapped: the one module of streamrl that imports aiokafka (with ``_bare``,
the benchmark's baseline).

Everything here speaks streamrl's terms: a ``TopicPartition`` of our own, rebalance callbacks
that take sets of them, offsets as plain ints (``None``: none committed). A second client would
be a second version of this module, not a change to every stage.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import ssl
import time
from typing import Any, Awaitable, Callable, Iterable, Mapping, NamedTuple, Protocol, Sequence

import aiokafka
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin import NewTopic as _KafkaNewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import (KafkaConnectionError, KafkaError, KafkaTimeoutError, NodeNotReadyError,
                             RequestTimedOutError)

from streamrl import metrics
from streamrl.config import BusConfig
from streamrl.records import DeadLetter, RecordError, _Record

log = logging.getLogger(__name__)

# Errors that mean "the broker cannot be reached" (as opposed to a refused request): they flip
# ``streamrl_bus_broker_reachable`` to 0.
_UNREACHABLE = (KafkaConnectionError, KafkaTimeoutError, RequestTimedOutError, NodeNotReadyError,
                asyncio.TimeoutError)
BROKER_PROBE_INTERVAL_S = 5.0
_TOPIC_ALREADY_EXISTS = 36  # a race with another creator: not an error


class TopicPartition(NamedTuple):
    """One partition of a topic (full name). Equal to, and hashed like, the client's own."""

    topic: str
    partition: int


class Message(Protocol):
    """One record as a consumer hands it out."""

    topic: str
    partition: int
    offset: int
    timestamp: int  # ms since the epoch; -1: none
    key: bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes]]


class Delivery(Protocol):
    """Where the broker stored a produced record."""

    topic: str
    partition: int
    offset: int


#: A rebalance callback: the partitions assigned or revoked; may be a coroutine function.
PartitionsCallback = Callable[[set[TopicPartition]], "Awaitable[Any] | Any"]


class TopicSettings(Protocol):
    """What creating a topic needs (``topics.TopicSpec`` is one)."""

    @property
    def partitions(self) -> int: ...

    @property
    def replication_factor(self) -> int: ...

    @property
    def config(self) -> Mapping[str, str]: ...


def is_transient(exc: BaseException) -> bool:
    """A Kafka error worth waiting out (leader change, request timeout, broker restarting, a
    connection lost): the client says so with ``retriable``. Anything else (a record too large,
    an authorisation failure) is permanent for that record."""
    return isinstance(exc, _UNREACHABLE) or (isinstance(exc, KafkaError) and bool(getattr(exc, "retriable", False)))


def _kafka_tp(tp: TopicPartition) -> aiokafka.TopicPartition:
    return aiokafka.TopicPartition(tp.topic, tp.partition)


def _ours(tps: Iterable[Any]) -> set[TopicPartition]:
    return {TopicPartition(tp.topic, tp.partition) for tp in tps}


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
        """Keyword arguments every client takes: servers, client id, TLS, SASL."""
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

    def admin(self) -> "Admin":
        return Admin(self)

    def producer(self, stage: str, **overrides: Any) -> "Producer":
        return Producer(self, stage, **overrides)

    def consumer(self, topics: Sequence[str], group: str | None, stage: str, **kwargs: Any) -> "Consumer":
        return Consumer(self, topics, group, stage, **kwargs)


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

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    async def send(self, topic: str, record: _Record | bytes, key: bytes | None = None,
                   headers: list[tuple[str, bytes]] | None = None) -> asyncio.Future:
        """Queue one record on topic ``topic`` (short name). Returns a future of its
        ``Delivery``; await it to know the broker has the record."""
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

    async def send_and_wait(self, topic: str, record: _Record | bytes, key: bytes | None = None) -> Delivery:
        return await (await self.send(topic, record, key))

    async def send_all(self, topic: str, records: Iterable[_Record | bytes], *, window: int = 1000) -> int:
        """Send every record of ``records`` (any iterable, consumed lazily) to ``topic`` and
        return their number once the broker has all of them. At most ``window`` records wait
        for their acknowledgement at a time, so a feed of millions holds ``window`` futures,
        not millions, and a refused record stops the publish within a window."""
        pending: list[asyncio.Future] = []
        sent = 0
        for record in records:
            pending.append(await self.send(topic, record))
            sent += 1
            if len(pending) >= window:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
        return sent

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
        """Return once every record queued so far is acknowledged (or has failed)."""
        await self._client.flush()


class _Callbacks(ConsumerRebalanceListener):
    """The client's rebalance listener, calling streamrl callbacks with our partitions."""

    def __init__(self, on_assigned: PartitionsCallback | None, on_revoked: PartitionsCallback | None):
        self.on_assigned, self.on_revoked = on_assigned, on_revoked

    async def on_partitions_revoked(self, revoked: Any) -> None:
        if self.on_revoked is not None:
            await _maybe_await(self.on_revoked(_ours(revoked)))

    async def on_partitions_assigned(self, assigned: Any) -> None:
        if self.on_assigned is not None:
            await _maybe_await(self.on_assigned(_ours(assigned)))


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class Consumer:
    """A consumer-group member (``group`` set) that commits by hand, never automatically; with
    ``group=None`` it joins nothing and commits nothing (``Reader`` is built on that).

    ``on_assigned`` / ``on_revoked`` are called with the set of partitions on every rebalance
    (revoked first, before they move: the place to commit what is finished). ``stage`` labels
    the metrics; an empty stage is an internal client that exports none."""

    def __init__(self, bus: Bus, topics: Sequence[str], group: str | None, stage: str, *,
                 on_assigned: PartitionsCallback | None = None,
                 on_revoked: PartitionsCallback | None = None,
                 from_beginning: bool = True, **overrides: Any):
        c = bus.config
        self.bus, self.stage, self.group = bus, stage, group
        self.topics = [bus.topic(t) for t in topics]
        self._listener = (_Callbacks(on_assigned, on_revoked)
                          if on_assigned is not None or on_revoked is not None else None)
        self._probe: asyncio.Task | None = None
        self._last_probe = 0.0
        settings: dict[str, Any] = dict(
            bus.client_settings(), group_id=group, enable_auto_commit=False,
            auto_offset_reset="earliest" if from_beginning else "latest",
            session_timeout_ms=c.session_timeout_ms, heartbeat_interval_ms=c.heartbeat_interval_ms,
            max_poll_interval_ms=c.max_poll_interval_ms,
            max_partition_fetch_bytes=DeadLetter.size_limit(c.max_record_bytes) + 64 * 1024,
            fetch_max_bytes=max(64 * 1024 * 1024, DeadLetter.size_limit(c.max_record_bytes) * 2))
        settings.update(overrides)
        self._client = AIOKafkaConsumer(**settings)

    async def start(self, subscribe: bool = True) -> "Consumer":
        """Connect; subscribe to ``topics`` (join the group) unless ``subscribe`` is False (then
        partitions are read only once ``assign``-ed)."""
        await self._client.start()
        if subscribe:
            self._client.subscribe(self.topics, listener=self._listener)
        return self

    async def stop(self) -> None:
        if self._probe is not None:
            self._probe.cancel()
        await self._client.stop()  # leaves the group

    async def getmany(self, timeout_ms: int = 200, max_records: int | None = None,
                      partitions: Iterable[TopicPartition] = ()) -> list[Message]:
        """The records fetched so far (waiting up to ``timeout_ms`` for some), from
        ``partitions`` only if given."""
        batches = await self._client.getmany(*map(_kafka_tp, partitions), timeout_ms=timeout_ms,
                                             max_records=max_records)
        out: list[Message] = []
        for tp, msgs in batches.items():
            out.extend(msgs)
            if self.stage:
                metrics.BUS_CONSUMED.labels(self.stage, tp.topic).inc(len(msgs))
        if self.stage:
            self.check_broker()
        return out

    async def commit(self, offsets: Mapping[TopicPartition, int]) -> bool:
        """Commit ``offsets`` (the next offset to read, per partition). False if the group has
        moved on (a rebalance): those records will be redelivered to their new owner."""
        if not offsets or self.group is None:
            return True
        try:
            await self._client.commit({_kafka_tp(tp): off for tp, off in offsets.items()})
            metrics.BUS_COMMITS.labels(self.stage).inc()
            metrics.BUS_BROKER_REACHABLE.labels(self.stage, "consumer").set(1)
            return True
        except KafkaError as exc:  # CommitFailedError included
            metrics.BUS_COMMIT_ERRORS.labels(self.stage).inc()
            if isinstance(exc, _UNREACHABLE):
                metrics.BUS_BROKER_REACHABLE.labels(self.stage, "consumer").set(0)
            log.warning("%s: commit failed (%s); records since the last commit will be redelivered",
                        self.stage, exc)
            return False

    # -- positions ----------------------------------------------------------------------------
    def assignment(self) -> set[TopicPartition]:
        return _ours(self._client.assignment())

    def assign(self, partitions: Iterable[TopicPartition]) -> None:
        """Read exactly these partitions, without a group (replaces any earlier assignment,
        with fresh partition states)."""
        self._client.assign([_kafka_tp(tp) for tp in partitions])

    def seek(self, tp: TopicPartition, offset: int) -> None:
        """Read ``tp`` from ``offset`` next (in a rebalance callback too)."""
        self._client.seek(_kafka_tp(tp), offset)

    async def position(self, tp: TopicPartition) -> int:
        return await self._client.position(_kafka_tp(tp))

    def highwater(self, tp: TopicPartition) -> int | None:
        """The log end the last fetch of ``tp`` reported (exact on every broker); None before one."""
        return self._client.highwater(_kafka_tp(tp))

    def pause(self, partitions: Iterable[TopicPartition]) -> None:
        self._client.pause(*map(_kafka_tp, partitions))

    def resume(self, partitions: Iterable[TopicPartition]) -> None:
        self._client.resume(*map(_kafka_tp, partitions))

    def paused(self) -> set[TopicPartition]:
        return _ours(self._client.paused())

    # -- metadata and offsets -----------------------------------------------------------------
    def partitions_for_topic(self, topic: str) -> set[int]:
        """The partition numbers of ``topic`` (full name) in the metadata this client already
        holds (no request; empty if it holds none)."""
        return set(self._client.partitions_for_topic(topic) or ())

    async def partitions(self, topic: str) -> list[TopicPartition]:
        """Every partition of ``topic`` (full name), from fresh metadata; ``LookupError`` if the
        broker has no such topic."""
        # aiokafka's public topics() fetches this same metadata but returns the names only.
        cluster = await self._client._client.fetch_all_metadata()
        parts = cluster.partitions_for_topic(topic)
        if not parts:
            raise LookupError(f"topic {topic!r} does not exist on {self.bus.config.bootstrap_servers}")
        return [TopicPartition(topic, p) for p in sorted(parts)]

    async def beginning_offsets(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        got = await self._client.beginning_offsets([_kafka_tp(tp) for tp in partitions])
        return {TopicPartition(*tp): off for tp, off in got.items()}

    async def listed_end_offsets(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        """End offsets as the broker lists them. Not the log end on the embedded broker (see
        ``Reader.end_offsets``, which is exact everywhere)."""
        got = await self._client.end_offsets([_kafka_tp(tp) for tp in partitions])
        return {TopicPartition(*tp): off for tp, off in got.items()}

    async def offsets_for_times(self, partitions: Iterable[TopicPartition],
                                timestamp_ms: int) -> dict[TopicPartition, int | None]:
        """Per partition, the first offset whose record's timestamp is at or after
        ``timestamp_ms`` (None: no record that late)."""
        got = await self._client.offsets_for_times({_kafka_tp(tp): timestamp_ms for tp in partitions})
        return {TopicPartition(*tp): (None if at is None else at.offset) for tp, at in got.items()}

    # -- broker health --------------------------------------------------------------------------
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


class Admin:
    """Topic and group administration. ``async with bus.admin() as admin: ...``"""

    def __init__(self, bus: Bus):
        self.bus = bus
        self._client = AIOKafkaAdminClient(**bus.client_settings())

    async def __aenter__(self) -> "Admin":
        await self._client.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._client.close()

    async def list_topics(self) -> set[str]:
        return set(await self._client.list_topics())

    async def create_topics(self, topics: Mapping[str, TopicSettings]) -> None:
        """Create each topic (full name) with its settings; ``bus.replication_factor``, when
        set, overrides theirs. One that already exists (another creator won a race) is not an
        error; any other refusal raises ``RuntimeError`` naming the topic."""
        if not topics:
            return
        rf = self.bus.config.replication_factor
        resp = await self._client.create_topics([
            _KafkaNewTopic(name, t.partitions, rf or t.replication_factor, topic_configs=dict(t.config))
            for name, t in topics.items()])
        for topic, code, *msg in resp.topic_errors:
            if code not in (0, _TOPIC_ALREADY_EXISTS):
                raise RuntimeError(f"creating topic {topic} failed: error {code} {msg}")

    async def partition_counts(self, topics: Sequence[str]) -> dict[str, int]:
        """The number of partitions of each of ``topics`` that exists."""
        if not topics:
            return {}
        return {d["topic"]: len(d["partitions"]) for d in await self._client.describe_topics(list(topics))}

    async def topic_configs(self, topics: Sequence[str]) -> dict[str, dict[str, str]]:
        """Each topic's configuration, as the broker reports it."""
        if not topics:
            return {}
        out: dict[str, dict[str, str]] = {}
        resources = [ConfigResource(ConfigResourceType.TOPIC, t) for t in topics]
        for resp in await self._client.describe_configs(resources):
            for _code, _msg, _type, topic, entries in resp.resources:
                out[topic] = {e[0]: e[1] for e in entries}
        return out

    async def committed(self, group: str, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int | None]:
        """The offsets ``group`` has committed on ``partitions`` (None: none). The partitions are
        named: the embedded broker's answer for "every partition" does not decode."""
        tps = [_kafka_tp(tp) for tp in partitions]
        got = await self._client.list_consumer_group_offsets(group, partitions=tps)
        return {TopicPartition(*tp): (got[tp].offset if tp in got and got[tp].offset >= 0 else None)
                for tp in tps}
