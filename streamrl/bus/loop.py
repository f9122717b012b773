"""``StageLoop``, the loop every consuming stage runs."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Generic, Iterable, TypeVar

from streamrl import metrics
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_exponential

from streamrl.bus.checkpoint import Checkpoint, OnCommit
from streamrl.bus.base import Message, PartitionsCallback, TopicPartition
from streamrl.bus.client import Bus, Producer
from streamrl.errors import Failure
from streamrl.records import RecordError, _Record
from streamrl.topics import Topic

log = logging.getLogger(__name__)

R = TypeVar("R")


#: A stage's work on one record: its outputs, each sent to its type's topic.
Handler = Callable[[R, Message], Awaitable[Iterable[_Record]]]
#: Where a record's outputs go: outputs given the same number share a partition (``Producer.send``).
Spread = Callable[[Message], int]


class StageLoop(Generic[R]):
    """The loop of a consuming stage: the framework owns it, a stage supplies ``decode`` and
    ``handle``.

    For each message of ``source``: ``decode`` (default: the topic's record type's; a
    ``RecordError`` sends the original bytes to dead letters), then ``handle(record, message)``
    concurrently, at most ``max_in_flight`` at once; it returns the output records (each goes
    to its type's topic) or raises ``Failure``. A record is finished when its
    outputs (or its dead letter) are acknowledged; every ``commit_interval_s`` a ``Checkpoint``
    commits up to the lowest unfinished one. While ``max_in_flight`` records are unfinished the
    loop stops fetching (back-pressure) but keeps the group membership alive. ``spread(message)``
    (if given) picks the partition of a record's outputs (``Producer.send``); else their key's
    hash does. On ``stop()``:
    stop fetching, let in-flight records finish for up to ``drain_timeout_s``, then checkpoint
    and leave the group. Unfinished records are redelivered to whoever takes over.
    Build it inside a running event loop (the Kafka clients bind to it).
    """

    def __init__(self, bus: Bus, *, stage: str, source: Topic[R] | str, group: str,
                 handle: Handler, decode: Callable[[bytes], R] | None = None, max_in_flight: int = 64,
                 drain_timeout_s: float = 30.0, producer: Producer | None = None,
                 on_assign: PartitionsCallback | None = None,
                 on_revoke: PartitionsCallback | None = None, on_commit: OnCommit | None = None,
                 spread: Spread | None = None):
        self.bus, self.stage, self.group = bus, stage, group
        self.spread = spread
        if decode is None:
            if not isinstance(source, Topic):
                raise TypeError("StageLoop: give decode, or a source Topic whose records it decodes")
            limit = bus.config.max_record_bytes
            decode = lambda data: source.decode(data, limit)  # noqa: E731
        self.decode, self.handle = decode, handle
        self.max_in_flight, self.drain_timeout_s = max_in_flight, drain_timeout_s
        self.producer = producer or bus.producer(stage)
        self._own_producer = producer is None
        self.consumer = bus.consumer([source], group, stage, on_assigned=on_assign,
                                     on_revoked=self._revoked)
        self.checkpoint = Checkpoint(self.consumer, self.producer, on_commit)
        self._on_revoke = on_revoke
        self._tasks: set[asyncio.Task] = set()
        self._by_partition: dict[TopicPartition, set[asyncio.Task]] = {}
        self._slot_free = asyncio.Event()
        self._stopping = asyncio.Event()
        self.finished = 0

    def stop(self) -> None:
        self._stopping.set()

    async def run_until(self, stop: asyncio.Event | None) -> None:
        """``run``, stopped (drained, committed) when ``stop`` is set; None: until ``stop()``."""
        task = asyncio.create_task(self.run())
        if stop is not None:
            stopper = asyncio.create_task(stop.wait())
            await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
            stopper.cancel()
            self.stop()
        await task

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
                    self.consumer.pause(self.consumer.assignment())
                    await self.consumer.getmany(timeout_ms=0)  # keeps the member alive
                    try:
                        await asyncio.wait_for(self._slot_free.wait(), 0.5)
                    except asyncio.TimeoutError:
                        pass
                else:
                    paused = self.consumer.paused()
                    if paused:
                        self.consumer.resume(paused)
                    for msg in await self.consumer.getmany(timeout_ms=100, max_records=free):
                        self._start(msg)
                if time.monotonic() - last_commit >= self.bus.config.commit_interval_s:
                    await self.commit()
                    last_commit = time.monotonic()
        finally:
            await self._drain()
            await self.commit()
            await self.consumer.stop()
            if self._own_producer:
                await self.producer.stop()

    def _start(self, msg: Message) -> None:
        tp = TopicPartition(msg.topic, msg.partition)
        self.checkpoint.take(tp, msg.offset, msg.timestamp)
        task = asyncio.create_task(self._process(msg, tp))
        self._tasks.add(task)
        self._by_partition.setdefault(tp, set()).add(task)
        metrics.BUS_IN_FLIGHT.labels(self.stage).set(len(self._tasks))
        task.add_done_callback(lambda t: self._task_done(t, tp))

    def _task_done(self, task: asyncio.Task, tp: TopicPartition) -> None:
        self._tasks.discard(task)
        self._by_partition.get(tp, set()).discard(task)
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
                except Failure as exc:
                    failure = exc  # the lambda may run after the except clause unbinds ``exc``
                    await self._send_until_acked(lambda: [self.producer.dead_letter(
                        reason=failure.reason, detail=failure.detail, message=msg,
                        record_id=getattr(record, "id", None))])
                else:
                    spread = self.spread(msg) if self.spread is not None else None
                    await self._send_until_acked(lambda: [self.producer.send(out, spread=spread) for out in outputs])
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
        self.checkpoint.done(tp, msg.offset)
        self.finished += 1
        metrics.BUS_HANDLER_SECONDS.labels(self.stage).observe(time.monotonic() - started)
        metrics.CONSUMER_LAST_PROGRESS.labels(self.stage, self.group).set(time.time())

    async def _send_until_acked(self, sends: Callable[[], list[Awaitable[asyncio.Future]]]) -> None:
        """Send a record's outputs and wait for every acknowledgement. A transient Kafka error
        (leader change, timeout, broker restarting) is waited out with backoff and the outputs
        are sent again (a duplicate downstream is fine: sinks are idempotent); only a permanent
        error reaches the caller, which dead-letters the record."""
        retrying = AsyncRetrying(retry=retry_if_exception(self.bus.is_transient), reraise=True,
                                 wait=wait_exponential(multiplier=0.2, max=30.0),
                                 before_sleep=self._retrying)
        async for attempt in retrying:
            with attempt:
                acks = [await send for send in sends()]
                await asyncio.gather(*acks)

    def _retrying(self, state: RetryCallState) -> None:
        metrics.BUS_SEND_RETRIES.labels(self.stage).inc()
        exc = state.outcome.exception()
        log.warning("%s: transient send error (%s: %s); retrying in %.1f s", self.stage,
                    type(exc).__name__, exc, state.next_action.sleep)

    async def commit(self, tps: Iterable[TopicPartition] | None = None) -> None:
        """Checkpoint what is finished on ``tps`` (default: every partition assigned)."""
        await self.checkpoint.commit(tps)

    async def _revoked(self, revoked: set[TopicPartition]) -> None:
        """Commit what is finished before partitions move, cancel what is still in flight on
        them (the new owner redoes it: nothing of it was committed), forget them after."""
        if revoked:
            await self.commit(revoked)
            cancelled = [t for tp in revoked for t in self._by_partition.pop(tp, set())]
            for task in cancelled:
                task.cancel()
            if cancelled:
                await asyncio.wait(cancelled)
                log.info("%s: %d records in flight on revoked partitions handed over", self.stage, len(cancelled))
            self.checkpoint.forget(revoked)
            if self._on_revoke:
                result = self._on_revoke(revoked)
                if asyncio.iscoroutine(result):
                    await result

    async def _drain(self) -> None:
        if not self._tasks:
            return
        done, pending = await asyncio.wait(set(self._tasks), timeout=self.drain_timeout_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)
