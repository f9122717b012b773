"""Micro-batching for scorers that score many records in one call (verl's batch reward
functions): records arrive one at a time from the stage's concurrent handlers; a worker hands
them to ``run`` in batches of up to ``max_size``, or what arrived within ``max_wait_s`` of the
first, and each caller gets its own record's result."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Generic, TypeVar

T = TypeVar("T")


@dataclass
class _Pending(Generic[T]):
    item: T
    future: asyncio.Future
    queued_at: float


class MicroBatcher(Generic[T]):
    """``await submit(item)`` returns ``run([...])``'s entry for ``item``. ``run`` returns one
    result per item, in order; an exception in the list fails that item alone, an exception
    raised by ``run`` fails the whole batch."""

    def __init__(self, run: Callable[[list[T]], Awaitable[list[Any]]], max_size: int, max_wait_s: float):
        self.run, self.max_size, self.max_wait_s = run, max_size, max_wait_s
        self.sizes: list[int] = []  # batch sizes, for tests and metrics
        self._queue: asyncio.Queue[_Pending[T]] | None = None
        self._worker: asyncio.Task | None = None

    async def submit(self, item: T) -> Any:
        if self._worker is None:
            self._queue = asyncio.Queue()
            self._worker = asyncio.create_task(self._serve())
        assert self._queue is not None
        future = asyncio.get_running_loop().create_future()
        self._queue.put_nowait(_Pending(item, future, time.monotonic()))
        return await future

    async def close(self) -> None:
        """Stop the worker; callers still waiting (queued, or in the batch being scored) are
        cancelled, never left hanging."""
        if self._worker is not None:
            self._worker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._worker
            self._worker = None
        while self._queue is not None and not self._queue.empty():
            self._queue.get_nowait().future.cancel()

    async def _serve(self) -> None:
        assert self._queue is not None
        while True:
            first = await self._queue.get()
            batch = [first]
            deadline = first.queued_at + self.max_wait_s
            while len(batch) < self.max_size:
                left = deadline - time.monotonic()
                if self._queue.empty() and left <= 0:
                    break
                try:
                    batch.append(self._queue.get_nowait() if not self._queue.empty()
                                 else await asyncio.wait_for(self._queue.get(), left))
                except asyncio.TimeoutError:
                    break
            batch = [p for p in batch if not p.future.done()]  # a caller that gave up
            if batch:
                self.sizes.append(len(batch))
                try:
                    await self._settle(batch)
                except asyncio.CancelledError:
                    for p in batch:
                        p.future.cancel()
                    raise

    async def _settle(self, batch: list[_Pending[T]]) -> None:
        try:
            results = list(await self.run([p.item for p in batch]))
            if len(results) != len(batch):
                raise ValueError(f"returned {len(results)} results for {len(batch)} records")
        except Exception as exc:  # noqa: BLE001 - every caller of the batch gets it
            results = [exc] * len(batch)
        for p, r in zip(batch, results):
            if p.future.done():
                continue
            if isinstance(r, BaseException):
                p.future.set_exception(r)
            else:
                p.future.set_result(r)
