"""``ModelScorer``: the scorer with verl's signature over the local model or reward servers,
batching the records scored concurrently (``MicroBatcher``) and posting batches through the
router (vLLM's or SGLang's ``/classify``)."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
from typing import Any

import aiohttp
import numpy as np
import orjson

from streamrl import metrics
from streamrl.errors import ConfigError, Unavailable
from streamrl.scorers.batching import MicroBatcher
from streamrl.scorers.model.config import ModelScorerConfig, protocol_of
from streamrl.scorers.model.local import RewardInput, TransformersRewardModel
from streamrl.scorers.model.vllm_version import activation_fields_for
from streamrl.servers.router import Router, public_url

log = logging.getLogger(__name__)


class ModelScorer:
    """Async scorer with verl's signature: ``await model(data_source, solution_str,
    ground_truth, extra_info=None, prompt=None)`` -> ``{"score": float}`` (fp32). Calls made
    concurrently are batched together. ``await start()`` first (loads the model, or the RM
    tokenizer and the servers' protocol version), ``await close()`` at the end."""

    def __init__(self, config: ModelScorerConfig, name: str = "model"):
        config.validate(name)
        self.config, self.name = config, name
        # records in flight are scored in dynamic batches: max_batch_size, or max_wait_ms after the first
        self._batcher: MicroBatcher | None = None
        self._local: TransformersRewardModel | None = None
        self._session: aiohttp.ClientSession | None = None
        self.router: Router | None = None
        self._inputs = RewardInput(None, config.max_length)
        self._headers = {"Content-Type": "application/json"}
        if config.api_key_env:
            self._headers["Authorization"] = f"Bearer {os.environ[config.api_key_env]}"
        # vllm: the field(s) that turn the activation off, and the version they came from
        self.activation_fields: tuple[str, ...] = (
            ("activation", "use_activation") if config.activation_field == "auto"
            else (config.activation_field,))
        self.server_version: str | None = None
        self._version_checked_at = 0.0
        self.protocol = protocol_of(config.backend)
        if config.remote and config.urls:
            self._make_router(list(config.urls))
        self.batch_sizes: collections.deque[int] = collections.deque(maxlen=10_000)

    def __repr__(self) -> str:
        return f"ModelScorer({self.name!r}, backend={self.config.backend!r})"

    def _make_router(self, urls: list[str]) -> None:
        c = self.config
        self.router = Router(urls, name=self.name, health_path=c.health_path,
                             health_interval_s=c.health_interval_s,
                             health_timeout_s=min(c.timeout_s, 5.0), eject_after=c.eject_after,
                             headers={k: v for k, v in self._headers.items() if k == "Authorization"})

    def attach_server(self, urls: list[str], backend: str, model: str, where: str) -> None:
        """Score on a reward server the stage launches (``server: NAME``): register its
        replicas' URLs with this scorer's router; the server's backend sets the protocol (a
        backend this entry names must agree with it) and its model is the RM tokenizer unless
        ``model_path`` names another. ``where`` is the config field, for errors."""
        c = self.config
        wanted = protocol_of(backend)
        if c.backend != "transformers" and protocol_of(c.backend) != wanted:
            raise ConfigError(f"config field '{where}.backend': {c.backend!r} does not speak the "
                              f"protocol of server {c.server!r} (a {backend} server)")
        if self._batcher is not None:
            raise RuntimeError(f"{self!r}: attach_server after start()")
        if c.backend == "transformers":  # the default: the server decides
            c.backend = wanted
        self.protocol = wanted
        if not c.model_path:
            c.model_path = model
        self._make_router(urls)

    async def start(self) -> "ModelScorer":
        if self._batcher is not None:
            return self
        c = self.config
        if not c.remote:
            self._local = await asyncio.to_thread(TransformersRewardModel, c)
        else:
            if self.router is None:
                raise RuntimeError(f"{self!r}: server {c.server!r} was never attached (the reward "
                                   f"stage's scorer table launches reward.servers and attaches them)")
            if c.model_path:
                from transformers import AutoTokenizer

                tok = await asyncio.to_thread(AutoTokenizer.from_pretrained, c.model_path)
                self._inputs = RewardInput(tok, c.max_length)
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=c.timeout_s))
            await self.router.start(self._session)
            if self.protocol == "vllm" and c.activation_field == "auto":
                await self.check_server_version()
        self._batcher = MicroBatcher(self._run_batch, c.max_batch_size, c.max_wait_ms / 1000.0)
        return self

    async def check_server_version(self) -> str | None:
        """Ask the servers' ``GET /version`` (the first that answers) which name vLLM reads
        for the activation switch; keep sending both names while none answers (asked again at
        most every 30 s, before a batch)."""
        assert self.router is not None and self._session is not None
        self._version_checked_at = time.monotonic()
        for url in self.router.servers:
            try:
                async with self._session.get(url + "/version", headers=self.router.headers,
                                             timeout=aiohttp.ClientTimeout(total=5.0)) as r:
                    if r.status != 200:
                        continue
                    answer = await r.json(content_type=None)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                continue
            self.activation_fields = activation_fields_for(answer)
            self.server_version = str(answer.get("version", "")) if isinstance(answer, dict) else ""
            log.info("%s: %s reports version %r: the activation switch is sent as %s", self.name,
                     public_url(url), self.server_version, "/".join(self.activation_fields))
            return self.server_version
        log.warning("%s: no server answered GET /version; sending both 'activation' and "
                    "'use_activation' (each vLLM version reads its own)", self.name)
        return None

    async def close(self) -> None:
        if self._batcher is not None:
            await self._batcher.close()
            self._batcher = None
        if self.router is not None:
            await self.router.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def set_share(self, fraction: float) -> None:
        """Nothing to share: a local model is this member's own; kept for the common contract."""

    async def router_address(self) -> str | None:
        """verl's ``reward_router_address``: a local proxy over the reward servers (remote
        backends); None for a local model, which has no server to call."""
        return await self.router.start_proxy() if self.router is not None else None

    @property
    def local_model(self) -> TransformersRewardModel | None:
        return self._local

    async def __call__(self, data_source: str, solution_str: str, ground_truth: Any,
                       extra_info: dict | None = None, **kwargs: Any) -> dict:
        if self._batcher is None:
            raise RuntimeError(f"{self!r}: await start() first")
        prompt = kwargs.get("prompt")
        if prompt is None and extra_info:
            prompt = extra_info.get("prompt")
        return {"score": float(np.float32(await self._batcher.submit((prompt, solution_str or ""))))}

    async def _run_batch(self, pairs: list[tuple[Any, str]]) -> list[Any]:
        """One dynamic batch: a score or an exception per record (``_score_split``)."""
        started = time.monotonic()
        results = await self._score_split(pairs)
        metrics.MODEL_BATCH_SIZE.labels(self.name).observe(len(pairs))
        metrics.MODEL_BATCH_SECONDS.labels(self.name).observe(time.monotonic() - started)
        self.batch_sizes.append(len(pairs))
        return results

    async def _score_split(self, pairs: list[tuple[Any, str]]) -> list[Any]:
        """A score or an exception per pair. A batch that fails (other than an outage, which
        every record waits out) is halved until the failure is pinned on the records at fault,
        so one poison record costs O(log batch) extra calls and fails alone."""
        try:
            return list(await self._score(pairs))
        except Unavailable as exc:  # the backend is down: every record waits
            return [exc] * len(pairs)
        except Exception as exc:  # noqa: BLE001 - goes to that record's caller, or is split
            if len(pairs) == 1:
                return [exc]
            half = len(pairs) // 2
            return [*await self._score_split(pairs[:half]), *await self._score_split(pairs[half:])]

    async def _score(self, pairs: list[tuple[Any, str]]) -> np.ndarray:
        if self._local is not None:
            return await asyncio.to_thread(self._local.score, pairs)
        if self.protocol == "sglang":
            return await self._score_sglang(pairs)
        return await self._score_vllm(pairs)

    def request_body(self, pairs: list[tuple[Any, str]]) -> dict[str, Any]:
        """The JSON body of one batch's request (what a server receives)."""
        if self.protocol == "sglang":
            if self._inputs.tok is not None:  # exact ids: no tokenisation left to the server
                body: dict[str, Any] = {"input_ids": [f["input_ids"] for f in self._inputs.encode(pairs)]}
            else:
                body = {"text": [self._inputs.text(p, r) for p, r in pairs]}
        else:
            body = {"input": [self._inputs.server_text(p, r) for p, r in pairs]}
            for name in self.activation_fields:
                body[name] = False
        if self.config.model:
            body["model"] = self.config.model
        return body

    async def _score_vllm(self, pairs: list[tuple[Any, str]]) -> np.ndarray:
        assert self.router is not None
        if (self.server_version is None and self.config.activation_field == "auto"
                and time.monotonic() - self._version_checked_at > 30.0):
            await self.check_server_version()
        body = self.request_body(pairs)
        n = len(pairs)

        def parse(answer: Any) -> np.ndarray:
            data = sorted(answer["data"], key=lambda d: d.get("index", 0))
            if len(data) != n:
                raise ValueError(f"{len(data)} scores for {n} inputs")
            return np.asarray([d["probs"][-1] for d in data], dtype=np.float32)

        return await self._post("/classify", body, parse)

    async def _score_sglang(self, pairs: list[tuple[Any, str]]) -> np.ndarray:
        body = self.request_body(pairs)
        n = len(pairs)

        def parse(answer: Any) -> np.ndarray:
            rows = answer if isinstance(answer, list) else [answer]
            if len(rows) != n:
                raise ValueError(f"{len(rows)} scores for {n} inputs")
            return np.asarray([r["embedding"][-1] for r in rows], dtype=np.float32)

        return await self._post("/classify", body, parse)

    async def _post(self, path: str, body: dict[str, Any], parse: Any) -> np.ndarray:
        assert self.router is not None
        c = self.config
        return await self.router.post_json(
            path, orjson.dumps(body), headers=self._headers, parse=parse,
            max_retries=c.max_retries, backoff_s=c.backoff_s, backoff_max_s=c.backoff_max_s,
            rejected="model_rejected")
