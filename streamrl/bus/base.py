"""What a transport is: the bytes-level interface the Kafka client (``kafka``) and the in-memory
broker (``memory``) both implement, and everything above them (``records``, ``reader``,
``checkpoint``, ``loop``) is written against. Topics are full names here, values are bytes:
nothing of streamrl's records or metrics.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Iterable, Mapping, NamedTuple, Protocol, Sequence


class TopicPartition(NamedTuple):
    """One partition of a topic (full name). Equal to, and hashed like, the Kafka client's own."""

    topic: str
    partition: int


class Message(NamedTuple):
    """One record as a consumer hands it out (either transport builds these)."""

    topic: str
    partition: int
    offset: int
    timestamp: int  # ms since the epoch; -1: none
    key: bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes]] = ()


class Delivery(Protocol):
    """Where the broker stored a produced record."""

    topic: str
    partition: int
    offset: int


#: A rebalance callback: the partitions assigned or revoked; may be a coroutine function.
PartitionsCallback = Callable[[set[TopicPartition]], "Awaitable[Any] | Any"]
#: Called once per ``send``, when the record's fate is known: the full topic name, the value's
#: size, and the error (None: the broker has it).
DeliveryCallback = Callable[[str, int, "BaseException | None"], None]


class TransportError(RuntimeError):
    """A transport's own error (the broker refused or could not be reached), raised as the
    transport's subclass; the CLI prints it in one line naming the broker, not a traceback."""


class CommitFailed(Exception):
    """The group refused a commit (a rebalance moved the partitions) or the broker did not
    answer (``unreachable``)."""

    def __init__(self, message: str, unreachable: bool = False):
        super().__init__(message)
        self.unreachable = unreachable


class TopicSettings(Protocol):
    """What creating a topic needs (``topics.TopicSpec`` is one)."""

    @property
    def partitions(self) -> int: ...

    @property
    def replication_factor(self) -> int: ...

    @property
    def config(self) -> Mapping[str, str]: ...


class ByteProducer(Protocol):
    async def start(self) -> Any: ...
    async def stop(self) -> None: ...
    async def send(self, topic: str, value: bytes, key: bytes | None = None,
                   headers: list[tuple[str, bytes]] | None = None, partition: int | None = None) -> asyncio.Future: ...
    async def partition_count(self, topic: str) -> int | None: ...
    async def flush(self) -> None: ...


class ByteConsumer(Protocol):
    async def start(self, subscribe: bool = True) -> Any: ...
    async def stop(self) -> None: ...
    async def getmany(self, timeout_ms: int = 200, max_records: int | None = None,
                      partitions: Iterable[TopicPartition] = ()) -> list[Message]: ...
    async def commit(self, offsets: Mapping[TopicPartition, int]) -> None: ...
    def assignment(self) -> set[TopicPartition]: ...
    def assign(self, partitions: Iterable[TopicPartition]) -> None: ...
    def seek(self, tp: TopicPartition, offset: int) -> None: ...
    async def position(self, tp: TopicPartition) -> int: ...
    def highwater(self, tp: TopicPartition) -> int | None: ...
    def pause(self, partitions: Iterable[TopicPartition]) -> None: ...
    def resume(self, partitions: Iterable[TopicPartition]) -> None: ...
    def paused(self) -> set[TopicPartition]: ...
    def partitions_for_topic(self, topic: str) -> set[int]: ...
    async def partitions(self, topic: str) -> list[TopicPartition]: ...
    async def beginning_offsets(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]: ...
    async def listed_end_offsets(self, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int]: ...
    async def offsets_for_times(self, partitions: Iterable[TopicPartition],
                                timestamp_ms: int) -> dict[TopicPartition, int | None]: ...
    async def probe(self) -> None: ...


class Admin(Protocol):
    """Topic and group administration. ``async with bus.admin() as admin: ...``"""

    async def __aenter__(self) -> "Admin": ...
    async def __aexit__(self, *exc: Any) -> None: ...
    async def list_topics(self) -> set[str]: ...
    async def create_topics(self, topics: Mapping[str, TopicSettings]) -> None: ...
    async def partition_counts(self, topics: Sequence[str]) -> dict[str, int]: ...
    async def topic_configs(self, topics: Sequence[str]) -> dict[str, dict[str, str]]: ...
    async def committed(self, group: str, partitions: Iterable[TopicPartition]) -> dict[TopicPartition, int | None]: ...
