"""A router over several judge / reward servers: least outstanding requests, health checks,
ejection and re-admission.

Used by the LLM judge, by the HTTP backend of the model scorer, and by the rollout worker's
server fleet (``streamrl.rollout.fleet``: one router, two users; the fleet narrows ``pick`` with
``eligible``: version, update in progress, per-server concurrency). A server is *ejected* after
``eject_after`` consecutive failures (failed requests or failed health checks) and *re-admitted*
when a health check passes again; health checks run every ``health_interval_s`` on every server.
When every server is ejected, ``pick`` raises ``Unavailable``: the reward stage holds the
record (back-pressure) instead of scoring it.

URLs are server roots (``http://host:8000``; a trailing ``/v1`` is accepted and dropped), so
paths such as ``/v1/chat/completions`` or ``/classify`` are the same for every server.

``reward_router_address``: an async user scorer (verl's signature) receives ``HOST:PORT`` of a
tiny local aiohttp proxy (``start_proxy``) that forwards any request to the server ``pick``
chooses, so a user function written for verl (``http://{reward_router_address}/v1/...``) gets the
same balancing and ejection as the built-in scorers.
"""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import itertools
import logging
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, Iterable, TypeVar

import aiohttp
import orjson
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from streamrl import metrics
from streamrl.errors import Failure, Unavailable

log = logging.getLogger(__name__)
T = TypeVar("T")


def server_root(url: str) -> str:
    url = url.strip().rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def public_url(url: str) -> str:
    """``url`` without user-info, query or fragment: what may appear in a metric label or a log
    line (a key in ``https://user:key@host/?api_key=...`` must not)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port:
        netloc += f":{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


@dataclass
class _Server:
    url: str
    outstanding: int = 0
    failures: int = 0  # consecutive
    ejected: bool = False
    not_before: float = 0.0  # monotonic time before which it asked not to be called (Retry-After)


def retry_after_s(value: str | None, cap_s: float) -> float:
    """A ``Retry-After`` header (delay-seconds or an HTTP date) as seconds from now, at most
    ``cap_s``; 0 when absent or unreadable."""
    if not value:
        return 0.0
    value = value.strip()
    if value.isdigit():
        return min(float(value), cap_s)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return 0.0
    return min(max(0.0, when.timestamp() - time.time()), cap_s)


class RouterError(Unavailable):
    """A request failed on one server (``reason``: timeout, connect, http_429, http_5xx): it
    counts towards that server's ejection and is retried on another server;
    ``Unavailable`` once retries run out."""


class BadReply(Failure):
    """A server answered, but not with something ``parse`` can read (HTTP 200 with null content,
    empty choices, not JSON, a body over ``max_reply_bytes``). That is this request's problem,
    not the server's: retried (on another server where there is one) without counting towards
    ejection, then a ``Failure`` for this record alone, which goes to dead letters."""


@dataclass
class Router:
    urls: list[str]
    name: str = "judge"
    health_path: str = "/health"
    health_interval_s: float = 5.0
    health_timeout_s: float = 2.0
    eject_after: int = 3
    headers: dict[str, str] = field(default_factory=dict, repr=False)  # e.g. Authorization
    retry_after_max_s: float = 60.0  # a server's Retry-After is honoured up to this long
    max_reply_bytes: int = 8 * 1024 * 1024  # a longer reply is a BadReply, never read whole

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError(f"{self.name}: no server URLs configured")
        self.servers = {u: _Server(u) for u in dict.fromkeys(server_root(u) for u in self.urls)}
        self._rr = itertools.count()
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task | None = None
        self._proxy: "aiohttp.web.AppRunner | None" = None
        self.address: str | None = None  # HOST:PORT of the proxy, once started
        # called with a server's URL when a health check re-admits it (the rollout fleet reloads
        # the current policy into a server that may have restarted on its initial weights)
        self.on_readmit: list[Callable[[str], None]] = []
        metrics.ROUTER_EJECTED.labels(self.name).set(0)

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self, session: aiohttp.ClientSession) -> None:
        self._session = session
        if self.health_interval_s > 0 and self._health_task is None:
            self._health_task = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        if self._health_task:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
            self._health_task = None
        if self._proxy:
            await self._proxy.cleanup()
            self._proxy = None
            self.address = None

    # -- choosing a server -------------------------------------------------------------------
    def pick(self, exclude: Iterable[str] = (), eligible: Callable[[str], bool] | None = None) -> str:
        """The admitted server with the fewest outstanding requests (ties: round robin),
        preferring servers not in ``exclude`` (those a retry already tried). ``eligible`` narrows
        the admitted ones further (``Unavailable("none_eligible")`` when it leaves none)."""
        admitted = [s for s in self.servers.values() if not s.ejected]
        if not admitted:
            raise Unavailable("all_ejected", f"{self.name}: all {len(self.servers)} servers are ejected "
                                    "(failing); holding records until one passes a health check")
        if eligible is not None:
            admitted = [s for s in admitted if eligible(s.url)]
            if not admitted:
                raise Unavailable("none_eligible", f"{self.name}: no admitted server is eligible now")
        skip = set(exclude)
        fresh = [s for s in admitted if s.url not in skip] or admitted
        start = next(self._rr) % len(fresh)
        rotated = fresh[start:] + fresh[:start]
        now = time.monotonic()  # a server still inside its Retry-After comes last, soonest first
        return min(rotated, key=lambda s: (max(s.not_before - now, 0.0), s.outstanding)).url

    @contextlib.asynccontextmanager
    async def lease(self, exclude: Iterable[str] = (),
                    eligible: Callable[[str], bool] | None = None) -> AsyncIterator[str]:
        """Pick a server and count the request against it while the block runs. The block
        raises ``RouterError`` (or a timeout / connection error) on failure; the server's
        failure count and the metrics follow."""
        url = self.pick(exclude, eligible)
        server = self.servers[url]
        wait = server.not_before - time.monotonic()
        if wait > 0:  # every server asked for time (Retry-After): honour it before calling
            await asyncio.sleep(wait)
        server.outstanding += 1
        metrics.ROUTER_OUTSTANDING.labels(self.name, public_url(url)).set(server.outstanding)
        metrics.ROUTER_REQUESTS.labels(self.name, public_url(url)).inc()
        started = time.monotonic()
        try:
            yield url
        except RouterError as exc:
            self._failed(url, exc.reason)
            raise
        except BadReply as exc:  # the server is alive: neither a failure nor a success for it
            metrics.ROUTER_ERRORS.labels(self.name, public_url(url), exc.reason).inc()
            raise
        except asyncio.TimeoutError:
            self._failed(url, "timeout")
            raise RouterError("timeout", public_url(url)) from None
        except aiohttp.ClientError as exc:
            self._failed(url, "connect")
            raise RouterError("connect", type(exc).__name__) from None
        else:
            self._succeeded(url)
        finally:
            server.outstanding -= 1
            metrics.ROUTER_OUTSTANDING.labels(self.name, public_url(url)).set(server.outstanding)
            metrics.ROUTER_REQUEST_SECONDS.labels(self.name, public_url(url)).observe(time.monotonic() - started)

    async def post_json(self, path: str, body: bytes, *, headers: dict[str, str],
                        parse: Callable[[Any], T], max_retries: int, backoff_s: float,
                        backoff_max_s: float, rejected: str = "rejected",
                        before_attempt: Callable[[], Awaitable[Any]] | None = None) -> T:
        """POST ``body`` (JSON) to ``path`` on the server ``pick`` chooses and return
        ``parse(answer)``. Timeouts, connection errors, 429 and 5xx are retried on another server
        where there is one, with exponential backoff and jitter; when the retries run out:
        ``Unavailable`` (an outage: the record is held). An answer ``parse`` cannot read, or
        one over ``max_reply_bytes``, is retried the same way; when the retries run out it is a
        ``BadReply`` (a ``Failure``: this record fails alone). Another 4xx means the request
        itself is bad: ``Failure(rejected)``, not retried. ``before_attempt`` runs before each
        attempt (the rate limiter's wait)."""
        assert self._session is not None, "router not started"
        tried: list[str] = []

        async def attempt_once() -> T:
            if before_attempt is not None:
                await before_attempt()
            async with self.lease(exclude=tried) as url:
                tried.append(url)
                async with self._session.post(url + path, data=body, headers=headers) as resp:
                    raw = await self._read_bounded(resp)
                    if resp.status in (429, 503):
                        delay = retry_after_s(resp.headers.get("Retry-After"), self.retry_after_max_s)
                        self.servers[url].not_before = time.monotonic() + delay
                    if resp.status == 429:
                        raise RouterError("http_429", public_url(url))
                    if resp.status >= 500:
                        raise RouterError("http_5xx", f"{public_url(url)}: HTTP {resp.status}")
                    if resp.status >= 400:  # the request's fault, not the server's
                        metrics.ROUTER_ERRORS.labels(self.name, public_url(url), "http_4xx").inc()
                        raise Failure(rejected, f"HTTP {resp.status}: "
                                         f"{raw[:300].decode(errors='replace')}")
                try:
                    return parse(orjson.loads(raw))
                except (orjson.JSONDecodeError, KeyError, IndexError, TypeError, ValueError,
                        AttributeError) as exc:
                    raise BadReply("bad_reply", f"{public_url(url)}: {type(exc).__name__}: {exc}"[:300]) from None

        def before_sleep(state) -> None:
            url = tried[-1] if tried else ""
            metrics.ROUTER_RETRIES.labels(self.name, public_url(url)).inc()
            log.warning("%s: request to %s failed (%s); retry %d of %d", self.name, public_url(url),
                        state.outcome.exception(), state.attempt_number, max_retries)

        retrying = AsyncRetrying(
            stop=stop_after_attempt(max_retries + 1),
            wait=wait_exponential_jitter(multiplier=backoff_s, max=backoff_max_s, jitter=backoff_s),
            retry=retry_if_exception_type((RouterError, BadReply)), reraise=True, before_sleep=before_sleep)
        try:
            return await retrying(attempt_once)
        except RouterError as exc:
            raise Unavailable(exc.reason, f"{self.name}: {len(tried)} attempts failed, last on "
                                    f"{public_url(tried[-1]) if tried else '?'}: {exc}") from None

    async def _read_bounded(self, resp: aiohttp.ClientResponse) -> bytes:
        """The reply's body, or ``BadReply("reply_too_large")`` as soon as it passes
        ``max_reply_bytes`` (a runaway judge cannot fill this member's memory)."""
        limit = self.max_reply_bytes
        if (resp.content_length or 0) > limit:
            raise BadReply("reply_too_large", f"{public_url(str(resp.url))}: Content-Length {resp.content_length} > {limit}")
        chunks, size = [], 0
        async for chunk in resp.content.iter_chunked(1 << 16):
            size += len(chunk)
            if size > limit:
                raise BadReply("reply_too_large", f"{public_url(str(resp.url))}: more than {limit} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def _failed(self, url: str, reason: str) -> None:
        metrics.ROUTER_ERRORS.labels(self.name, public_url(url), reason).inc()
        if reason == "http_429":  # the server is alive, only busy: never eject for that
            return
        server = self.servers[url]
        server.failures += 1
        if not server.ejected and server.failures >= self.eject_after:
            server.ejected = True
            log.warning("%s: ejected %s after %d consecutive failures (last: %s)",
                        self.name, public_url(url), server.failures, reason)
            self._export()

    def eject(self, url: str, reason: str) -> None:
        """Take ``url`` out of rotation now, whatever its failure count: its user saw it fail
        beyond doubt (the rollout fleet: a server that stopped streaming). A health check
        re-admits it as any ejected server."""
        metrics.ROUTER_ERRORS.labels(self.name, public_url(url), reason).inc()
        server = self.servers[url]
        server.failures = max(server.failures, self.eject_after)
        if not server.ejected:
            server.ejected = True
            log.warning("%s: ejected %s (%s)", self.name, public_url(url), reason)
            self._export()

    def _succeeded(self, url: str) -> None:
        self.servers[url].failures = 0

    def _export(self) -> None:
        metrics.ROUTER_EJECTED.labels(self.name).set(sum(s.ejected for s in self.servers.values()))

    @property
    def ejected(self) -> list[str]:
        return [s.url for s in self.servers.values() if s.ejected]

    # -- health checks -----------------------------------------------------------------------
    async def check(self, url: str) -> bool:
        """One health check: ``GET url + health_path`` answered 2xx in time. A pass re-admits an
        ejected server; a failure counts towards ejection like a failed request."""
        assert self._session is not None, "router not started"
        try:
            async with self._session.get(url + self.health_path, headers=self.headers,
                                         timeout=aiohttp.ClientTimeout(total=self.health_timeout_s)) as r:
                ok = 200 <= r.status < 300
        except (aiohttp.ClientError, asyncio.TimeoutError):
            ok = False
        server = self.servers[url]
        if ok:
            server.failures = 0
            if server.ejected:
                server.ejected = False
                log.warning("%s: re-admitted %s (health check passed)", self.name, public_url(url))
                self._export()
                for hook in self.on_readmit:
                    hook(url)
        else:
            self._failed(url, "health")
        return ok

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(u) for u in self.servers))

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval_s)
            try:
                await self.check_all()
            except Exception:  # noqa: BLE001 - a bug here must not stop the checks for good
                log.exception("%s: health check round failed", self.name)

    # -- reward_router_address -----------------------------------------------------------------
    async def start_proxy(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve a local proxy and return its ``HOST:PORT`` (verl's ``reward_router_address``).
        Every request is forwarded, method, path, query and body unchanged, to the server
        ``pick`` chooses; this router's headers (the API key) are added on the way, so a user
        function never needs the key."""
        from aiohttp import web

        if self.address:
            return self.address
        assert self._session is not None, "router not started"

        async def forward(request: web.Request) -> web.Response:
            body = await request.read()
            headers = {k: v for k, v in request.headers.items()
                       if k.lower() in ("content-type", "accept")}
            headers.update(self.headers)
            try:
                async with self.lease() as url:
                    async with self._session.request(request.method, url + request.path_qs,
                                                     data=body, headers=headers) as resp:
                        payload = await resp.read()
                        if resp.status >= 500 or resp.status == 429:
                            raise RouterError(f"http_{'429' if resp.status == 429 else '5xx'}")
                        return web.Response(body=payload, status=resp.status,
                                            content_type=resp.content_type)
            except RouterError as exc:  # before its base class: one server failed
                return web.Response(status=502, text=f"{self.name}: upstream failed: {exc.reason}")
            except Unavailable as exc:
                return web.Response(status=503, text=str(exc))

        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", forward)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        self._proxy = runner
        bound = runner.addresses[0]
        self.address = f"{bound[0]}:{bound[1]}"
        return self.address
