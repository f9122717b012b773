"""The archive stage: its own consumer group on ``rollouts``, ``rewarded`` and ``deadletter``,
writing every record to Parquet files (``store``) so that replay works after the broker (or its
retention) is gone.

Commit order is the bus's ("flush outputs, then commit"), with a file as the output: records
are buffered per topic, a file is written when a topic's buffer reaches ``archive.roll_bytes``
or its oldest record has waited ``archive.roll_seconds``, and only once the file is durable are
its records marked finished, so the next ``Checkpoint`` commits past them. A record the archive's
schema cannot hold goes to dead letters (stage ``archive``, its reason) and counts as finished
once that letter is acknowledged. A crash re-reads what was not committed: a record may be in
two files, and readers keep one per ``id`` (at-least-once, like every sink here).

On stop the stage reads on until every partition it owns is read to its end (or
``archive.drain_timeout_s``), writes what it holds and commits: ``streamrl run`` stops it after
the other stages, so the run's archive holds everything they wrote.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import time
from collections import Counter
from typing import ClassVar, Protocol

import pyarrow as pa

from streamrl import metrics
from streamrl.archive.config import ArchiveConfig
from streamrl.archive.store import REWARD_CONFIG, ArchiveError, Batch, Writer, to_row
from streamrl.bus import Bus, Checkpoint, Message, TopicPartition
from streamrl.config import BusConfig
from streamrl.errors import StorageFull, storage_full
from streamrl.reward.config import RewardConfig

log = logging.getLogger(__name__)

STAGE = "archive"
#: A file write that fails (object store unreachable) is retried this often, with backoff, before
#: the stage exits (and is restarted): its records stay uncommitted meanwhile, so nothing is lost.
WRITE_ATTEMPTS = 6


def release_free_memory() -> None:
    """Hand the allocators' free pages back to the system: Arrow's pool (mimalloc or jemalloc:
    the file's buffers) and glibc's arenas (``malloc_trim``; nothing where there is no glibc).
    The stage holds a file's worth of records (``roll_bytes`` or ``roll_seconds``, more after a
    burst of lag) and frees it when the file is written; both allocators keep what was freed,
    glibc while anything allocated after it lives on, so the process's resident memory followed
    the largest batch it ever held, up with each new peak (issue 68: +40 MB per 1,000 versions,
    its Python objects flat under tracemalloc; ``MALLOC_ARENA_MAX=2`` kept as much)."""
    pa.default_memory_pool().release_unused()
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes, _LIBC.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to hand back this way
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC: ctypes.CDLL | bool | None = None


class ArchiveSections(Protocol):
    """What the archive reads of the pipeline's config (a ``PipelineConfig`` is one): its own
    section, the bus's, and the reward table it records beside the records."""

    bus: BusConfig
    archive: ArchiveConfig
    reward: RewardConfig


def _reward_yaml(cfg: ArchiveSections) -> str:
    """The config's ``reward:`` section as YAML (names of environment variables, never secrets)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml({"reward": OmegaConf.structured(cfg.reward)})


class ArchiveStage:
    """Build with a config (``archive.uri`` checked: a bad one raises ``ConfigError`` before
    anything connects), then ``await run(stop_event)``."""

    name: ClassVar[str] = STAGE

    def __init__(self, cfg: ArchiveSections, bus: Bus | None = None):
        self.cfg, self.ac = cfg, cfg.archive
        self.group = cfg.bus.group(STAGE, cfg.archive.group)
        self.bus = bus or Bus(cfg.bus)
        self.batches: dict[str, Batch] = {}
        self.written: Counter[str] = Counter()  # records in durable files, per topic
        self.files = 0
        self.dead_letters = 0
        self.writer: Writer | None = None

    @classmethod
    def from_config(cls, cfg: ArchiveSections, bus: Bus) -> "ArchiveStage":
        return cls(cfg, bus)

    def validate(self) -> None:
        self.ac.validate()

    def describe(self) -> str:
        done = ", ".join(f"{t} {n}" for t, n in sorted(self.written.items())) or "nothing yet"
        return (f"group {self.group}, {', '.join(self.ac.topics)} -> {self.ac.uri} "
                f"({done}; {self.files} files, {self.dead_letters} dead letters)")

    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        self.writer = Writer(self.ac.uri, self.ac.compression)
        await asyncio.to_thread(self.writer.write_text, REWARD_CONFIG, _reward_yaml(self.cfg))
        self.producer = self.bus.producer(STAGE)  # dead letters
        self.consumer = self.bus.consumer(self.ac.topics, self.group, STAGE, on_revoked=self._revoked)
        self.checkpoint = Checkpoint(self.consumer, self.producer)
        await self.producer.start()
        await self.consumer.start()
        clean = False
        try:
            last_commit = time.monotonic()
            while not stop.is_set():
                await self._take(await self.consumer.getmany(timeout_ms=200, max_records=2000))
                await self._roll()
                if time.monotonic() - last_commit >= self.cfg.bus.commit_interval_s:
                    await self.checkpoint.commit()
                    last_commit = time.monotonic()
            await self._drain()
            clean = True
        finally:
            try:
                if clean:
                    await self._roll(everything=True)
                    await self.checkpoint.commit()
            finally:
                await self.consumer.stop()
                await self.producer.stop()

    # -- records in -------------------------------------------------------------------------------
    async def _take(self, msgs: list[Message]) -> None:
        now = time.monotonic()
        for msg in msgs:
            tp = TopicPartition(msg.topic, msg.partition)
            self.checkpoint.take(tp, msg.offset, msg.timestamp)
            topic = self.cfg.bus.short_topic(msg.topic)
            try:
                row = to_row(topic, msg.partition, msg.offset, msg.timestamp, msg.value)
            except ArchiveError as exc:
                ack = await self.producer.dead_letter(reason=exc.reason, detail=exc.detail, message=msg)
                self.checkpoint.done_when_acked(ack, tp, msg.offset)
                self.dead_letters += 1
                continue
            self.batches.setdefault(topic, Batch(topic)).add(row, now, (tp, msg.offset))
        metrics.ARCHIVE_BUFFERED.set(sum(len(b.rows) for b in self.batches.values()))

    async def _drain(self) -> None:
        """Read on until every owned partition is read to its end (or the drain timeout)."""
        deadline = time.monotonic() + self.ac.drain_timeout_s
        while time.monotonic() < deadline:
            msgs = await self.consumer.getmany(timeout_ms=300, max_records=2000)
            await self._take(msgs)
            await self._roll()
            if not msgs and await self._at_end():
                return
        log.warning("archive: stopped after %.0f s of draining with records left to read; "
                    "they are read again at the next start", self.ac.drain_timeout_s)

    async def _at_end(self) -> bool:
        owned = self.consumer.assignment()
        for tp in owned:
            end = self.consumer.highwater(tp)
            if end is None or await self.consumer.position(tp) < end:
                return False
        return True

    # -- files out --------------------------------------------------------------------------------
    async def _roll(self, everything: bool = False) -> None:
        """Write each topic's batch that is full or old enough (every one: ``everything``)."""
        now = time.monotonic()
        due = [topic for topic, batch in self.batches.items() if batch.rows and (
            everything or batch.bytes >= self.ac.roll_bytes or now - batch.started >= self.ac.roll_seconds)]
        for topic in due:
            await self._write(self.batches.pop(topic))  # its rows are freed once written
        if due:
            release_free_memory()
        metrics.ARCHIVE_BUFFERED.set(sum(len(b.rows) for b in self.batches.values()))

    async def _write(self, batch: Batch) -> None:
        assert self.writer is not None
        delay = 0.5
        for attempt in range(1, WRITE_ATTEMPTS + 1):
            started = time.monotonic()
            try:
                path, size = await asyncio.to_thread(lambda: self.writer.write(batch.topic, batch.table()))
                break
            except OSError as exc:
                if attempt == WRITE_ATTEMPTS:
                    if storage_full(exc):  # a restart would meet the same wall: stop the run, naming it
                        raise StorageFull(f"archive: {len(batch.rows)} {batch.topic} records did not fit in "
                                          f"{self.ac.uri} ({exc}): free space there, then resume the run "
                                          "(`streamrl run --resume`); they were not committed: read again "
                                          "where the broker still holds them") from exc
                    raise
                log.warning("archive: writing %d %s records failed (%s); retrying in %.1f s",
                            len(batch.rows), batch.topic, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
        metrics.ARCHIVE_WRITE_SECONDS.labels(batch.topic).observe(time.monotonic() - started)
        metrics.ARCHIVE_FILES.labels(batch.topic).inc()
        metrics.ARCHIVE_BYTES.labels(batch.topic).inc(size)
        metrics.ARCHIVE_RECORDS.labels(batch.topic).inc(len(batch.rows))
        for tp, offset in batch.marks:
            self.checkpoint.done(tp, offset)
        self.written[batch.topic] += len(batch.rows)
        self.files += 1
        log.info("archive: %s (%d records, %d bytes)", path, len(batch.rows), size)

    async def _revoked(self, revoked: set[TopicPartition]) -> None:
        """Before partitions move: write what is buffered (their records included), commit them,
        forget them. Rows of other partitions are written early, which is harmless."""
        if revoked:
            await self._roll(everything=True)
            await self.checkpoint.commit(revoked)
            self.checkpoint.forget(revoked)
