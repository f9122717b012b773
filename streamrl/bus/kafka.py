"""The Kafka transport: aiokafka, wrapped to move bytes (the one module of streamrl that imports
it, with ``_bare``, the benchmark's baseline).

Everything here speaks the terms of ``base``: full topic names, values and keys as bytes, a
``TopicPartition`` of our own, rebalance callbacks that take sets of them, offsets as plain ints
(``None``: none committed). Nothing here knows a record type or exports a metric: the record
layer (``records``) encodes, routes by type, dead-letters and counts. A second client would be
a second version of this module (``memory`` is one), not a change to every stage.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import ssl
from typing import Any, Iterable, Mapping, Sequence

import aiokafka
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRebalanceListener
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin import NewTopic as _KafkaNewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import (KafkaConnectionError, KafkaError, KafkaTimeoutError, NodeNotReadyError,
                             RequestTimedOutError)

from streamrl.bus.base import (CommitFailed, Delivery, DeliveryCallback, Message, PartitionsCallback,
                               TopicPartition, TopicSettings)
from streamrl.config import BusConfig

log = logging.getLogger(__name__)

# Errors that mean "the broker cannot be reached" (as opposed to a refused request).
_UNREACHABLE = (KafkaConnectionError, KafkaTimeoutError, RequestTimedOutError, NodeNotReadyError,
                asyncio.TimeoutError)
_TOPIC_ALREADY_EXISTS = 36  # a race with another creator: not an error

__all__ = ["KafkaAdmin", "KafkaConsumer", "KafkaProducer", "client_settings", "is_transient", "is_unreachable"]


def is_transient(exc: BaseException) -> bool:
    """A Kafka error worth waiting out (leader change, request timeout, broker restarting, a
    connection lost): the client says so with ``retriable``. Anything else (a record too large,
    an authorisation failure) is permanent for that record."""
    return isinstance(exc, _UNREACHABLE) or (isinstance(exc, KafkaError) and bool(getattr(exc, "retriable", False)))


def is_unreachable(exc: BaseException) -> bool:
    """The broker could not be reached (as opposed to a refused request)."""
    return isinstance(exc, _UNREACHABLE)


def _kafka_tp(tp: TopicPartition) -> aiokafka.TopicPartition:
    return aiokafka.TopicPartition(tp.topic, tp.partition)


def _ours(tps: Iterable[Any]) -> set[TopicPartition]:
    return {TopicPartition(tp.topic, tp.partition) for tp in tps}


def client_settings(c: BusConfig) -> dict[str, Any]:
    """Keyword arguments every client takes: servers, client id, TLS, SASL."""
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


class KafkaProducer:
    """Keyed, batched, compressed producer of bytes. ``send`` returns once the value is queued,
    with a future of its ``Delivery``; ``on_delivery`` is called once per ``send`` when the
    broker has acknowledged or refused it. ``max_request_bytes``: the largest request (the
    record layer's largest record, a dead letter, plus headroom)."""

    def __init__(self, config: BusConfig, *, max_request_bytes: int,
                 on_delivery: DeliveryCallback | None = None, **overrides: Any):
        c = config
        compression = None if c.compression == "none" else c.compression
        self.on_delivery = on_delivery
        self._client = AIOKafkaProducer(
            **client_settings(c), acks="all", compression_type=compression,
            linger_ms=c.linger_ms, max_batch_size=c.max_batch_bytes,
            max_request_size=max_request_bytes, **overrides)

    async def start(self) -> "KafkaProducer":
        await self._client.start()
        return self

    async def stop(self) -> None:
        await self._client.stop()  # flushes what is queued

    async def send(self, topic: str, value: bytes, key: bytes | None = None,
                   headers: list[tuple[str, bytes]] | None = None) -> asyncio.Future:
        """Queue ``value`` on ``topic`` (full name). Returns a future of its ``Delivery``."""
        fut = await self._client.send(topic, value, key=key, headers=headers)
        if self.on_delivery is not None:
            fut.add_done_callback(lambda f, n=len(value): self._delivered(f, topic, n))
        return fut

    def _delivered(self, fut: asyncio.Future, topic: str, size: int) -> None:
        assert self.on_delivery is not None
        self.on_delivery(topic, size, asyncio.CancelledError() if fut.cancelled() else fut.exception())

    async def flush(self) -> None:
        """Return once every value queued so far is acknowledged (or has failed)."""
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


class KafkaConsumer:
    """A consumer-group member (``group`` set) that commits by hand, never automatically; with
    ``group=None`` it joins nothing and commits nothing (``Reader`` is built on that).

    ``topics``: full names. ``on_assigned`` / ``on_revoked`` are called with the set of
    partitions on every rebalance (revoked first, before they move: the place to commit what is
    finished). ``max_fetch_bytes``: the largest record it must be able to fetch."""

    def __init__(self, config: BusConfig, topics: Sequence[str], group: str | None, *,
                 max_fetch_bytes: int, on_assigned: PartitionsCallback | None = None,
                 on_revoked: PartitionsCallback | None = None,
                 from_beginning: bool = True, **overrides: Any):
        c = config
        self.config, self.group, self.topics = config, group, list(topics)
        self._listener = (_Callbacks(on_assigned, on_revoked)
                          if on_assigned is not None or on_revoked is not None else None)
        settings: dict[str, Any] = dict(
            client_settings(c), group_id=group, enable_auto_commit=False,
            auto_offset_reset="earliest" if from_beginning else "latest",
            session_timeout_ms=c.session_timeout_ms, heartbeat_interval_ms=c.heartbeat_interval_ms,
            max_poll_interval_ms=c.max_poll_interval_ms,
            max_partition_fetch_bytes=max_fetch_bytes + 64 * 1024,
            fetch_max_bytes=max(64 * 1024 * 1024, max_fetch_bytes * 2))
        settings.update(overrides)
        self._client = AIOKafkaConsumer(**settings)

    async def start(self, subscribe: bool = True) -> "KafkaConsumer":
        """Connect; subscribe to ``topics`` (join the group) unless ``subscribe`` is False (then
        partitions are read only once ``assign``-ed)."""
        await self._client.start()
        if subscribe:
            self._client.subscribe(self.topics, listener=self._listener)
        return self

    async def stop(self) -> None:
        await self._client.stop()  # leaves the group

    async def getmany(self, timeout_ms: int = 200, max_records: int | None = None,
                      partitions: Iterable[TopicPartition] = ()) -> list[Message]:
        """The records fetched so far (waiting up to ``timeout_ms`` for some), from
        ``partitions`` only if given."""
        batches = await self._client.getmany(*map(_kafka_tp, partitions), timeout_ms=timeout_ms,
                                             max_records=max_records)
        return [msg for msgs in batches.values() for msg in msgs]

    async def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        """Commit ``offsets`` (the next offset to read, per partition); ``CommitFailed`` if the
        group has moved on (a rebalance) or the broker did not answer."""
        try:
            await self._client.commit({_kafka_tp(tp): off for tp, off in offsets.items()})
        except KafkaError as exc:  # CommitFailedError included
            raise CommitFailed(str(exc), unreachable=isinstance(exc, _UNREACHABLE)) from exc

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
            raise LookupError(f"topic {topic!r} does not exist on {self.config.bootstrap_servers}")
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

    async def probe(self) -> None:
        """Ask the broker for metadata; raises if it does not answer."""
        await self._client.topics()


class KafkaAdmin:
    """Topic and group administration (``base.Admin``). ``async with bus.admin() as admin: ...``"""

    def __init__(self, config: BusConfig):
        self.config = config
        self._client = AIOKafkaAdminClient(**client_settings(config))

    async def __aenter__(self) -> "KafkaAdmin":
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
        rf = self.config.replication_factor
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
