"""The base of the in-process engines (transformers, vLLM): one batch at a time in a thread, the
requests that wait meanwhile merged into the next batch, weight loads between batches."""

from __future__ import annotations

import asyncio
import time
from abc import abstractmethod
from dataclasses import dataclass
from typing import Sequence

from streamrl.rollout.backends.base import Backend, BackendError, Completion, PromptInput, SamplingParams


@dataclass
class _Request:
    prompts: list[PromptInput]
    n: int
    params: SamplingParams
    future: asyncio.Future


class _LocalEngine(Backend):
    """A backend whose engine runs in this process. Generation runs in a thread (the event loop
    keeps the consumer group's heartbeats going), one batch at a time; requests that arrive
    while a batch runs are merged into the next one (same ``n`` and sampling parameters, up to
    ``max_batch_rows`` sequences), so a worker with several prompts in flight fills the engine.
    A weight load waits for the batch in progress and runs before the next."""

    def __init__(self, max_batch_rows: int = 64) -> None:
        super().__init__()
        self.max_batch_rows = max_batch_rows
        self.batches = 0  # engine calls so far
        self._lock = asyncio.Lock()
        self._queue: list[_Request] = []
        self._server: asyncio.Task | None = None

    async def generate(self, prompts: Sequence[PromptInput], n: int,
                       params: SamplingParams) -> list[list[Completion]]:
        if any(len(p) == 0 for p in prompts):
            raise BackendError("empty prompt")
        request = _Request(list(prompts), n, params, asyncio.get_running_loop().create_future())
        self._queue.append(request)
        if self._server is None or self._server.done():
            self._server = asyncio.create_task(self._serve())
        return await request.future

    async def _serve(self) -> None:
        while self._queue:
            async with self._lock:
                batch = self._take()
                if not batch:
                    continue
                version = self.version
                try:
                    out = await asyncio.to_thread(self._generate, [p for r in batch for p in r.prompts],
                                                  batch[0].n, batch[0].params)
                except Exception as exc:  # noqa: BLE001 - handed to every caller in the batch
                    for r in batch:
                        if not r.future.done():
                            r.future.set_exception(exc)
                    continue
                self.batches += 1
            for samples in out:
                for s in samples:
                    s.policy_version = version
            start = 0
            for r in batch:
                if not r.future.done():  # a caller that was cancelled meanwhile
                    r.future.set_result(out[start:start + len(r.prompts)])
                start += len(r.prompts)

    def _take(self) -> list[_Request]:
        """The oldest request and the queued ones that can share its engine call."""
        self._queue = [r for r in self._queue if not r.future.done()]
        if not self._queue:
            return []
        first, batch, rows = self._queue[0], [], 0
        for r in list(self._queue):
            if (r.n, r.params) != (first.n, first.params):
                continue
            if batch and rows + len(r.prompts) * r.n > self.max_batch_rows:
                break
            batch.append(r)
            rows += len(r.prompts) * r.n
            self._queue.remove(r)
        return batch

    async def load_weights(self, uri: str, version: int, base_uri: str | None = None) -> float:
        async with self._lock:
            started = time.monotonic()
            try:
                await asyncio.to_thread(self._load_weights, uri, base_uri)
            finally:
                from streamrl import weights_store

                for u in (uri, base_uri):  # a downloaded copy is not needed once loaded
                    if u:
                        weights_store.release(u)
            self.version = version
            return time.monotonic() - started

    @abstractmethod
    def _generate(self, prompts: list[PromptInput], n: int, params: SamplingParams) -> list[list[Completion]]:
        ...

    @abstractmethod
    def _load_weights(self, uri: str, base_uri: str | None = None) -> None:
        """Full weights at ``uri``; or (``base_uri`` set) the LoRA adapter at ``uri`` on that base."""
