"""The Kafka transport: confluent-kafka (librdkafka), wrapped to move bytes (the one module of
streamrl that imports it, with ``streamrl.bench.bare_clients``, the benchmark's baselines).

Everything here speaks the terms of ``base``: full topic names, values and keys as bytes, a
``TopicPartition`` of our own, rebalance callbacks that take sets of them, offsets as plain ints
(``None``: none committed). Nothing here knows a record type or exports a metric: the record
layer (``records``) encodes, routes by type, dead-letters and counts.

Why librdkafka, and how it meets asyncio (issue 24, BENCHMARKS.md "Bus"). librdkafka compresses,
batches and fetches in its own C threads, without the GIL: the event loop only hands it bytes
(``produce`` copies them into its queue) and takes records back. Its callbacks come from other
threads, so:

- a producer serves librdkafka's delivery reports on the event loop itself: ``poll(0)`` (which
  never waits) after each send and every millisecond while records wait for theirs; ``flush``
  awaits those futures, so it never blocks the loop;
- a consumer has one thread that owns the librdkafka consumer: every call on it (consume,
  commit, seek, pause, position, metadata) is an operation queued to that thread, in order.
  librdkafka admits one caller at a time on a consumer, so this is the only way the loop never
  waits on it. ``seek``, ``pause``, ``assign`` stay synchronous: they update a mirror the loop
  reads and queue the operation, which runs before the next ``getmany``;
- rebalance callbacks run inside ``consume`` on that thread. They run the stage's callback on
  the event loop and, while it runs, the thread serves the operations it queues (the commit of
  a revoke): the callback returns to librdkafka only once the commit is done.

Pause is lazy (the pipeline regression, BENCHMARKS.md): librdkafka drops what it prefetched for a
partition when it is paused and fetches it again on resume, and ``StageLoop`` pauses every time
its in-flight slots are full. A pause here only hides the partition's records from ``getmany``
(they wait in this client, as aiokafka kept them); librdkafka is paused too only once the records
held for paused partitions pass ``hold_bytes`` (the fetch size), which bounds memory in bytes.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import queue
import threading
import time
from typing import Any, Callable, Iterable, Mapping, NamedTuple, Sequence

import confluent_kafka as ck
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient, ConfigResource
from confluent_kafka.admin import NewTopic as _KafkaNewTopic

from streamrl.bus.base import (CommitFailed, DeliveryCallback, Message, PartitionsCallback,
                               TopicPartition, TopicSettings, TransportError)
from streamrl.config import BusConfig

log = logging.getLogger(__name__)
#: librdkafka's own log lines (rate-limited by ``streamrl.logrates`` as a client logger)
_rdkafka_log = logging.getLogger("rdkafka")

#: librdkafka error codes that mean "the broker cannot be reached" (as opposed to a refused request)
_UNREACHABLE_CODES = frozenset({KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._TIMED_OUT,
                                KafkaError._MSG_TIMED_OUT, KafkaError.REQUEST_TIMED_OUT,
                                KafkaError._RESOLVE, KafkaError.NETWORK_EXCEPTION})
_NO_OFFSET = -1001  # librdkafka's OFFSET_INVALID: "none", "use the committed one"
#: How long a blocking metadata/offset request may take before it fails.
REQUEST_TIMEOUT_S = 30.0
#: After a group assignment, the first records wait at most this long for every partition's
#: first fetch (``KafkaConsumer._consume``).
SETTLE_S = 1.0
#: ``stop`` waits at most this long for librdkafka to flush or leave the group.
STOP_TIMEOUT_S = 15.0
#: aiokafka-style names the layers above may pass as overrides, in librdkafka's terms.
_ALIASES = {"fetch_max_wait_ms": "fetch.wait.max.ms", "linger_ms": "linger.ms",
            "fetch_min_bytes": "fetch.min.bytes"}
#: Cluster ids of brokers whose members stop without leaving their group (``KafkaConsumer.stop``):
#: the embedded broker's (Tansu 0.6, whatever started it).
NO_LEAVE_CLUSTERS = frozenset({"tansu_cluster"})

__all__ = ["KafkaAdmin", "KafkaBusError", "KafkaConsumer", "KafkaProducer", "client_settings",
           "is_transient", "is_unreachable"]


class KafkaBusError(TransportError):
    """A Kafka error, with librdkafka's code (``code``) and whether waiting helps (``retriable``)."""

    def __init__(self, error: KafkaError | str, what: str = ""):
        if isinstance(error, KafkaError):
            self.code: int | None = error.code()
            self.retriable = bool(error.retriable()) or error.code() in _UNREACHABLE_CODES
            text = f"{error.name()}: {error.str()}"
        else:
            self.code, self.retriable, text = None, False, error
        super().__init__(f"{what}: {text}" if what else text)


def _error(exc: BaseException, what: str = "") -> BaseException:
    """librdkafka's exception as a ``KafkaBusError`` (anything else unchanged)."""
    if isinstance(exc, KafkaException) and exc.args and isinstance(exc.args[0], KafkaError):
        return KafkaBusError(exc.args[0], what)
    return exc


def is_unreachable(exc: BaseException) -> bool:
    """The broker could not be reached (as opposed to a refused request)."""
    exc = _error(exc)
    return isinstance(exc, (asyncio.TimeoutError, TimeoutError)) or (
        isinstance(exc, KafkaBusError) and exc.code in _UNREACHABLE_CODES)


def is_transient(exc: BaseException) -> bool:
    """A Kafka error worth waiting out (leader change, request timeout, broker restarting, a
    connection lost): librdkafka says so with ``retriable``. Anything else (a record too large,
    an authorisation failure) is permanent for that record."""
    exc = _error(exc)
    return is_unreachable(exc) or (isinstance(exc, KafkaBusError) and exc.retriable)


def _ck_tp(tp: TopicPartition, offset: int = _NO_OFFSET) -> ck.TopicPartition:
    return ck.TopicPartition(tp.topic, tp.partition, offset)


def _ours(tps: Iterable[Any]) -> set[TopicPartition]:
    return {TopicPartition(tp.topic, tp.partition) for tp in tps}


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    return {_ALIASES.get(k, k): v for k, v in overrides.items()}


def client_settings(c: BusConfig) -> dict[str, Any]:
    """librdkafka settings every client takes: servers, client id, TLS, SASL (TLS checks the
    broker against the system's CA store), Nagle off (a record waits for nothing but linger),
    librdkafka's log lines through ``logging``."""
    out: dict[str, Any] = {"bootstrap.servers": c.bootstrap_servers, "client.id": c.client_id,
                           "security.protocol": c.security_protocol.lower(),
                           "socket.nagle.disable": True, "logger": _rdkafka_log}
    if c.security_protocol in ("SSL", "SASL_SSL"):
        out["ssl.ca.location"] = "probe"
    if c.sasl_mechanism:
        password = c.sasl_password()
        if password is None:
            raise ValueError(f"bus.sasl_mechanism is {c.sasl_mechanism} but the environment "
                             f"variable {c.sasl_password_env} is not set")
        out.update({"sasl.mechanism": c.sasl_mechanism, "sasl.username": c.sasl_username,
                    "sasl.password": password})
    return out


def producer_settings(c: BusConfig, max_request_bytes: int) -> dict[str, Any]:
    """The producer's librdkafka settings (the bench's bare client takes the same)."""
    return dict(client_settings(c), acks="all", **{
        "compression.type": c.compression, "linger.ms": c.linger_ms,
        "batch.size": c.max_batch_bytes, "message.max.bytes": max_request_bytes,
        # Java's default partitioner: keys land where aiokafka and Kafka Streams put them
        "partitioner": "murmur2_random",
        "queue.buffering.max.kbytes": max(256 * 1024, 4 * max_request_bytes // 1024),
        "enable.idempotence": False})


class _Delivery(NamedTuple):
    topic: str
    partition: int
    offset: int


class KafkaProducer:
    """Keyed, batched, compressed producer of bytes. ``send`` returns once librdkafka holds the
    value, with a future of its ``Delivery``; ``on_delivery`` is called once per ``send`` when
    the broker has acknowledged or refused it. ``max_request_bytes``: the largest message.
    ``overrides``: librdkafka settings (``{"linger.ms": 0}``).

    Delivery reports are served on the event loop (``poll(0)``, which never waits): after each
    ``send`` and, while records wait for theirs, every ``POLL_INTERVAL_S``. The first version
    served them on a thread of their own and handed them to the loop in batches; measured side
    by side (``streamrl bench bus``, BENCHMARKS.md) the two move records at the same rate with
    the same loop lag, and this one has no thread, no hand-off and no second thread taking the
    GIL once per report (confluent-kafka calls each report's callback with the GIL). A
    callback that raises is logged and the other reports are still settled."""

    #: How often reports are served while records wait for them (and nothing else polls).
    POLL_INTERVAL_S = 0.001
    #: How often librdkafka's error and log callbacks are served when nothing waits.
    IDLE_POLL_S = 0.1
    #: How long a topic's partition count is trusted (``partition_count``).
    PARTITIONS_TTL_S = 60.0

    def __init__(self, config: BusConfig, *, max_request_bytes: int,
                 on_delivery: DeliveryCallback | None = None, **overrides: Any):
        self.on_delivery = on_delivery
        self._settings = dict(producer_settings(config, max_request_bytes), **_overrides(overrides))
        self._client: ck.Producer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: set[asyncio.Future] = set()
        self._reports: list[tuple[asyncio.Future, KafkaError | None, Any, str, int]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._timer_busy = False
        self._partitions: dict[str, tuple[int, float]] = {}  # topic -> (partitions, asked at)
        self._asking: dict[str, asyncio.Future] = {}  # topic -> the metadata request in flight

    async def start(self) -> "KafkaProducer":
        self._loop = asyncio.get_running_loop()
        self._client = ck.Producer(dict(self._settings, error_cb=self._on_error))
        self._arm(False)
        return self

    async def stop(self) -> None:
        """Flush what is queued (at most ``STOP_TIMEOUT_S``), then stop serving reports."""
        if self._client is None:
            return
        try:
            await asyncio.wait_for(self.flush(), STOP_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("producer: %d records not acknowledged after %.0f s at stop",
                        len(self._pending), STOP_TIMEOUT_S)
        finally:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._client = None

    # -- librdkafka's delivery reports, served on the event loop ------------------------------
    def _arm(self, busy: bool) -> None:
        """Serve reports within ``POLL_INTERVAL_S`` (``busy``) or ``IDLE_POLL_S``."""
        if self._timer is not None:
            if self._timer_busy or not busy:
                return
            self._timer.cancel()
        self._timer_busy = busy
        self._timer = self._loop.call_later(  # type: ignore[union-attr]
            self.POLL_INTERVAL_S if busy else self.IDLE_POLL_S, self._tick)

    def _tick(self) -> None:
        self._timer = None
        if self._client is None:
            return
        try:
            self._poll()
        finally:  # whatever a report did, the next ones are still served
            self._arm(bool(self._pending))

    def _poll(self) -> None:
        """Serve the reports librdkafka has ready (its callbacks only collect them), then settle
        them: each future, then ``on_delivery``."""
        self._client.poll(0)  # type: ignore[union-attr]
        if not self._reports:
            return
        batch, self._reports = self._reports, []
        for fut, err, msg, topic, size in batch:
            exc = None if err is None else KafkaBusError(err, f"delivery to {topic}")
            self._pending.discard(fut)
            if not fut.done():
                if exc is None:
                    fut.set_result(_Delivery(msg.topic(), msg.partition(), msg.offset()))
                else:
                    fut.set_exception(exc)
            if self.on_delivery is not None:
                try:
                    self.on_delivery(topic, size, exc)
                except Exception:  # noqa: BLE001 - one caller's bug must not strand the other reports
                    log.exception("producer: on_delivery failed for a record to %s", topic)

    def _on_error(self, err: KafkaError) -> None:
        _rdkafka_log.warning("producer: %s", err.str())  # a client logger: rate-limited (logrates)

    # -- the event loop's side ---------------------------------------------------------------
    async def send(self, topic: str, value: bytes, key: bytes | None = None,
                   headers: list[tuple[str, bytes]] | None = None, partition: int | None = None) -> asyncio.Future:
        """Queue ``value`` on ``topic`` (full name), on ``partition`` if given (else where the
        partitioner puts its key). Returns a future of its ``Delivery``."""
        client = self._client
        if client is None:
            raise RuntimeError("send() before start()")
        fut = self._loop.create_future()  # type: ignore[union-attr]

        def delivered(err: KafkaError | None, msg: Any, fut: asyncio.Future = fut, n: int = len(value)) -> None:
            self._reports.append((fut, err, msg, topic, n))

        while True:
            try:
                if partition is None:
                    client.produce(topic, value, key, headers=headers, on_delivery=delivered)
                else:
                    client.produce(topic, value, key, partition, headers=headers, on_delivery=delivered)
                break
            except BufferError:  # librdkafka's queue is full: serve reports, wait for acknowledgements
                self._poll()
                await asyncio.sleep(0.005)
            except KafkaException as exc:
                raise _error(exc, f"sending {len(value)} bytes to {topic}") from None
        self._pending.add(fut)
        self._poll()
        self._arm(True)
        return fut

    async def partition_count(self, topic: str) -> int | None:
        """How many partitions ``topic`` (full name) has; None if the broker does not say (no
        such topic yet: the partitioner places the record). Asked once, then again in the
        background every ``PARTITIONS_TTL_S`` (a topic grown on Kafka is used in full after
        that) while sends go on with the count known; concurrent first sends share one request."""
        known = self._partitions.get(topic)
        if known is not None and time.monotonic() - known[1] < self.PARTITIONS_TTL_S:
            return known[0]
        asking = self._asking.get(topic)
        if asking is None:
            asking = self._asking[topic] = asyncio.ensure_future(self._ask_partitions(topic))
        return known[0] if known is not None else await asyncio.shield(asking)

    async def _ask_partitions(self, topic: str) -> int | None:
        try:
            client = self._client
            count = 0
            if client is not None:
                try:
                    md = await asyncio.to_thread(client.list_topics, topic, REQUEST_TIMEOUT_S)
                    meta = md.topics.get(topic)
                    count = len(meta.partitions) if meta is not None and meta.error is None else 0
                except KafkaException:
                    pass
            if count:
                self._partitions[topic] = (count, time.monotonic())
            known = self._partitions.get(topic)
            return known[0] if known is not None else None
        finally:
            self._asking.pop(topic, None)

    async def flush(self) -> None:
        """Return once every value queued so far is acknowledged (or has failed). Awaits the
        acknowledgements: the event loop goes on meanwhile."""
        pending = set(self._pending)
        if pending:
            await asyncio.wait(pending)


class KafkaConsumer:
    """A consumer-group member (``group`` set) that commits by hand, never automatically; with
    ``group=None`` it joins nothing and commits nothing (``Reader`` is built on that).

    ``topics``: full names. ``on_assigned`` / ``on_revoked`` are called with the set of
    partitions on every rebalance (revoked first, before they move: the place to commit what is
    finished; librdkafka waits for the callback, commit included). ``max_fetch_bytes``: the
    largest record it must be able to fetch. ``overrides``: librdkafka settings.

    Memory is bounded in bytes: librdkafka prefetches at most ``queued.max.messages.kbytes``
    (twice the largest fetch, at least 64 MB) whatever the number of partitions."""

    def __init__(self, config: BusConfig, topics: Sequence[str], group: str | None, *,
                 max_fetch_bytes: int, on_assigned: PartitionsCallback | None = None,
                 on_revoked: PartitionsCallback | None = None,
                 from_beginning: bool = True, **overrides: Any):
        c = config
        self.config, self.group, self.topics = config, group, list(topics)
        self._on_assigned, self._on_revoked = on_assigned, on_revoked
        self._reset = "earliest" if from_beginning else "latest"
        partition_bytes = max_fetch_bytes + 64 * 1024
        fetch_bytes = max(64 * 1024 * 1024, 2 * partition_bytes)
        self._settings: dict[str, Any] = dict(client_settings(c), **{
            "enable.auto.commit": False, "enable.auto.offset.store": False,
            "auto.offset.reset": self._reset,
            "session.timeout.ms": c.session_timeout_ms, "heartbeat.interval.ms": c.heartbeat_interval_ms,
            "max.poll.interval.ms": c.max_poll_interval_ms,
            "max.partition.fetch.bytes": partition_bytes, "fetch.max.bytes": fetch_bytes,
            "receive.message.max.bytes": fetch_bytes + 1024 * 1024,
            "queued.max.messages.kbytes": 2 * fetch_bytes // 1024})
        # no group.instance.id: static membership stalls joins. librdkafka wants a group.id even
        # for a consumer that only assigns; one that never subscribes nor commits joins nothing.
        self._settings["group.id"] = group if group is not None else f"{c.client_id}-no-group"
        self._settings.update(_overrides(overrides))
        self._client: ck.Consumer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._inbox: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._closed = False
        # Mirrors the event loop reads without asking the consumer thread.
        self._assignment: set[TopicPartition] = set()
        self._paused: set[TopicPartition] = set()  # paused for getmany
        self._held: set[TopicPartition] = set()  # paused in librdkafka too (consumer thread)
        self._pos: dict[TopicPartition, int] = {}  # next offset, once known here
        self._hw: dict[TopicPartition, int] = {}  # high watermark of the last fetch
        self._meta: dict[str, set[int]] = {}
        self._cluster_id: str | None = None  # from the first metadata answer
        self._leftover: list[Message] = []  # consumed from librdkafka, not yet handed out
        self._assigning: dict[TopicPartition, int] | None = None  # seeks asked during on_assign
        self._unfetched: set[TopicPartition] = set()  # assigned, no fetch answered yet
        self._lock = threading.Lock()
        self._pending_assign: dict[TopicPartition, int] | None = None  # assign() not yet in librdkafka
        self._settle_until = 0.0
        #: records held for paused partitions past this many bytes: librdkafka is paused too
        self.hold_bytes = fetch_bytes

    # -- the consumer thread -----------------------------------------------------------------
    def _serve(self) -> None:
        while not self._closed:
            item = self._inbox.get()
            if isinstance(item, tuple):  # not a callback's late wake-up
                self._run(item)

    def _run(self, item: tuple[Callable[[], Any], asyncio.Future | None, bool]) -> None:
        fn, fut, keep = item
        result, exc = None, None
        try:
            result = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            exc = _error(e)
        if fut is None:
            if exc is not None:
                log.warning("consumer: %s", exc)
            return
        try:
            self._loop.call_soon_threadsafe(self._resolve, fut, result, exc, keep)  # type: ignore[union-attr]
        except RuntimeError:  # loop closed
            pass

    def _resolve(self, fut: asyncio.Future, result: Any, exc: BaseException | None, keep: bool) -> None:
        if fut.cancelled():
            if keep and result:  # records librdkafka handed out: not lost with a cancelled getmany
                self._leftover.extend(result)
            return
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)

    def _call(self, fn: Callable[[], Any], keep: bool = False) -> asyncio.Future:
        """Run ``fn`` on the consumer thread, after everything queued before it."""
        if self._client is None or self._closed:
            raise RuntimeError("consumer not started, or stopped")
        fut = self._loop.create_future()  # type: ignore[union-attr]
        self._inbox.put((fn, fut, keep))
        return fut

    def _queue(self, fn: Callable[[], Any]) -> None:
        if self._client is not None and not self._closed:
            self._inbox.put((fn, None, False))

    def _on_loop(self, fn: Callable[[], Any]) -> None:
        """From the consumer thread: run ``fn`` (maybe a coroutine function) on the event loop
        and serve the operations it queues until it is done."""
        async def run() -> Any:
            return await _maybe_await(fn())

        try:
            done = asyncio.run_coroutine_threadsafe(run(), self._loop)  # type: ignore[arg-type]
        except RuntimeError:  # loop closed
            return
        # Served until this callback's own wake-up, which comes after every operation the
        # callback queued (a seek queued just before it finished is served here, not after).
        wake = object()
        done.add_done_callback(lambda _f: self._inbox.put(wake))
        while (item := self._inbox.get()) is not wake:
            if isinstance(item, tuple):
                self._run(item)
        if not done.cancelled() and done.exception() is not None:
            log.error("rebalance callback failed: %r", done.exception())

    def _assigned_cb(self, client: ck.Consumer, parts: list[ck.TopicPartition]) -> None:
        tps = _ours(parts)
        self._assigning = {}
        try:
            self._on_loop(lambda: self._after_assign(tps))
            client.assign([_ck_tp(tp, self._assigning.get(tp, _NO_OFFSET)) for tp in tps])
        finally:
            self._assigning = None
        self._held -= tps
        self._unfetched, self._settle_until = set(tps), time.monotonic() + SETTLE_S

    def _after_assign(self, tps: set[TopicPartition]) -> Any:
        self._assignment = set(tps)
        self._forget(tps)
        if self._on_assigned is not None:
            return self._on_assigned(set(tps))

    def _revoked_cb(self, client: ck.Consumer, parts: list[ck.TopicPartition]) -> None:
        tps = _ours(parts)
        self._on_loop(lambda: self._after_revoke(tps))
        self._held -= tps
        client.unassign()

    async def _after_revoke(self, tps: set[TopicPartition]) -> None:
        try:
            if self._on_revoked is not None and tps:
                await _maybe_await(self._on_revoked(set(tps)))
        finally:
            self._assignment -= tps
            self._forget(tps)

    def _forget(self, tps: set[TopicPartition]) -> None:
        """Drop what this client knew of ``tps`` (loop side)."""
        for tp in tps:
            self._pos.pop(tp, None)
            self._hw.pop(tp, None)
        self._paused -= tps
        self._leftover = [m for m in self._leftover if TopicPartition(m.topic, m.partition) not in tps]

    def _consume(self, n: int, timeout_s: float) -> list[Message]:
        """Up to ``n`` records within ``timeout_s``. Right after a group assignment, until every
        partition assigned (and not paused) has answered its first fetch or ``SETTLE_S`` has
        passed: librdkafka starts each partition's fetcher on its own, so a stage would
        otherwise see the records waiting on one partition before those waiting on another
        (one fetch across all partitions, as Kafka's Java client and aiokafka make it, does not)."""
        out = self._consume_once(n, timeout_s)
        while len(out) < n and time.monotonic() < self._settle_until and self._unfetched - self._paused:
            out += self._consume_once(n - len(out), 0.02)
        return out

    def _consume_once(self, n: int, timeout_s: float) -> list[Message]:
        client = self._client
        assert client is not None
        out: list[Message] = []
        # consume(n, timeout) waits for n records or the whole timeout; like aiokafka's getmany,
        # return as soon as there are some: wait for the first, then take what is already queued.
        first = client.poll(timeout_s)
        batch = [] if first is None else [first, *(client.consume(n - 1, 0) if n > 1 else ())]
        for m in batch:
            err = m.error()
            if err is not None:
                if err.code() != KafkaError._PARTITION_EOF:
                    _rdkafka_log.warning("consumer: %s", err.str())
                continue
            ts_type, ts = m.timestamp()
            msg = Message(m.topic(), m.partition(), m.offset(),
                           ts if ts_type != ck.TIMESTAMP_NOT_AVAILABLE else -1,
                           m.key(), m.value(), m.headers() or ())
            out.append(msg)
        for tp in list(self._assignment):
            try:
                hi = client.get_watermark_offsets(_ck_tp(tp), cached=True)[1]
            except KafkaException:
                continue
            if hi is not None and hi >= 0:
                self._hw[tp] = hi
                self._unfetched.discard(tp)
        return out

    def _on_error(self, err: KafkaError) -> None:
        _rdkafka_log.warning("consumer: %s", err.str())  # a client logger: rate-limited (logrates)

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self, subscribe: bool = True) -> "KafkaConsumer":
        """Connect; subscribe to ``topics`` (join the group) unless ``subscribe`` is False (then
        partitions are read only once ``assign``-ed). Without a group, subscribing reads every
        partition of ``topics`` that exists."""
        self._loop = asyncio.get_running_loop()
        self._client = ck.Consumer(dict(self._settings, error_cb=self._on_error))
        self._thread = threading.Thread(target=self._serve, name="streamrl-consumer", daemon=True)
        self._thread.start()
        try:
            if self.topics:
                await self._call(lambda: self._fetch_meta(None))
            if subscribe:
                if self.group is None:
                    self.assign([TopicPartition(t, p) for t in self.topics for p in sorted(self._meta.get(t, ()))])
                else:
                    await self._call(lambda: self._client.subscribe(  # type: ignore[union-attr]
                        self.topics, on_assign=self._assigned_cb, on_revoke=self._revoked_cb,
                        on_lost=self._revoked_cb))
        except BaseException:
            await self.stop()
            raise
        return self

    async def stop(self) -> None:
        """Leave the group (the revoke callback runs) and close, waiting at most
        ``STOP_TIMEOUT_S`` (a broker gone: librdkafka's close would wait for it).

        On the embedded broker a member stops without leaving (``leaves_group``): the stage
        committed what it finished before this, and the broker drops the member once its session
        times out (``bus.session_timeout_ms``), so its partitions move a few seconds later."""
        if self._client is None or self._closed:
            return
        thread = self._thread
        leave = self.leaves_group()

        def close() -> None:
            try:
                if leave:
                    self._client.close()  # type: ignore[union-attr]
                else:  # the last reference: confluent-kafka destroys it without consumer close
                    self._client = None
            finally:
                self._closed = True

        try:
            await asyncio.wait_for(asyncio.shield(self._call(close)), STOP_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("consumer: close did not finish in %.0f s; left to its thread", STOP_TIMEOUT_S)
            self._closed = True
            return
        if thread is not None:
            await asyncio.to_thread(thread.join, STOP_TIMEOUT_S)

    def leaves_group(self) -> bool:
        """Whether ``stop`` sends LeaveGroup: yes, except to the embedded broker. Its coordinator
        (Tansu 0.6) keeps a leader that leaves while its group rebalances as the leader for good:
        every later JoinGroup names that gone member, no member ever gets partitions, and the
        group's committed offsets are never read again (two members stopping together is enough:
        issue 43). A member that goes silent is dropped at its session timeout, leader included."""
        return self.group is not None and self._cluster_id not in NO_LEAVE_CLUSTERS

    # -- records -------------------------------------------------------------------------------
    def _take(self, want: set[TopicPartition], max_records: int | None) -> list[Message]:
        if not self._leftover:
            return []
        out: list[Message] = []
        keep: list[Message] = []
        for m in self._leftover:
            tp = TopicPartition(m.topic, m.partition)
            if ((max_records is None or len(out) < max_records) and tp not in self._paused
                    and (not want or tp in want)):
                out.append(m)
            else:
                keep.append(m)
        self._leftover = keep
        return out

    async def getmany(self, timeout_ms: int = 200, max_records: int | None = None,
                      partitions: Iterable[TopicPartition] = ()) -> list[Message]:
        """The records fetched so far (waiting up to ``timeout_ms`` for some), from
        ``partitions`` only if given."""
        want = set(partitions)
        out = self._take(want, max_records)
        if not out:
            n = min(max_records or 100_000, 1_000_000)
            got = await self._call(lambda: self._consume(n, timeout_ms / 1000), keep=True)
            self._leftover.extend(got)  # after the await: a rebalance callback may replace the list meanwhile
            out = self._take(want, max_records)
            if got and self._paused:
                self._hold_if_full()
        for m in out:
            self._pos[TopicPartition(m.topic, m.partition)] = m.offset + 1
        return out  # type: ignore[return-value]

    def _hold_if_full(self) -> None:
        """Pause librdkafka on the paused partitions whose records are held here, once those
        pass ``hold_bytes``."""
        held = {}
        size = 0
        for m in self._leftover:
            tp = TopicPartition(m.topic, m.partition)
            if tp in self._paused:
                held[tp] = True
                size += len(m.value or b"")
        if size < self.hold_bytes:
            return
        tps = set(held)

        def hold() -> None:
            tps_now = (tps & self._paused) - self._held
            if tps_now:
                self._client.pause([_ck_tp(tp) for tp in tps_now])  # type: ignore[union-attr]
                self._held |= tps_now

        self._queue(hold)

    async def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        """Commit ``offsets`` (the next offset to read, per partition); ``CommitFailed`` if the
        group has moved on (a rebalance) or the broker did not answer."""
        if not offsets or self.group is None:
            return

        def commit() -> None:
            done = self._client.commit(  # type: ignore[union-attr]
                offsets=[_ck_tp(tp, off) for tp, off in offsets.items()], asynchronous=False)
            for tp in done or ():
                if tp.error is not None:
                    raise KafkaException(tp.error)

        try:
            await self._call(commit)
        except (KafkaBusError, KafkaException, RuntimeError) as exc:
            raise CommitFailed(str(exc), unreachable=is_unreachable(exc)) from exc

    # -- positions ----------------------------------------------------------------------------
    def assignment(self) -> set[TopicPartition]:
        return set(self._assignment)

    def assign(self, partitions: Iterable[TopicPartition]) -> None:
        """Read exactly these partitions, without a group (replaces any earlier assignment,
        with fresh partition states)."""
        tps = list(partitions)
        self._forget(self._assignment | set(tps))
        self._assignment = set(tps)
        start = ck.OFFSET_BEGINNING if self._reset == "earliest" else ck.OFFSET_END
        # librdkafka refuses a seek until a partition's fetcher has started ("Erroneous state"),
        # so seeks asked before the assignment reaches librdkafka go with it, as its offsets.
        pending: dict[TopicPartition, int] = {tp: start for tp in tps}
        with self._lock:
            self._pending_assign = pending

        def assign() -> None:
            with self._lock:
                if self._pending_assign is pending:
                    self._pending_assign = None
                offsets = [_ck_tp(tp, off) for tp, off in pending.items()]
            self._held = set()
            if offsets:
                self._client.assign(offsets)  # type: ignore[union-attr]
            else:
                self._client.unassign()  # type: ignore[union-attr]

        self._queue(assign)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        """Read ``tp`` from ``offset`` next (in a rebalance callback too)."""
        self._pos[tp] = offset
        self._leftover = [m for m in self._leftover if (m.topic, m.partition) != tp]
        with self._lock:
            if self._pending_assign is not None and tp in self._pending_assign:
                self._pending_assign[tp] = offset  # not yet assigned in librdkafka: start there
                return

        def seek() -> None:
            if self._assigning is not None:  # inside on_assign: the offset goes with the assignment
                self._assigning[tp] = offset
            else:
                self._client.seek(_ck_tp(tp, offset))  # type: ignore[union-attr]

        self._queue(seek)

    async def position(self, tp: TopicPartition) -> int:
        if tp in self._pos:
            return self._pos[tp]

        def position() -> int:
            client = self._client
            at = client.position([_ck_tp(tp)])[0].offset  # type: ignore[union-attr]
            if at >= 0:
                return at
            if self.group is not None:
                at = client.committed([_ck_tp(tp)], timeout=REQUEST_TIMEOUT_S)[0].offset  # type: ignore[union-attr]
                if at >= 0:
                    return at
            lo, hi = client.get_watermark_offsets(_ck_tp(tp), timeout=REQUEST_TIMEOUT_S)  # type: ignore[union-attr]
            return lo if self._reset == "earliest" else hi

        return await self._call(position)

    def highwater(self, tp: TopicPartition) -> int | None:
        """The log end the last fetch of ``tp`` reported (exact on every broker); None before one."""
        return self._hw.get(tp)

    def pause(self, partitions: Iterable[TopicPartition]) -> None:
        """Hand out no records of ``partitions`` until resumed (lazily paused in librdkafka:
        see the module's docstring)."""
        tps = set(partitions) - self._paused
        if tps:
            self._paused = self._paused | tps

    def resume(self, partitions: Iterable[TopicPartition]) -> None:
        tps = set(partitions) & self._paused
        if tps:
            self._paused = self._paused - tps

            def resume() -> None:
                held = (tps & self._held) - self._paused
                if held:
                    self._held -= held
                    self._client.resume([_ck_tp(tp) for tp in held])  # type: ignore[union-attr]

            self._queue(resume)

    def paused(self) -> set[TopicPartition]:
        return set(self._paused)

    # -- metadata and offsets -----------------------------------------------------------------
    def _fetch_meta(self, topic: str | None) -> dict[str, set[int]]:
        md = self._client.list_topics(topic, timeout=REQUEST_TIMEOUT_S)  # type: ignore[union-attr]
        self._cluster_id = md.cluster_id
        got = {name: set(t.partitions) for name, t in md.topics.items() if t.error is None and t.partitions}
        self._meta.update(got)
        return got

    def partitions_for_topic(self, topic: str) -> set[int]:
        """The partition numbers of ``topic`` (full name) in the metadata this client already
        holds (no request; empty if it holds none)."""
        return set(self._meta.get(topic, ()))

    async def partitions(self, topic: str) -> list[TopicPartition]:
        """Every partition of ``topic`` (full name), from fresh metadata; ``LookupError`` if the
        broker has no such topic."""
        got = await self._call(lambda: self._fetch_meta(topic))
        if topic not in got:
            raise LookupError(f"topic {topic!r} does not exist on {self.config.bootstrap_servers}")
        return [TopicPartition(topic, p) for p in sorted(got[topic])]

    def _list_offsets(self, partitions: list[TopicPartition], at: int) -> dict[TopicPartition, int]:
        """ListOffsets for every partition in one request per broker (``at``: -1 the end, -2 the
        beginning; ``get_watermark_offsets`` would ask one partition per round trip)."""
        if not partitions:
            return {}
        got = self._client.offsets_for_times(  # type: ignore[union-attr]
            [_ck_tp(tp, at) for tp in partitions], timeout=REQUEST_TIMEOUT_S)
        for t in got:
            if t.error is not None:
                raise KafkaException(t.error)
        return {TopicPartition(t.topic, t.partition): t.offset for t in got}

    async def beginning_offsets(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        tps = list(partitions)
        return await self._call(lambda: self._list_offsets(tps, ck.OFFSET_BEGINNING))

    async def listed_end_offsets(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        """End offsets as the broker lists them. Not the log end on the embedded broker (see
        ``Reader.end_offsets``, which is exact everywhere)."""
        tps = list(partitions)
        return await self._call(lambda: self._list_offsets(tps, ck.OFFSET_END))

    async def offsets_for_times(self, partitions: Iterable[TopicPartition],
                                timestamp_ms: int) -> dict[TopicPartition, int | None]:
        """Per partition, the first offset whose record's timestamp is at or after
        ``timestamp_ms`` (None: no record that late)."""
        tps = list(partitions)
        got = await self._call(lambda: self._client.offsets_for_times(  # type: ignore[union-attr]
            [_ck_tp(tp, timestamp_ms) for tp in tps], timeout=REQUEST_TIMEOUT_S))
        return {TopicPartition(t.topic, t.partition): (t.offset if t.offset >= 0 else None) for t in got}

    async def probe(self) -> None:
        """Ask the broker for metadata; raises if it does not answer."""
        await self._call(lambda: self._client.list_topics(timeout=5.0))  # type: ignore[union-attr]


class KafkaAdmin:
    """Topic and group administration (``base.Admin``). ``async with bus.admin() as admin: ...``
    Every call runs on a worker thread (librdkafka's admin calls block)."""

    def __init__(self, config: BusConfig):
        self.config = config
        self._client: AdminClient | None = None

    async def __aenter__(self) -> "KafkaAdmin":
        self._client = AdminClient(client_settings(self.config))
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._client = None

    async def _metadata(self) -> Any:
        try:
            return await asyncio.to_thread(self._client.list_topics, timeout=REQUEST_TIMEOUT_S)  # type: ignore[union-attr]
        except KafkaException as exc:
            raise _error(exc, f"metadata from {self.config.bootstrap_servers}") from None

    async def list_topics(self) -> set[str]:
        return set((await self._metadata()).topics)

    async def create_topics(self, topics: Mapping[str, TopicSettings]) -> None:
        """Create each topic (full name) with its settings; ``bus.replication_factor``, when
        set, overrides theirs. One that already exists (another creator won a race) is not an
        error; any other refusal raises ``RuntimeError`` naming the topic."""
        if not topics:
            return
        rf = self.config.replication_factor
        futures = self._client.create_topics([  # type: ignore[union-attr]
            _KafkaNewTopic(name, t.partitions, rf or t.replication_factor, config=dict(t.config))
            for name, t in topics.items()], request_timeout=REQUEST_TIMEOUT_S)
        for topic, fut in futures.items():
            try:
                await asyncio.wrap_future(fut)
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                if isinstance(err, KafkaError) and err.code() == KafkaError.TOPIC_ALREADY_EXISTS:
                    continue
                raise RuntimeError(f"creating topic {topic} failed: {_error(exc)}") from None

    async def partition_counts(self, topics: Sequence[str]) -> dict[str, int]:
        """The number of partitions of each of ``topics`` that exists."""
        if not topics:
            return {}
        md = (await self._metadata()).topics
        return {t: len(md[t].partitions) for t in topics if t in md and md[t].error is None}

    async def topic_configs(self, topics: Sequence[str]) -> dict[str, dict[str, str]]:
        """Each topic's configuration, as the broker reports it."""
        if not topics:
            return {}
        futures = self._client.describe_configs(  # type: ignore[union-attr]
            [ConfigResource("topic", t) for t in topics], request_timeout=REQUEST_TIMEOUT_S)
        out: dict[str, dict[str, str]] = {}
        for resource, fut in futures.items():
            entries = await asyncio.wrap_future(fut)
            out[resource.name] = {name: e.value for name, e in entries.items()}
        return out

    async def committed(self, group: str, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int | None]:
        """The offsets ``group`` has committed on ``partitions`` (None: none), asked the way a
        member asks (OffsetFetch from a consumer that joins nothing): the embedded broker's
        answer to the admin call does not decode."""
        tps = list(partitions)

        def ask() -> list[ck.TopicPartition]:
            client = ck.Consumer(dict(client_settings(self.config), **{"group.id": group, "enable.auto.commit": False}))
            try:
                return client.committed([_ck_tp(tp) for tp in tps], timeout=REQUEST_TIMEOUT_S)
            finally:
                client.close()

        got = {TopicPartition(t.topic, t.partition): t.offset for t in await asyncio.to_thread(ask)}
        return {tp: (got[tp] if got.get(tp, -1) >= 0 else None) for tp in tps}
