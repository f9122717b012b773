"""``OpenAIBackend``: any OpenAI-compatible ``/v1/completions`` server (``vllm serve``, SGLang,
hosted models) over aiohttp, through the server fleet that follows the learner."""

from __future__ import annotations

import asyncio
import os
from typing import Any, Sequence

import numpy as np
import orjson

from streamrl.rollout.backends.base import (Backend, BackendError, BackendUnavailable, PromptInput, Completion,
                                            SamplingParams, WeightLoadError)


class OpenAIBackend(Backend):
    """``POST {server}/v1/completions`` with ``logprobs``; ``n`` samples in one request per
    prompt, requests for different prompts in parallel, over a fleet of servers
    (``streamrl.rollout.fleet``: least outstanding requests, health ejection, per-server
    limits). The API key is read from the environment variable ``api_key_env`` names, and only
    ever sent in the header.

    With ``update_api`` sglang or vllm the fleet follows the learner (``load_weights`` has every
    server load the version) and each sample carries the version its server had when the
    request started. With ``none`` (a hosted model) the servers own their weights:
    ``can_load_weights`` is False and samples are stamped version 0."""

    name = "openai"

    def __init__(self, base_url: str, model: str, api_key_env: str = "", timeout_s: float = 300.0,
                 max_retries: int = 4, token_ids: bool = True, *, servers: Sequence[str] = (),
                 update_api: str = "none", on_update: str = "drain", started_on: str | None = None,
                 **fleet: Any):
        super().__init__()
        from streamrl.rollout.fleet import ServerFleet

        self.model, self.timeout_s, self.max_retries = model, timeout_s, max_retries
        self.token_ids = token_ids
        key = os.environ.get(api_key_env) if api_key_env else None
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.can_load_weights = update_api != "none"
        if update_api == "none":  # a hosted API has no /health: never eject, as before fleets
            fleet = {**fleet, "health_interval_s": 0.0, "eject_after": 1 << 30}
        self.fleet = ServerFleet(list(servers) or [base_url], update_api=update_api, on_update=on_update,
                                 headers=self._headers, started_on=started_on, **fleet)
        self._session = None

    @property
    def url(self) -> str:
        return next(iter(self.fleet.members.values())).completions_url

    async def generate(self, prompts: Sequence[PromptInput], n: int,
                       params: SamplingParams) -> list[list[Completion]]:
        await self._ensure_session()
        return list(await asyncio.gather(*(self._complete(p, n, params) for p in prompts)))

    async def load_weights(self, uri: str, version: int, base_uri: str | None = None) -> float:
        """Start every server loading ``version`` (the fleet does it in the background, server by
        server as each drains or aborts); returns at once: requests meanwhile go to servers on a
        version the staleness bound allows. Each server's load time is
        ``streamrl_rollout_server_update_seconds``."""
        from streamrl import weights_store

        if weights_store.is_remote(uri) or (base_uri and weights_store.is_remote(base_uri)):
            # the servers read a path; they cannot fetch s3:// etc.
            raise WeightLoadError(f"weights {uri!r}: inference servers load from a path they see; "
                                  "put learner.weights_dir on a volume the servers mount")
        await self._ensure_session()
        self.fleet.follow(uri, version, base_uri)
        self.version = version
        return 0.0

    async def _ensure_session(self) -> None:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
            await self.fleet.start(self._session)

    async def close(self) -> None:
        await self.fleet.close()
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _post(self, body: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """The answer and the policy version of the server that gave it. Connection errors,
        429 and 5xx are retried (on another server where there is one) with exponential
        backoff; a request aborted for a weight update is resubmitted without counting as a
        retry."""
        import aiohttp

        from streamrl.errors import Unavailable
        from streamrl.scorers.router import RouterError

        from tenacity import AsyncRetrying, RetryError, retry_if_exception_type, stop_after_attempt, wait_exponential

        headers = {**self._headers, "Content-Type": "application/json"}
        tried: list[str] = []
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.max_retries + 1), wait=wait_exponential(multiplier=0.5, max=10.0),
            retry=retry_if_exception_type((RouterError, asyncio.TimeoutError, aiohttp.ClientError)))  # one server failed
        try:
            async for attempt in retrying:
                with attempt:
                    return await self._post_to_one(tried, body, headers)
        except RetryError as exc:
            raise BackendUnavailable(f"{len(tried)} attempts failed, last: {exc.last_attempt.exception()}") from None
        except Unavailable as exc:  # none to pick (RouterError is one too, retried above)
            raise BackendUnavailable(f"no rollout server available: {exc}") from None
        raise AssertionError("unreachable: tenacity returns or raises")

    async def _post_to_one(self, tried: list[str], body: dict[str, Any],
                           headers: dict[str, str]) -> tuple[dict[str, Any], int]:
        """One attempt on one server the fleet leases (not one in ``tried``); a request aborted
        for a weight update is resubmitted here, as if never sent. The request names the
        model the server is on now (its LoRA adapter, when versions are adapters)."""
        while True:
            async with self.fleet.lease(tried, wait_s=self.timeout_s) as (server, version):
                tried.append(server.url)
                payload = orjson.dumps({**body, "model": self.fleet.model_for(server, self.model)})
                task = asyncio.create_task(self._post_once(server.completions_url, payload, headers))
                server.inflight.add(task)
                try:
                    await asyncio.wait({task})
                finally:
                    server.inflight.discard(task)
                    if not task.done():  # this caller was cancelled: so is its request
                        task.cancel()
                if task.cancelled():  # aborted for a weight update: resubmit, as if not sent
                    self.fleet.aborted += 1
                    from streamrl import metrics

                    metrics.ROLLOUT_REQUESTS_ABORTED.inc()
                    tried.pop()
                    continue
                return task.result(), version

    async def _post_once(self, url: str, payload: bytes, headers: dict[str, str]) -> dict[str, Any]:
        from streamrl.scorers.router import RouterError

        async with self._session.post(url, data=payload, headers=headers) as resp:
            text = await resp.text()
            if resp.status == 429 or resp.status >= 500:
                raise RouterError(f"http_{'429' if resp.status == 429 else '5xx'}", f"HTTP {resp.status}: {text[:200]}")
            if resp.status >= 400:
                raise BackendError(f"{url}: HTTP {resp.status}: {text[:500]}")
            try:
                return orjson.loads(text)
            except orjson.JSONDecodeError:
                raise BackendError(f"{url}: response is not JSON: {text[:200]}") from None

    async def _complete(self, prompt: PromptInput, n: int, params: SamplingParams) -> list[Completion]:
        body: dict[str, Any] = {"model": self.model, "prompt": prompt, "n": n,
                                "max_tokens": params.max_new_tokens, "temperature": params.temperature,
                                "top_p": params.top_p, "logprobs": 0}
        if self.token_ids:
            body["return_token_ids"] = True  # vLLM: choices[].token_ids / prompt_token_ids
            body["return_tokens_as_token_ids"] = True  # vLLM: logprobs tokens as "token_id:N"
        data, version = await self._post(body)
        try:
            choices = sorted(data["choices"], key=lambda c: c.get("index", 0))
            samples = [self._sample(c, prompt) for c in choices]
            for sample in samples:
                sample.policy_version = version
            return samples
        except (KeyError, TypeError, ValueError) as exc:
            raise BackendError(f"{self.url}: unexpected response shape ({type(exc).__name__}: {exc})") from None

    @staticmethod
    def _sample(choice: dict[str, Any], prompt: PromptInput) -> Completion:
        lp = choice.get("logprobs") or {}
        logprobs = lp.get("token_logprobs")
        ids = choice.get("token_ids")
        if ids is None and lp.get("tokens") and all(str(t).startswith("token_id:") for t in lp["tokens"]):
            ids = [int(str(t).removeprefix("token_id:")) for t in lp["tokens"]]
        prompt_ids = prompt if isinstance(prompt, list) else choice.get("prompt_token_ids")
        return Completion(text=str(choice["text"]),
                          prompt_ids=None if prompt_ids is None else [int(t) for t in prompt_ids],
                          response_ids=None if ids is None else [int(t) for t in ids],
                          response_logprobs=None if logprobs is None else np.asarray(
                          [float(x) for x in logprobs], dtype=np.float32),
                          finish_reason="length" if choice.get("finish_reason") == "length" else "stop",
                          policy_version=0)
