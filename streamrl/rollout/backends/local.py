"""The base of the in-process engines (transformers, vLLM): one batch at a time in a thread, the
requests that wait meanwhile merged into the next batch, weight loads between batches."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from streamrl.records import VersionRuns
from streamrl.rollout.backends.base import Backend, BackendError, Completion, PromptInput, SamplingParams


@dataclass
class _Row:
    """One response of ``_serve_chunked`` as its chunks come in."""

    prompt: PromptInput
    budget: int
    prompt_ids: list[int] | None = None
    ids: list[int] = field(default_factory=list)
    logprobs: list[np.ndarray] = field(default_factory=list)
    runs: VersionRuns = field(default_factory=lambda: VersionRuns([]))
    finish_reason: str | None = None
    version: int = 0

    @property
    def left(self) -> int:
        return self.budget - len(self.ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.left <= 0

    @property
    def context(self) -> PromptInput:
        return self.prompt if self.prompt_ids is None else self.prompt_ids + self.ids

    def take(self, s: Completion, version: int) -> None:
        if self.prompt_ids is None:
            self.prompt_ids = list(s.prompt_ids or [])
        ids = list(s.response_ids or [])
        self.ids += ids
        self.logprobs.append(np.asarray(s.response_logprobs, dtype=np.float32))
        self.runs.extend(version, len(ids))
        self.version = version
        if s.finish_reason == "stop":
            self.finish_reason = "stop"
        elif self.left <= 0:
            self.finish_reason = "length"

    def completion(self, tokenizer: Any) -> Completion:
        runs = self.runs if self.runs.runs else VersionRuns([(self.version, 0)])
        return Completion(text=tokenizer.decode(self.ids, skip_special_tokens=True), prompt_ids=self.prompt_ids,
                          response_ids=self.ids, response_logprobs=np.concatenate(self.logprobs)
                          if self.logprobs else np.zeros(0, np.float32), finish_reason=self.finish_reason or "length",
                          policy_version=runs.oldest, token_versions=list(runs.runs) if runs.span > 1 else None)


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
    A weight load waits for the batch in progress and runs before the next (``on_update:
    partial``: for the decoding chunk in progress, ``_serve_chunked``)."""

    def __init__(self, max_batch_rows: int = 64) -> None:
        super().__init__()
        self.max_batch_rows = max_batch_rows
        self.batches = 0  # engine calls so far
        self._lock = asyncio.Lock()
        self._queue: list[_Request] = []
        self._server: asyncio.Task | None = None
        # on_update partial: decode in chunks of this many tokens, a weight load between two
        # (``_serve_chunked``); 0: whole responses, a load waits for the batch
        self.partial_chunk = 0

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
            if self.partial_chunk:
                batch = self._take()
                if batch:
                    await self._serve_chunked(batch)
                continue
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

    async def _serve_chunked(self, batch: list[_Request]) -> None:
        """``on_update: partial``: the batch's responses ``partial_chunk`` tokens at a time, each
        chunk on the weights loaded when it starts (a load waits for the chunk in progress, then
        the rest continues on the new weights from the tokens so far), each token stamped with
        its chunk's version. A response ends at its end of sequence or its budget."""
        params = batch[0].params
        rows = [_Row(p, params.max_new_tokens) for r in batch for p in r.prompts for _ in range(r.n)]
        while True:
            active = [row for row in rows if not row.finished]
            if not active:
                break
            step = min(self.partial_chunk, max(row.left for row in active))
            async with self._lock:
                version = self.version
                try:
                    out = await asyncio.to_thread(self._generate, [row.context for row in active], 1,
                                                  dataclasses.replace(params, max_new_tokens=step))
                except Exception as exc:  # noqa: BLE001 - handed to every caller in the batch
                    for r in batch:
                        if not r.future.done():
                            r.future.set_exception(exc)
                    return
                self.batches += 1
            for row, (sample,) in zip(active, out):
                row.take(sample, version)
        done = iter(rows)
        for r in batch:
            result = [[next(done).completion(self.tokenizer) for _ in range(r.n)] for _ in r.prompts]
            if not r.future.done():
                r.future.set_result(result)

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
                from streamrl import weights

                for u in (uri, base_uri):  # a downloaded copy is not needed once loaded
                    if u:
                        weights.release(u)
            self.version = version
            return time.monotonic() - started

    @abstractmethod
    def _generate(self, prompts: list[PromptInput], n: int, params: SamplingParams) -> list[list[Completion]]:
        ...

    @abstractmethod
    def _load_weights(self, uri: str, base_uri: str | None = None) -> None:
        """Full weights at ``uri``; or (``base_uri`` set) the LoRA adapter at ``uri`` on that base."""
