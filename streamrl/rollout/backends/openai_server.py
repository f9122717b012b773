"""``OpenAIBackend``: any OpenAI-compatible ``/v1/completions`` server (``vllm serve``, SGLang,
hosted models) over aiohttp, through the server fleet that follows the learner."""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Sequence

import numpy as np
import orjson

from streamrl.records import VersionRuns
from streamrl.rollout.backends.base import (Backend, BackendError, BackendUnavailable, PromptInput, Completion,
                                            SamplingParams, WeightLoadError)

if TYPE_CHECKING:
    from streamrl.rollout.fleet import Stamp

monotonic = time.monotonic
_NONE: dict[str, Any] = {}  # (a chunk without logprobs)

#: how ``_post_to_one`` sends a request and reads its answer: (url, payload, headers, stamp: the
#: version its tokens are generated on, which a paused update moves)
Sender = Callable[[str, bytes, dict[str, str], "Stamp"], Awaitable[dict[str, Any]]]


class Cut(Exception):
    """A streamed request the server ended before its response did (``finish_reason: abort``:
    a vLLM whose pause aborts the requests in flight): continued, as one cut for an update."""


class OpenAIBackend(Backend):
    """``POST {server}/v1/completions`` with ``logprobs``; ``n`` samples in one request per
    prompt, requests for different prompts in parallel, over a fleet of servers
    (``streamrl.rollout.fleet``: least outstanding requests, health ejection, per-server
    limits). The API key is read from the environment variable ``api_key_env`` names, and only
    ever sent in the header.

    With ``update_api`` sglang or vllm the fleet follows the learner (``load_weights`` has every
    server load the version) and each sample carries the version its server had when the
    request started. Until the learner's first announcement names the servers' weights
    (``load_weights``, or ``use_starting_weights``: version 0 *is* the weights they started on)
    no request is sent: tokens of weights no announcement named would be stamped with a version
    they are not (issue 57), and the records have no way to say "no version". With ``none`` (a
    hosted model) the servers own their weights: ``can_load_weights`` is False and samples are
    stamped version 0; so are they with ``follow_policy`` off.

    Requests to servers that follow the learner are streamed (each sample its own request, as
    ``partial`` does), so a server that stops streaming mid-response (``stream_timeout_s``,
    ``ServerFleet._watch_streams``) loses no tokens: each of its requests continues on another
    server from the tokens it had streamed, whatever ``on_update`` is. ``stream_timeout_s`` 0
    (or ``update_api`` none) sends one whole request per prompt, as before."""

    name = "openai"

    def __init__(self, base_url: str, model: str, api_key_env: str = "", timeout_s: float = 300.0,
                 max_retries: int = 4, token_ids: bool = True, *, servers: Sequence[str] = (),
                 update_api: str = "none", on_update: str = "drain", started_on: str | None = None,
                 stream_timeout_s: float = 30.0, follow_policy: bool = True, return_routed_experts: bool = False,
                 route_shape: tuple[int, int] | None = None, **fleet: Any):
        """``return_routed_experts``: each sample carries the experts the server routed its tokens
        to (vLLM's ``choices[].routed_experts``, SGLang's ``sglext.routed_experts``, whose flat ids
        take their ``[layers, topk]`` from ``route_shape``), one whole request per sample: vLLM
        streams none, SGLang returns one request's."""
        super().__init__()
        from streamrl.rollout.fleet import ServerFleet

        self.model, self.timeout_s, self.max_retries = model, timeout_s, max_retries
        self.token_ids = token_ids
        self.routed, self.route_shape = return_routed_experts, route_shape
        key = os.environ.get(api_key_env) if api_key_env else None
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.can_load_weights = update_api != "none"
        if update_api == "none":  # a hosted API has no /health: never eject, as before fleets
            fleet = {**fleet, "health_interval_s": 0.0, "eject_after": 1 << 30}
        # streamed: partial (continued across updates), and every request to servers that follow
        # the learner (continued across a server that hangs)
        self.streamed = not return_routed_experts and (
            on_update == "partial" or (update_api != "none" and stream_timeout_s > 0))
        self.fleet = ServerFleet(list(servers) or [base_url], update_api=update_api, on_update=on_update,
                                 headers=self._headers, started_on=started_on,
                                 stream_timeout_s=stream_timeout_s if self.streamed else 0.0,
                                 initial_version=None if update_api != "none" and follow_policy else 0, **fleet)
        self._session = None

    @property
    def url(self) -> str:
        return next(iter(self.fleet.members.values())).completions_url

    async def generate(self, prompts: Sequence[PromptInput], n: int,
                       params: SamplingParams) -> list[list[Completion]]:
        await self._ensure_session()
        if self.routed:  # one request per sample: SGLang returns the routing of a request's first
            async def each(p: PromptInput) -> list[Completion]:
                return [s for one in await asyncio.gather(*(self._complete(p, 1, params) for _ in range(n))) for s in one]
            return list(await asyncio.gather(*(each(p) for p in prompts)))
        complete = self._complete_streamed if self.streamed else self._complete
        return list(await asyncio.gather(*(complete(p, n, params) for p in prompts)))

    async def load_weights(self, uri: str, version: int, base_uri: str | None = None) -> float:
        """Start every server loading ``version`` (the fleet does it in the background, server by
        server as each drains or aborts); returns at once: requests meanwhile go to servers on a
        version the staleness bound allows. Each server's load time is
        ``streamrl_rollout_server_update_seconds``."""
        from streamrl import weights

        if weights.is_remote(uri) or (base_uri and weights.is_remote(base_uri)):
            # the servers read a path; they cannot fetch s3:// etc.
            raise WeightLoadError(f"weights {uri!r}: inference servers load from a path they see; "
                                  "put learner.weights_dir on a volume the servers mount")
        await self._ensure_session()
        self.fleet.follow(uri, version, base_uri)
        self.version = version
        return 0.0

    async def use_starting_weights(self, version: int) -> None:
        """The learner announced ``version`` with no weights (its initial weights, which the
        servers were started on): the servers serve them as that version."""
        self.fleet.starting(version)
        self.version = version

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

    async def _post(self, body: dict[str, Any] | Callable[[], dict[str, Any]],
                    part: "_Partial | None" = None) -> tuple[dict[str, Any], int]:
        """The answer and the policy version of the server that gave it. Connection errors,
        429 and 5xx are retried (on another server where there is one) with exponential
        backoff; a request aborted for a weight update is resubmitted without counting as a
        retry."""
        import aiohttp

        from streamrl.errors import Unavailable
        from streamrl.servers.router import RouterError

        from tenacity import AsyncRetrying, RetryError, retry_if_exception_type, stop_after_attempt, wait_exponential

        headers = {**self._headers, "Content-Type": "application/json"}
        tried: list[str] = []
        retrying = AsyncRetrying(
            stop=stop_after_attempt(self.max_retries + 1), wait=wait_exponential(multiplier=0.5, max=10.0),
            retry=retry_if_exception_type((RouterError, asyncio.TimeoutError, aiohttp.ClientError)))  # one server failed
        try:
            async for attempt in retrying:
                with attempt:
                    return await self._post_to_one(tried, body, headers, part)
        except RetryError as exc:
            raise BackendUnavailable(f"{len(tried)} attempts failed, last: {exc.last_attempt.exception()}") from None
        except Unavailable as exc:  # none to pick (RouterError is one too, retried above)
            raise BackendUnavailable(f"no rollout server available: {exc}") from None
        raise AssertionError("unreachable: tenacity returns or raises")

    async def _post_to_one(self, tried: list[str], body: dict[str, Any] | Callable[[], dict[str, Any]],
                           headers: dict[str, str], part: "_Partial | None" = None) -> tuple[dict[str, Any], int]:
        """One attempt on one server the fleet leases (not one in ``tried``); a request aborted
        for a weight update is resubmitted here, as if never sent (``body`` a function: built
        again for each send, so that a streamed sample's continues from where it was cut). The
        request names the model the server is on now (its LoRA adapter, when versions are
        adapters). ``part``: the sample it streams into (None: one JSON answer). A request cut
        because its server stopped streaming (``Stamp.hung``) continues at once on another
        server, that one counted as tried and failed."""
        from streamrl import metrics
        from streamrl.rollout.fleet import Stamp
        from streamrl.servers.router import RouterError

        send = part.stream(self) if part is not None else self._send_once
        while True:
            stamp: Stamp | None = None
            try:
                async with self.fleet.lease(tried, wait_s=self.timeout_s) as (server, version):
                    tried.append(server.url)
                    payload = orjson.dumps({**(body() if callable(body) else body),
                                            "model": self.fleet.model_for(server, self.model)})
                    stamp = Stamp(version, server)  # a paused update moves it (fleet docstring)
                    if not server.inflight:  # busy from now: its silence is measured from here
                        server.last_chunk = time.monotonic()
                    task = asyncio.create_task(send(server.completions_url, payload, headers, stamp))
                    server.inflight.add(task)
                    server.stamps[task] = stamp
                    try:
                        await asyncio.wait({task})
                    finally:
                        server.inflight.discard(task)
                        server.stamps.pop(task, None)
                        if not task.done():  # this caller was cancelled: so is its request
                            task.cancel()
                    if stamp.hung:  # the server's failure (it is ejected), never its answer
                        raise RouterError("stream_timeout", f"{server.url}: stopped streaming")
                    if not (task.cancelled() or isinstance(task.exception(), Cut)):
                        return task.result(), version  # (its errors count against the server)
            except RouterError:
                if stamp is None or not stamp.hung:
                    raise
                if task.done() and not task.cancelled() and task.exception() is None:
                    return task.result(), version  # it ended as the server was cut out
                self.fleet.failed_over += 1
                metrics.ROLLOUT_REQUESTS_FAILED_OVER.inc()
                continue  # from the tokens it had (part), on another server: tried keeps this one
            # cut for a weight update: resubmit (abort) or continue (partial)
            if self.fleet.on_update == "partial":
                self.fleet.continued += 1
                metrics.ROLLOUT_REQUESTS_CONTINUED.inc()
            else:
                if part is not None:  # abort: its tokens are thrown away, all of one version
                    self.fleet.discarded += len(part.logprobs)
                    part.reset()
                self.fleet.aborted += 1
                metrics.ROLLOUT_REQUESTS_ABORTED.inc()
            tried.pop()

    async def _send_once(self, url: str, payload: bytes, headers: dict[str, str], stamp: "Stamp") -> dict[str, Any]:
        return await self._post_once(url, payload, headers)

    async def _post_once(self, url: str, payload: bytes, headers: dict[str, str]) -> dict[str, Any]:
        from streamrl.servers.router import RouterError

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
        if params.ignore_eos:
            body["ignore_eos"] = True  # vLLM's and SGLang's sampling extension
        if self.token_ids:
            body["return_token_ids"] = True  # vLLM: choices[].token_ids / prompt_token_ids
            body["return_tokens_as_token_ids"] = True  # vLLM: logprobs tokens as "token_id:N"
        if self.routed:
            body["return_routed_experts"] = True  # SGLang's per-request flag (vLLM's is the server's)
        data, version = await self._post(body)
        try:
            choices = sorted(data["choices"], key=lambda c: c.get("index", 0))
            samples = [self._sample(c, prompt) for c in choices]
            for sample in samples:
                sample.policy_version = version
                if self.routed:
                    sample.routed_experts = self._routes(data, choices[0] if len(choices) == 1 else {}, sample)
            return samples
        except (KeyError, TypeError, ValueError) as exc:
            raise BackendError(f"{self.url}: unexpected response shape ({type(exc).__name__}: {exc})") from None

    def _routes(self, data: dict[str, Any], choice: dict[str, Any], sample: Completion) -> np.ndarray:
        """A sample's routed experts from the response (vLLM: the choice's ``routed_experts``,
        a base64 ``.npy``; SGLang: the response's ``sglext.routed_experts``, base64 int32 ids),
        checked to have one row per token the server fed; ``BackendError`` otherwise."""
        from streamrl.routing import RoutingError, from_sglang, from_vllm

        vllm = choice.get("routed_experts")
        sglang = (data.get("sglext") or {}).get("routed_experts")
        try:
            if isinstance(vllm, str):
                routes = from_vllm(vllm)
            elif isinstance(sglang, str):
                if self.route_shape is None:
                    raise RoutingError("SGLang's flat routed_experts need the model's layers and top-k: set "
                                       "rollout.policy to the served model's directory (its config.json)")
                routes = from_sglang(sglang, *self.route_shape)
            else:
                raise RoutingError("the server returned no routed_experts (start vLLM or SGLang with "
                                   "--enable-return-routed-experts)")
            if routes.size and int(routes.min()) < 0:
                raise RoutingError("negative expert ids (a dense layer?): router replay needs every layer's experts")
        except RoutingError as exc:
            raise BackendError(f"{self.url}: {exc}") from None
        if sample.prompt_ids is not None and sample.response_ids is not None:
            fed = len(sample.prompt_ids) + len(sample.response_ids) - 1
            if len(routes) != fed:
                raise BackendError(f"{self.url}: routed_experts has {len(routes)} rows for the {fed} tokens fed")
        return routes

    async def _complete_streamed(self, prompt: PromptInput, n: int, params: SamplingParams) -> list[Completion]:
        """Each sample its own streamed request (a server's prefix cache shares the prompt), its
        tokens kept as they arrive. Cut by a weight update (the fleet cancels it): under
        ``partial`` it continues, on the new weights, from the prompt plus the tokens so far
        with what is left of the budget, each token stamped with the version of the server that
        sent it; under ``abort`` it starts over. A connection lost mid-stream, or a server that
        stopped streaming (``stream_timeout_s``), continues it the same way under any
        ``on_update``: tokens already decoded are never decoded again."""
        parts = [_Partial(prompt, params.max_new_tokens) for _ in range(n)]

        async def one(part: _Partial) -> Completion:
            base = {"prompt": prompt, "n": 1, "temperature": params.temperature, "top_p": params.top_p,
                    "logprobs": 0, "stream": True}
            if params.ignore_eos:
                base["ignore_eos"] = True
            if self.token_ids:
                base.update(return_token_ids=True, return_tokens_as_token_ids=True)
            while not part.finished:
                await self._post(lambda: part.body(base), part)
            return part.completion()

        return list(await asyncio.gather(*(one(p) for p in parts)))

    async def _stream_once(self, url: str, payload: bytes, headers: dict[str, str], take: Callable[[dict], None],
                           stamp: "Stamp | None" = None) -> None:
        """A streamed completion (server-sent events), each chunk handed to ``take`` as it comes
        and noted as a sign of its server's life (``stamp.member``: the fleet's stream watch).
        A stream that ends before its finish reason is a ``RouterError`` (retried: continued)."""
        from streamrl.servers.router import RouterError

        alive = stamp.member if stamp is not None else None

        async with self._session.post(url, data=payload, headers=headers) as resp:
            if resp.status >= 400:
                text = await resp.text()
                if resp.status == 429 or resp.status >= 500:
                    raise RouterError(f"http_{'429' if resp.status == 429 else '5xx'}",
                                      f"HTTP {resp.status}: {text[:200]}")
                raise BackendError(f"{url}: HTTP {resp.status}: {text[:500]}")
            # whatever has arrived, split into lines here: one read per network read, not two
            # aiohttp line reads per event (each token is an event: this is the per-token path)
            rest = b""
            async for got in resp.content.iter_any():
                if alive is not None:
                    alive.last_chunk = monotonic()
                *lines, rest = (rest + got).split(b"\n")
                for raw in lines:
                    if not raw.startswith(b"data:"):
                        continue
                    data = raw[5:].strip()
                    if data == b"[DONE]":
                        return
                    try:
                        take(orjson.loads(data))
                    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                        raise BackendError(f"{url}: unexpected stream chunk ({type(exc).__name__}: {exc})") from None
            last = rest[5:].strip() if rest.startswith(b"data:") else b""  # an event the stream ended without a newline
            if last and last != b"[DONE]":
                try:
                    take(orjson.loads(last))
                except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                    raise BackendError(f"{url}: unexpected stream chunk ({type(exc).__name__}: {exc})") from None

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


@dataclass
class _Partial:
    """One sample of ``on_update: partial`` as it streams in, across the requests that continue
    it: its tokens, their behaviour log-probs and the version of each (``runs``)."""

    prompt: PromptInput
    budget: int  # max_new_tokens of the whole response
    prompt_ids: list[int] | None = None
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # the text, chunk by chunk (joined once: ``text``)
    runs: VersionRuns = field(default_factory=lambda: VersionRuns([]))
    ids_missing: bool = False  # a chunk came without token ids: the response is text only
    finish_reason: str | None = None
    version: int = 0  # the version of the last server that streamed into it
    cut: bool = False  # the server aborted the request in progress (finish_reason abort): continued

    def __post_init__(self) -> None:
        if isinstance(self.prompt, list):
            self.prompt_ids = [int(t) for t in self.prompt]

    @property
    def text(self) -> str:
        return "".join(self.texts)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or len(self.logprobs) >= self.budget

    def body(self, base: dict[str, Any]) -> dict[str, Any]:
        """The request that continues it: the prompt and the tokens so far (as token ids where
        the server reported them, else as text), with what is left of the budget."""
        if not self.logprobs:
            return {**base, "max_tokens": self.budget}
        if self.prompt_ids is not None and not self.ids_missing:
            prompt: PromptInput = self.prompt_ids + self.ids
        else:
            prompt = (self.prompt if isinstance(self.prompt, str) else "") + self.text
        return {**base, "prompt": prompt, "max_tokens": self.budget - len(self.logprobs)}

    def stream(self, backend: "OpenAIBackend") -> Sender:
        """A sender that streams one request into this sample, each chunk's tokens stamped with
        the version its request is on when the chunk arrives (``stamp``: a paused update moves
        it)."""
        async def send(url: str, payload: bytes, headers: dict[str, str], stamp: "Stamp") -> dict[str, Any]:
            await backend._stream_once(url, payload, headers, lambda chunk: self.take(chunk, stamp.version), stamp)
            if self.cut:
                self.cut = False
                raise Cut(f"{url}: the server aborted the request")
            if not self.finished:
                from streamrl.servers.router import RouterError

                raise RouterError("stream_ended", f"{url}: the stream ended before the response did")
            return {}
        return send

    def reset(self) -> None:
        """Forget what it streamed (``abort``: a response cut for an update is generated again,
        whole, on one version)."""
        if not isinstance(self.prompt, list):
            self.prompt_ids = None
        self.ids, self.logprobs, self.texts = [], [], []
        self.runs, self.ids_missing, self.finish_reason, self.cut = VersionRuns([]), False, None, False

    def take(self, chunk: dict[str, Any], version: int) -> None:
        """One streamed chunk of choice 0 (vLLM's and SGLang's completions stream)."""
        self.version = version
        for choice in chunk.get("choices") or ():
            lp = choice.get("logprobs") or _NONE
            logprobs = [float(x) for x in lp.get("token_logprobs") or ()]
            ids = choice.get("token_ids")
            if ids is None:
                tokens = lp.get("tokens")
                if tokens and all(str(t).startswith("token_id:") for t in tokens):
                    ids = [int(str(t)[9:]) for t in tokens]
            if self.prompt_ids is None and choice.get("prompt_token_ids"):
                self.prompt_ids = [int(t) for t in choice["prompt_token_ids"]]
            if ids is None:
                self.ids_missing = self.ids_missing or bool(logprobs)
            else:
                self.ids += [int(t) for t in ids]
            self.logprobs += logprobs
            text = choice.get("text")
            if text:
                self.texts.append(str(text))
            self.runs.extend(version, len(logprobs))
            reason = choice.get("finish_reason")
            if reason == "abort":  # not its end: the server cut it (a pause that aborts)
                self.cut = True
            elif reason:
                self.finish_reason = "length" if reason == "length" else "stop"

    def completion(self) -> Completion:
        runs = self.runs if self.runs.runs else VersionRuns([(self.version, 0)])
        ids_ok = not self.ids_missing and len(self.ids) == len(self.logprobs)
        return Completion(text=self.text, prompt_ids=self.prompt_ids, response_ids=self.ids if ids_ok else None,
                          response_logprobs=np.asarray(self.logprobs, dtype=np.float32),
                          finish_reason=self.finish_reason or "length", policy_version=runs.oldest,
                          token_versions=list(runs.runs) if runs.span > 1 else None)
