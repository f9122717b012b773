"""Reading a range of a topic as a plain reader: no consumer group, no commits.

A ``streamrl.bus.Reader`` reads every partition of the topic, so replay never joins a group and
never moves a production group's committed offsets. It takes each partition's exact end when it
starts and stops there: records produced later are not part of the replay, and a replay of a
live topic ends.

Bounds (``--from`` / ``--to``, both inclusive, any number of each, all must hold):

- ``offset:N``  the partition offset, in every partition;
- ``time:T``    the record's own time, T in unix seconds or ISO 8601 (no zone: UTC). The record's
  time is ``scored_at`` for rewarded records and ``created_at`` otherwise. The broker's
  offsets-for-times lookup is used only to skip ahead (from ``T - TIME_SEEK_SLACK_S``), never to
  decide what is in range: on the embedded broker it maps every time to offset 0, which merely
  reads more;
- ``version:N`` the record's ``policy_version``.

Messages that cannot be decoded are kept as failures with their reason; duplicates (the same
``id`` again, e.g. a redelivery) are counted and the copy at the lowest (partition, offset) is
kept, so the outcome does not depend on the order fetches arrive in.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from streamrl.bus import Bus, Reader
from streamrl.records import DeadLetter, RecordError, Rewarded, Trajectory, decode_any

STAGE = "replay"
BOUND_KINDS = ("offset", "time", "version")
#: Seek this much earlier than a ``time:`` lower bound. A record is produced after its own time
#: (scoring, a group hook's wait), so its Kafka timestamp is later and the broker's lookup is a
#: safe lower bound; the slack covers clocks that differ (LogAppendTime topics, other hosts).
TIME_SEEK_SLACK_S = 600.0
_TOKEN_ARRAYS = ("prompt_ids", "response_ids", "response_logprobs", "response_mask")


class BoundError(ValueError):
    """A ``--from`` / ``--to`` value that cannot be read; the message says what is expected."""


@dataclass(frozen=True)
class Bound:
    kind: str  # offset | time | version
    value: float

    def __str__(self) -> str:
        if self.kind == "time":
            return f"time:{datetime.fromtimestamp(self.value, timezone.utc).isoformat()}"
        return f"{self.kind}:{int(self.value)}"


def parse_bound(text: str) -> Bound:
    """``offset:N``, ``time:UNIX_SECONDS``, ``time:ISO8601`` or ``version:N``."""
    kind, sep, value = text.partition(":")
    if not sep or kind not in BOUND_KINDS or not value:
        raise BoundError(f"bound {text!r}: expected offset:N, time:UNIX_SECONDS|ISO8601 or version:N")
    if kind == "time":
        try:
            return Bound(kind, float(value))
        except ValueError:
            pass
        try:
            when = datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            raise BoundError(f"bound {text!r}: {value!r} is neither unix seconds nor ISO 8601") from None
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        return Bound(kind, when.timestamp())
    try:
        number = int(value)
    except ValueError:
        raise BoundError(f"bound {text!r}: {value!r} is not a whole number") from None
    if number < 0:
        raise BoundError(f"bound {text!r}: must be >= 0")
    return Bound(kind, number)


@dataclass(frozen=True)
class Range:
    """What to read: the conjunction of lower (``lo``) and upper (``hi``) bounds, inclusive."""

    lo: tuple[Bound, ...] = ()
    hi: tuple[Bound, ...] = ()

    def _limit(self, kind: str, upper: bool) -> float | None:
        values = [b.value for b in (self.hi if upper else self.lo) if b.kind == kind]
        if not values:
            return None
        return min(values) if upper else max(values)

    def offsets(self) -> tuple[int | None, int | None]:
        lo, hi = self._limit("offset", False), self._limit("offset", True)
        return (None if lo is None else int(lo)), (None if hi is None else int(hi))

    def seek_time(self) -> float | None:
        lo = self._limit("time", False)
        return None if lo is None else lo - TIME_SEEK_SLACK_S

    def contains(self, record: Trajectory) -> bool:
        """Whether the record's own time and version are within the bounds."""
        when = record_time(record)
        for kind, value in (("time", when), ("version", record.policy_version)):
            lo, hi = self._limit(kind, False), self._limit(kind, True)
            if (lo is not None and value < lo) or (hi is not None and value > hi):
                return False
        return True

    def describe(self) -> dict[str, list[str]]:
        return {"from": [str(b) for b in self.lo], "to": [str(b) for b in self.hi]}


def record_time(record: Trajectory) -> float:
    """The record's own time: when it was scored (rewarded records), else created."""
    return record.scored_at if isinstance(record, Rewarded) else record.created_at


@dataclass
class Located:
    """A decoded record and where it was read."""

    record: Trajectory
    partition: int | None  # None: not read from a topic (generated)
    offset: int | None


@dataclass
class Failure:
    """A message or record that could not be replayed, and why."""

    stage: str  # decode | score | generate
    reason: str
    detail: str
    partition: int | None = None
    offset: int | None = None
    id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.stage, "reason": self.reason, "detail": self.detail,
                "partition": self.partition, "offset": self.offset, "id": self.id}


@dataclass
class ReadResult:
    topic: str
    window: dict[int, tuple[int, int]]  # partition -> (first offset read, stop offset)
    messages: int = 0  # messages read in the offset window
    skipped: int = 0  # decoded, outside the time / version bounds
    duplicates: int = 0  # in range, an id seen before
    records: list[Located] = field(default_factory=list)  # unique, in range, sorted by id
    failures: list[Failure] = field(default_factory=list)  # decode failures, by (partition, offset)


def decode(value: bytes | None) -> Trajectory:
    """A rewarded record or a trajectory, by its ``schema`` field; ``RecordError`` otherwise."""
    return decode_any(value, (Rewarded, Trajectory))  # type: ignore[return-value]


async def read_range(bus: Bus, topic: str, bounds: Range = Range(), *, keep_arrays: bool = False,
                     progress: Any = None) -> ReadResult:
    """Read ``topic`` (short name) within ``bounds``. Token arrays are dropped unless
    ``keep_arrays`` (scorers read text; a replay of a long run holds every record in memory).
    ``progress``: a tqdm bar, updated per message. ``LookupError`` if the topic does not exist."""
    async with Reader(bus, [topic], STAGE) as reader:
        tps = reader.partitions
        begin = await reader.beginning_offsets()
        end = await reader.end_offsets()
        lo, hi = bounds.offsets()
        start = {tp: max(begin[tp], lo or 0) for tp in tps}
        stop = {tp: end[tp] if hi is None else min(end[tp], hi + 1) for tp in tps}
        seek_time = bounds.seek_time()
        if seek_time is not None:
            for tp, at in (await reader.offsets_for_times(seek_time)).items():
                if at is None:  # no record that late: nothing in range there
                    stop[tp] = start[tp]
                else:
                    start[tp] = max(start[tp], at)
        result = ReadResult(topic=bus.topic(topic),
                            window={tp.partition: (start[tp], max(start[tp], stop[tp])) for tp in tps})
        if progress is not None:
            progress.total = sum(max(0, stop[tp] - start[tp]) for tp in tps)
            progress.refresh()
        found: list[Located] = []
        async for batch in reader.read(start, stop):
            for msg in batch:
                result.messages += 1
                _take(msg, bounds, keep_arrays, found, result)
            if progress is not None:
                progress.update(len(batch))
    result.records = _unique(found, result)
    result.failures.sort(key=lambda f: (f.partition, f.offset))
    return result


def _take(msg: Any, bounds: Range, keep_arrays: bool, found: list[Located], result: ReadResult) -> None:
    try:
        record = decode(msg.value)
    except RecordError as exc:
        result.failures.append(Failure("decode", exc.reason, exc.detail, msg.partition, msg.offset))
        return
    if not bounds.contains(record):
        result.skipped += 1
        return
    if not keep_arrays:
        record = replace(record, **{k: None for k in _TOKEN_ARRAYS})
    found.append(Located(record, msg.partition, msg.offset))


def _unique(found: list[Located], result: ReadResult) -> list[Located]:
    """One copy per id (the lowest (partition, offset)), sorted by id."""
    first: dict[str, Located] = {}
    for loc in sorted(found, key=lambda x: (x.partition, x.offset)):
        if loc.record.id in first:
            result.duplicates += 1
        else:
            first[loc.record.id] = loc
    return [first[k] for k in sorted(first)]


# -- archives (``streamrl.archive``): the same reading, from Parquet files instead of a topic ----

def _from_dict(obj: dict[str, Any]) -> Trajectory:
    cls = {Rewarded.SCHEMA: Rewarded, Trajectory.SCHEMA: Trajectory}.get(obj.get("schema"))
    if cls is None:
        raise RecordError("schema", f"schema is {obj.get('schema')!r}, expected a trajectory or rewarded record")
    return cls.from_dict(obj)  # type: ignore[return-value]


def read_archive(uri: str, topic: str, bounds: Range = Range(), *, keep_arrays: bool = False,
                 progress: Any = None) -> ReadResult:
    """``read_range`` from an archive (a path or fsspec URI) instead of a broker: the same
    bounds (``offset:`` is the record's offset in its topic, kept in the archive), failures,
    and de-duplication by ``id`` (a restarted archive stage may have written a record twice)."""
    from streamrl.archive import store

    short = topic.rsplit(".", 1)[-1]  # the archive keeps short names, whatever the prefix was
    paths = store.files(uri, short)
    if not paths:
        raise FileNotFoundError(f"no {short} files in the archive {uri} (expected {uri.rstrip('/')}/{short}/*.parquet)")
    lo, hi = bounds.offsets()
    result = ReadResult(topic=short, window={})
    found: list[Located] = []
    if progress is not None:
        progress.total = len(paths)
        progress.refresh()
    for table in store.read_tables(uri, short):
        for i, (p, o) in enumerate(zip(table.column("partition").to_pylist(), table.column("offset").to_pylist())):
            if (lo is not None and o < lo) or (hi is not None and o > hi):
                continue
            result.messages += 1
            first, stop = result.window.get(p, (o, o + 1))
            result.window[p] = (min(first, o), max(stop, o + 1))
            try:
                record = _from_dict(store.record_dict(table, i, keep_arrays))
            except RecordError as exc:
                result.failures.append(Failure("decode", exc.reason, exc.detail, p, o))
                continue
            if bounds.contains(record):
                found.append(Located(record, p, o))
            else:
                result.skipped += 1
        if progress is not None:
            progress.update(1)
    result.records = _unique(found, result)
    result.failures.sort(key=lambda f: (f.partition, f.offset))
    return result


def archive_dead_letters(uri: str) -> list[tuple[str, str]]:
    """(stage, reason) of every dead letter in an archive, one per letter."""
    from streamrl.archive import store

    seen: dict[str, tuple[str, str]] = {}
    for table in store.read_tables(uri, "deadletter", columns=["id", "stage", "reason"]):
        for i, s, r in zip(*(table.column(c).to_pylist() for c in ("id", "stage", "reason"))):
            seen.setdefault(i, (s, r))
    return list(seen.values())


async def topic_dead_letters(bus: Bus) -> list[tuple[str, str]]:
    """(stage, reason) of every dead letter on the dead-letter topic, as it is now."""
    out: list[tuple[str, str]] = []
    async with Reader(bus, ["deadletter"], STAGE) as reader:
        async for batch in reader.read(await reader.beginning_offsets(), await reader.end_offsets()):
            for msg in batch:
                try:
                    letter = DeadLetter.decode(msg.value, DeadLetter.size_limit(bus.config.max_record_bytes))
                except RecordError as exc:
                    out.append(("?", f"unreadable ({exc.reason})"))
                    continue
                out.append((letter.stage, letter.reason))
    return out


def find_archive(out_dir: str = "runs", cwd: str = ".") -> str | None:
    """The archive a replay with neither ``--archive`` nor a broker reads: ``./archive`` when
    run inside a run directory, else the newest run's (``<out_dir>/<run id>/archive``, where
    ``streamrl run`` / ``make run`` left it); None if there is none."""
    from streamrl.archive import store

    here = Path(cwd) / "archive"
    if here.is_dir() and store.is_archive(str(here)):
        return str(here)
    runs = Path(cwd) / out_dir
    if not runs.is_dir():
        return None
    for run in sorted((p for p in runs.iterdir() if p.is_dir()), key=lambda p: p.name, reverse=True):
        if (run / "archive").is_dir() and store.is_archive(str(run / "archive")):
            return str(run / "archive")
    return None
