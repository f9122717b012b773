"""A fleet of inference servers that follows the learner: which server a request goes to, which
policy version answered it, and how each server loads a new version.

``rollout.backend: openai`` with ``rollout.servers: [url, ...]`` (``OpenAIBackend``). The
servers sit behind the judge's router (``streamrl.servers.router.Router``: least outstanding
requests, health checks, ejection after ``eject_after`` failures, re-admission). On top of it
the fleet keeps, per server, the policy version it has loaded, and narrows the router's choice
to the *eligible* servers:

- not loading weights now, and not out after a failed update;
- on the learner's latest version (``target``, the one the worker asked the fleet to follow),
  exactly as a local engine loads the latest version before its next generation: the staleness
  gate already spends ``max_staleness`` on how far production runs ahead of training, so a new
  request on an older version could reach the learner too old and be dropped;
- under ``max_requests_per_server`` requests in flight.

With none eligible a request waits (up to the request timeout; then ``BackendUnavailable``:
the worker holds the prompt and retries).

**Versions are true.** A request reads its server's version when it starts, and that is the
version its samples carry. A server never changes weights under a request: before an update
it stops taking new ones and either *drains* (waits for those in flight) or *aborts* them
(cancels the HTTP requests, which vLLM and SGLang abort on disconnect; the fleet resubmits them,
to a server that may be on the new version or an older allowed one). Only then does it load.
``partial`` *pauses* them where the server has pause/resume endpoints (``pause_on_update``):
SGLang ``POST /pause_generation {"mode": "retract"}`` (the running requests go back to its
queue, their KV cache freed), the load, ``POST /continue_generation``; vLLM ``POST
/pause?mode=keep&clear_cache=true`` (requests frozen in place, the KV and prefix caches
cleared; ``VLLM_SERVER_DEV_MODE=1``, as for its load), the load, ``POST /resume``. The streams
stay open: with the caches cleared, every token after the resume is computed on the new
weights, prompt and partial response included. A request's ``Stamp`` says which version its
tokens are: the fleet moves it to the new version just before the resume (nothing decodes
while paused, so the tokens that arrive before are the old version's). Where the server has no
such endpoint (404) or ``pause_on_update`` is off, ``partial`` cuts the requests as ``abort``
does, and the backend continues each from the tokens it had streamed with a new request
(``OpenAIBackend._complete_partial``); a vLLM that answers the pause by aborting its requests
(``finish_reason: abort``, releases before the ``keep`` mode) is continued the same way.

**Updates** (``follow``) run per server in the background, all servers at once: SGLang ``POST
/update_weights_from_disk {"model_path"}``; vLLM ``POST /collective_rpc {"method":
"streamrl_load_weights", "args": [path]}`` (streamrl's worker extension,
``streamrl.rollout.vllm_extension``; the endpoint exists when the server runs with
``VLLM_SERVER_DEV_MODE=1``) then ``POST /reset_prefix_cache``. A failed update (HTTP error,
``success: false``, timeout) takes the server out, counts in
``streamrl_rollout_server_update_failures_total``, and is retried with exponential backoff
(``update_retry_s`` .. ``update_retry_max_s``) on the newest target until it succeeds: the
server rejoins. A server the router re-admits after failing health checks may have restarted
on its initial weights, so it is out until it has loaded the target again.

**Nothing before an announcement.** A server's starting weights are no version until the
learner's announcement names them (``Member.version`` None: not eligible): an announced path is
loaded first unless ``started_on`` is exactly it, and a version 0 announced with no path
declares the starting weights to be version 0 (``starting``). Requests wait until then: a
token of weights no announcement named would be stamped with a version it is not, and under
``partial`` a response would mix two sets of weights under one stamp (issue 57).

**Servers that hang.** With ``stream_timeout_s`` the fleet watches its servers' streams
(``_watch_streams``): one with requests in flight that streamed nothing for that long is
ejected as a failing one is, and its requests are cut (``Stamp.hung``); the backend continues
each on another server from the tokens it had streamed, under any ``on_update``.

The path a server loads is the learner's ``weights_uri`` as announced: the servers must see the
same directory (a shared volume, as in the compose file and the Kubernetes manifests). A version
published as a delta (``learner.weights_delta``) is rebuilt by the rollout worker into a full
directory under ``$STREAMRL_WEIGHTS_CACHE`` (``server_path``), which the servers load as any
full version: on a shared volume, point that variable at it too.

**LoRA adapters** (``learner.lora``: a version is an adapter on a base, ``base_uri`` in its
record). A server loads the base once through the full-weights API above (unless it was started
on exactly that path), then each version's adapter under a new name with the servers' LoRA API:
vLLM ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` (the server runs with
``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), SGLang ``POST
/load_lora_adapter`` (``--enable-lora``, ``--max-lora-rank``, ``--lora-target-modules``). Requests
name the adapter as their ``model`` (SGLang: ``<model>:<adapter>``), so a request keeps the
adapter it started on whatever loads meanwhile: with ``drain`` the requests in flight finish on
the old adapter while the new one loads (no pause), with ``abort`` they are cut and resubmitted
as for full weights. The old adapter is unloaded (``/v1/unload_lora_adapter``,
``/unload_lora_adapter``) once the requests that named it have finished. A server without the
LoRA endpoint (404) cannot follow: it is not retried, ``fatal`` says why and the worker stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import orjson
from tenacity import AsyncRetrying, RetryCallState, retry_if_not_exception_type, wait_exponential

from streamrl import metrics, weights
from streamrl.errors import Unavailable
from streamrl.weights.delta import MANIFEST, SUFFIX
from streamrl.servers.router import Router, public_url, server_root

log = logging.getLogger(__name__)

VLLM_METHOD = "streamrl_load_weights"  # the worker extension's method (vllm_extension.py)


class UpdateError(Exception):
    """A server did not load a version."""


class AdapterUnsupported(UpdateError):
    """A server has no LoRA endpoint (404 on it): it cannot follow a learner that publishes
    adapters until it is restarted with LoRA on; not retried (``ServerFleet.fatal``)."""


@dataclass
class Stamp:
    """The policy version a request's tokens are generated on now: the server's version when it
    started, moved by the fleet when the server loads new weights under it (a paused update).
    ``member``: the server it streams from (each chunk is a sign of life, ``Member.last_chunk``);
    ``hung``: the fleet cut it because that server stopped streaming (continued elsewhere)."""

    version: int
    member: "Member | None" = None
    hung: bool = False


@dataclass
class Member:
    """One server of the fleet, as the fleet sees it."""

    url: str
    completions_url: str = ""  # where its /completions is (an OpenAI base URL keeps its path)
    # the policy version loaded; None: weights no announcement named (its starting weights before
    # the learner's version 0 is loaded or declared to be them, or a restart): not served
    version: int | None = None
    started: bool = True  # still on the weights it was started with (never loaded one)
    updating: bool = False  # no new requests: draining / aborting / loading
    out: bool = False  # its last update failed: out of rotation until one succeeds
    failures: int = 0  # consecutive failed updates
    inflight: set[asyncio.Task] = field(default_factory=set)
    stamps: dict[asyncio.Task, Stamp] = field(default_factory=dict)  # the in-flight requests' versions
    pausable: bool = True  # on_update partial: pause/resume endpoints (False once one answered 404)
    task: asyncio.Task | None = None  # the update loop, while one runs
    adapter: str | None = None  # LoRA: the adapter requests name (None: the model's own weights)
    base: str | None = None  # LoRA: the base weights loaded (the adapters' base_uri)
    # stream watch (stream_timeout_s): when it last streamed a chunk (or became busy), and whether
    # its streams are silent on purpose (paused for a load)
    last_chunk: float = 0.0
    paused: bool = False


def completions_url(given: str, root: str) -> str:
    """``/v1/completions`` under a server root (``http://host:8000``, ``.../v1``), or
    ``/completions`` under an API base URL with a path of its own (``https://host/openai/v2``)."""
    path = urllib.parse.urlsplit(given.strip().rstrip("/")).path
    return root + ("/v1/completions" if path in ("", "/v1") or path.endswith("/v1") else "/completions")


def expand_servers(urls: list[str]) -> list[str]:
    """Server roots; a ``dns+http://name:port`` entry is one URL per address the name resolves
    to (a Kubernetes headless service), resolved once, at start."""
    out: list[str] = []
    for url in urls:
        if url.startswith("dns+"):
            parts = urllib.parse.urlsplit(url.removeprefix("dns+"))
            port = parts.port or (443 if parts.scheme == "https" else 80)
            infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
            for addr in sorted({i[4][0] for i in infos}):
                host = f"[{addr}]" if ":" in addr else addr
                out.append(f"{parts.scheme}://{host}:{port}")
        else:
            out.append(server_root(url))
    return list(dict.fromkeys(out))


def _same_path(a: str | None, b: str) -> bool:
    if not a:
        return False
    return Path(a.removeprefix("file://")).resolve() == Path(b.removeprefix("file://")).resolve()


def server_path(uri: str) -> str:
    """The path a server loads for version ``uri``: the directory as announced, or, for a version
    published as a delta (``learner.weights_delta``), the full version rebuilt from it beside the
    servers (``streamrl.weights.weights_path``: under ``$STREAMRL_WEIGHTS_CACHE``, which the
    servers must see too). A delta that cannot be rebuilt fails the load (a ``WeightLoadError``),
    and the retry starts from the chain's full version."""
    path = uri.removeprefix("file://")
    if (Path(path) / MANIFEST).is_file() or any(Path(path).glob(f"*{SUFFIX}")):  # a delta, or one cut short
        return str(weights.weights_path(uri))
    return path


class ServerFleet:
    def __init__(self, urls: list[str], *, update_api: str = "none", on_update: str = "drain",
                 max_requests_per_server: int = 0, headers: dict[str, str] | None = None,
                 update_timeout_s: float = 600.0, update_retry_s: float = 1.0, update_retry_max_s: float = 60.0,
                 health_interval_s: float = 5.0, eject_after: int = 3, started_on: str | None = None,
                 pause_on_update: bool = True, stream_timeout_s: float = 0.0, initial_version: int | None = None):
        self.urls = expand_servers(urls)
        self.started_on = started_on  # the weights' path the servers were started on, if known
        self.router = Router(self.urls, name="rollout", health_interval_s=health_interval_s,
                             eject_after=eject_after, headers=dict(headers or {}))
        given = {server_root(u): u for u in urls}
        # initial_version: what the servers' starting weights are served as before any load: None
        # (a fleet that follows the learner: nothing until an announcement names them or they have
        # loaded one, ``starting``), or 0 where the servers keep their weights (update_api none,
        # rollout.follow_policy false)
        self.members = {u: Member(u, completions_url(given.get(u, u), u), version=initial_version)
                        for u in self.router.servers}
        self.stream_timeout_s = stream_timeout_s  # 0: streams not watched
        self.failed_over = 0  # requests cut from a server that stopped streaming, continued elsewhere
        self._watch: asyncio.Task | None = None
        self.update_api, self.on_update = update_api, on_update
        self.pause_on_update = pause_on_update  # partial: pause/resume where the servers have it
        self.paused = 0  # updates that paused a server's requests in place (partial)
        self.max_requests = max_requests_per_server
        self.headers = dict(headers or {})
        self.update_timeout_s = update_timeout_s
        self.retry_s, self.retry_max_s = update_retry_s, update_retry_max_s
        self.target = 0  # the version the fleet follows (the learner's latest)
        self.target_uri: str | None = None
        self.target_base: str | None = None  # LoRA: target_uri is an adapter on this base
        self.adapter_loads = 0  # adapter names handed out (each load attempt gets a new one)
        # in every adapter name: rollout workers sharing servers never name (or unload) each other's
        self.tag = uuid.uuid4().hex[:6]
        self._retiring: set[asyncio.Task] = set()  # unloads of adapters waiting for their requests
        self.aborted = 0  # requests aborted for an update and resubmitted
        self.discarded = 0  # tokens streamed, then thrown away by those aborts
        self.continued = 0  # requests cut for an update and continued from their partial response
        self.fatal: str | None = None  # why the fleet cannot follow the learner (a server without LoRA)
        self._changed = asyncio.Event()
        self._session: Any = None
        self.router.on_readmit.append(self._readmitted)
        self._export()

    # -- lifecycle ------------------------------------------------------------------------------
    async def start(self, session: Any) -> None:
        self._session = session
        await self.router.start(session)
        if self.stream_timeout_s > 0 and self._watch is None:
            self._watch = asyncio.create_task(self._watch_streams(), name="rollout-stream-watch")

    async def close(self) -> None:
        tasks = [m.task for m in self.members.values() if m.task] + list(self._retiring)
        tasks += [self._watch] if self._watch else []
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.router.close()

    # -- choosing a server ------------------------------------------------------------------------
    @property
    def floor(self) -> int:
        """The oldest version a new request may be sent to (requests in flight finish where they
        are: drained, or aborted and resubmitted)."""
        return self.target

    def eligible(self, url: str) -> bool:
        m = self.members[url]
        if m.updating or m.out or m.version is None or m.version < self.floor:
            return False
        return not self.max_requests or self.router.servers[url].outstanding < self.max_requests

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
        self._export()

    @contextlib.asynccontextmanager
    async def lease(self, exclude: list[str] | tuple[str, ...] = (), wait_s: float = 300.0
                    ) -> AsyncIterator[tuple[Member, int]]:
        """An eligible server and the version it has now, counted as in flight while the block
        runs (the router's lease: failures count towards ejection). Waits up to ``wait_s`` for
        one; then ``Unavailable``."""
        deadline = time.monotonic() + wait_s
        while True:
            changed = self._changed
            entered = False
            try:
                async with self.router.lease(exclude, self.eligible) as url:
                    m = self.members[url]
                    if self.eligible_now(m):  # else an update began while the router waited
                        entered = True
                        yield m, int(m.version)  # type: ignore[arg-type]
                        return
            except Unavailable:  # none to pick (the block's own errors are the caller's)
                if entered or time.monotonic() >= deadline:
                    raise
            finally:
                self._changed.set()  # a slot is free: a waiter may go
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(changed.wait(), min(0.5, max(deadline - time.monotonic(), 0.01)))

    def eligible_now(self, m: Member) -> bool:
        """Eligible with this request already counted (the router counts it before yielding)."""
        return not (m.updating or m.out or m.version is None or m.version < self.floor)

    # -- following the learner ----------------------------------------------------------------------
    def model_for(self, m: Member, model: str) -> str:
        """What a request to ``m`` names as its ``model``: the served model, or the LoRA adapter
        the server is on (SGLang: ``model:adapter``)."""
        if m.adapter is None:
            return model
        return f"{model}:{m.adapter}" if self.update_api == "sglang" else m.adapter

    def follow(self, uri: str, version: int, base_uri: str | None = None) -> None:
        """Have every server load ``version`` from ``uri`` (in the background); ``base_uri``: the
        version is a LoRA adapter on that base (module docstring). A server still on the weights
        it was started with serves them as ``version`` without a load only if it was started on
        exactly ``uri`` (``started_on``): ``streamrl run`` announces its warm start as version 0,
        and a server started on the base model would otherwise answer requests stamped 0 with
        other weights (issue 57: until then it serves nothing, ``Member.version`` None)."""
        self.target, self.target_uri, self.target_base = version, uri, base_uri
        same = _same_path(self.started_on, uri) and base_uri is None
        for m in self.members.values():
            if m.started:  # on its starting weights
                m.version = version if same else None  # None: not served until it has loaded
        log.info("rollout servers: loading policy version %d on %d servers (%s)", version,
                 len(self.members), self.on_update)
        for m in self.members.values():
            self._schedule(m)
        self._notify()

    def starting(self, version: int) -> None:
        """The learner announced ``version`` (0) with no weights to load: its weights are the
        ones the servers were started with (``rollout.policy``), so a server on them serves them
        as that version from now on; one that has loaded other weights keeps its own version."""
        self.target, self.target_uri, self.target_base = version, None, None
        for m in self.members.values():
            if m.started:
                m.version = version
        self._notify()

    def _schedule(self, m: Member) -> None:
        if self.target_uri is None or self.update_api == "none":
            return
        if m.task is None or m.task.done():
            m.task = asyncio.create_task(self._update_loop(m), name=f"update:{public_url(m.url)}")

    def _readmitted(self, url: str) -> None:
        """A server back from failing health checks (or a hang) may have restarted on its
        initial weights."""
        m = self.members[url]
        m.last_chunk = time.monotonic()
        if self.target_uri is not None and self.update_api != "none":
            m.version, m.started = None, True
            m.adapter = m.base = None  # (a restart lost its adapters and base: loaded again)
            self._schedule(m)
        self._notify()

    async def _update_loop(self, m: Member) -> None:
        while m.version != self.target:
            # any failure takes the server out of rotation and is retried, the target re-read
            # each time (tenacity: retry_s, doubling, at most retry_max_s); a cancelled loop (the
            # fleet closing) ends: tenacity would swallow the cancellation as a failure
            retrying = AsyncRetrying(wait=wait_exponential(multiplier=self.retry_s, max=self.retry_max_s),
                                     retry=retry_if_not_exception_type((AdapterUnsupported, asyncio.CancelledError)),
                                     reraise=True,
                                     before_sleep=lambda state: self._failed(m, state))
            try:
                async for attempt in retrying:
                    with attempt:
                        version, uri, base = self.target, self.target_uri, self.target_base
                        assert uri is not None
                        started = time.monotonic()
                        if base is None:
                            if not await self._paused_load(m, uri, version):
                                await self._quiesce(m)
                                await asyncio.wait_for(self._load(m.url, uri, version), self.update_timeout_s)
                            old, m.adapter, m.base = m.adapter, None, None
                        else:
                            old = await self._load_lora(m, uri, base, version)
            except AdapterUnsupported as exc:  # not retried: the worker stops, saying why
                m.updating, m.out, self.fatal = False, True, str(exc)
                log.error("rollout server %s", exc)
                self._notify()
                return
            took = time.monotonic() - started
            if old is not None:  # unloaded once the requests that named it are done
                self._retire(m, old)
            if m.out:
                log.warning("rollout server %s: loaded policy version %d after %d failed attempts; back "
                            "in rotation", public_url(m.url), version, m.failures)
            m.version, m.updating, m.out, m.failures, m.started = version, False, False, 0, False
            metrics.ROLLOUT_SERVER_UPDATE_SECONDS.observe(took)
            metrics.ROLLOUT_SERVER_VERSION.labels(public_url(m.url)).set(version)
            log.info("rollout server %s: policy version %d loaded in %.2f s", public_url(m.url), version, took)
            self._notify()
        m.updating = False

    def _failed(self, m: Member, state: RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome else None
        why = "timeout" if isinstance(exc, asyncio.TimeoutError) else str(exc)[:300]
        m.updating, m.out = False, True
        m.failures += 1
        metrics.ROLLOUT_SERVER_UPDATE_FAILURES.labels(public_url(m.url)).inc()
        log.error("rollout server %s: loading policy version %d failed (%s); out of rotation, retrying in %.1f s",
                  public_url(m.url), self.target, why, state.next_action.sleep if state.next_action else 0.0)
        self._notify()

    async def _load_lora(self, m: Member, uri: str, base: str, version: int) -> str | None:
        """The base once (full weights, quiesced as for any full load), then the version's adapter
        under a new name; the server's requests name it from now on. Returns the adapter it
        replaces (unloaded after its requests finish)."""
        if m.base != base and not _same_path(self.started_on, base):
            await self._quiesce(m)
            await asyncio.wait_for(self._load(m.url, base, version), self.update_timeout_s)
            if m.adapter is not None:  # made for other base weights: never named again
                self._retire(m, m.adapter)
                m.adapter = None
        m.base = base
        m.updating = True  # no new requests until it is on the version (those in flight go on)
        self._notify()
        if self.on_update in ("abort", "partial"):  # partial: each continues after the load
            for t in list(m.inflight):
                t.cancel()
        self.adapter_loads += 1
        name = f"streamrl-v{version}-{self.tag}-{self.adapter_loads}"
        try:
            await asyncio.wait_for(self._adapter_call(m.url, "load", name, uri), self.update_timeout_s)
        except BaseException:
            self._retire(m, name)  # it may have loaded after all (a timeout): not left behind
            raise
        old, m.adapter = m.adapter, name
        return old

    def _retire(self, m: Member, name: str) -> None:
        """Unload adapter ``name`` from ``m`` once the requests in flight now have finished
        (those that named it are among them: no new request names it any more)."""
        waiting = {t for t in m.inflight if not t.done()}

        async def unload() -> None:
            if waiting:
                await asyncio.wait(waiting)
            try:
                await asyncio.wait_for(self._adapter_call(m.url, "unload", name), self.update_timeout_s)
            except Exception as exc:  # noqa: BLE001 - a leftover adapter costs server memory, not the run
                log.warning("rollout server %s: unloading adapter %s failed (%s)", public_url(m.url), name,
                            str(exc)[:200])

        task = asyncio.create_task(unload(), name=f"unload:{name}")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _post(self, url: str, route: str, body: dict[str, Any] | None) -> tuple[int, str]:
        """One control call to a server (weights, adapters): its status and text; a connection
        that fails is an ``UpdateError`` naming the route."""
        import aiohttp

        try:
            async with self._session.post(url + route, headers=self.headers, json=body,
                                          timeout=aiohttp.ClientTimeout(total=self.update_timeout_s)) as resp:
                return resp.status, await resp.text()
        except aiohttp.ClientError as exc:
            raise UpdateError(f"{route}: {type(exc).__name__}: {exc}") from None

    async def _adapter_call(self, url: str, op: str, name: str, uri: str | None = None) -> None:
        """vLLM's ``/v1/{op}_lora_adapter`` or SGLang's ``/{op}_lora_adapter``."""
        route = f"/v1/{op}_lora_adapter" if self.update_api == "vllm" else f"/{op}_lora_adapter"
        body: dict[str, Any] = {"lora_name": name}
        if uri is not None:
            body["lora_path"] = uri.removeprefix("file://")
        status, text = await self._post(url, route, body)
        if status == 404 and op == "load" and "lora" not in text.lower():
            raise AdapterUnsupported(f"{public_url(url)}{route}: HTTP 404: this server cannot take LoRA adapters "
                              "(vLLM: start it with "
                              "--enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; SGLang: --enable-lora; "
                              "or set learner.lora.merge_for_servers)")
        if status >= 300:
            raise UpdateError(f"{route}: HTTP {status}: {text[:200]}")
        try:  # SGLang answers {"success": ..., "error_message": ...}; vLLM a line of text
            answer = orjson.loads(text)
        except orjson.JSONDecodeError:
            answer = {}
        if isinstance(answer, dict) and answer.get("success") is False:
            raise UpdateError(f"{route}: {str(answer.get('error_message') or answer.get('message'))[:200]}")

    async def _quiesce(self, m: Member) -> None:
        """No new requests to ``m``; then wait for (drain) or cancel (abort) those in flight."""
        m.updating = True
        self._notify()
        if self.on_update in ("abort", "partial"):  # partial: each continues after the load
            for t in list(m.inflight):
                t.cancel()
        while self.router.servers[m.url].outstanding > 0:
            await asyncio.sleep(0.02)

    #: on_update partial: each update API's pause and resume calls (route, body); vLLM's mode
    #: and clear_cache are query parameters
    PAUSE = {"sglang": (("/pause_generation", {"mode": "retract"}), ("/continue_generation", {})),
             "vllm": (("/pause?mode=keep&clear_cache=true", None), ("/resume", None))}

    async def _paused_load(self, m: Member, uri: str, version: int) -> bool:
        """``on_update: partial`` on a server with pause/resume endpoints: pause its requests in
        place, load, move their stamps to ``version``, resume (module docstring). False where it
        cannot (not partial, ``pause_on_update`` off, or the pause endpoint answered 404: the
        server is not asked again and the caller cuts and continues its requests instead)."""
        if self.on_update != "partial" or not self.pause_on_update or not m.pausable \
                or self.update_api not in self.PAUSE:
            return False
        (pause, pause_body), (resume, resume_body) = self.PAUSE[self.update_api]
        m.updating = True  # no new requests; those in flight stay open, paused
        self._notify()
        status, text = await self._post(m.url, pause, pause_body)
        if status == 404:
            m.pausable = False
            log.warning("rollout server %s: no %s (HTTP 404): partial rollouts continue by new requests there",
                        public_url(m.url), pause.split("?")[0])
            return False
        if status >= 300:
            raise UpdateError(f"{pause}: HTTP {status}: {text[:200]}")
        # paused: its streams are silent on purpose, not a hang (_watch_streams); a server that
        # froze before it answered the pause is still watched (its requests go elsewhere), one
        # that freezes while loading is noticed when the load times out (update_timeout_s)
        m.paused = True
        try:
            try:
                await asyncio.wait_for(self._load(m.url, uri, version, paused=True), self.update_timeout_s)
            except BaseException:
                with contextlib.suppress(Exception):  # on the weights it has: the requests go on, stamped as they were
                    await self._post(m.url, resume, resume_body)
                raise
            for stamp in m.stamps.values():  # nothing decoded while paused: from here on, the new version's
                stamp.version = version
            m.version = version
            status, text = await self._post(m.url, resume, resume_body)
            if status >= 300:
                raise UpdateError(f"{resume}: HTTP {status}: {text[:200]}")
        finally:
            m.paused, m.last_chunk = False, time.monotonic()  # the silence is measured from the resume
        self.paused += 1
        return True

    async def _load(self, url: str, uri: str, version: int, paused: bool = False) -> None:
        """The update API's load calls; ``paused``: vLLM's pause already cleared the prefix cache
        (its reset would fail with requests frozen in place)."""
        path = await asyncio.to_thread(server_path, uri)
        if self.update_api == "sglang":
            calls = [("/update_weights_from_disk", {"model_path": path})]
        elif self.update_api == "vllm":
            calls = [("/collective_rpc", {"method": VLLM_METHOD, "args": [path]}),
                     *([] if paused else [("/reset_prefix_cache", None)])]
        else:
            raise UpdateError(f"update_api {self.update_api!r}")
        for route, body in calls:
            status, text = await self._post(url, route, body)
            if status >= 300:
                raise UpdateError(f"{route}: HTTP {status}: {text[:200]}")
            if route == "/update_weights_from_disk":  # SGLang answers 200 or 400 with success
                try:
                    answer = orjson.loads(text)
                except orjson.JSONDecodeError:
                    answer = {}
                if isinstance(answer, dict) and answer.get("success") is False:
                    raise UpdateError(f"{route}: {str(answer.get('message'))[:200]}")

    # -- servers that stop streaming --------------------------------------------------------------
    async def _watch_streams(self) -> None:
        """Every server with requests in flight must stream: one that sent nothing on any of
        them for ``stream_timeout_s`` (a frozen process, a machine gone with its connections
        left open, which no TCP error ever reports) is cut out (``_hung``). Measured per server,
        not per request: a request queued behind others streams nothing for a long time on a
        healthy server, whose running requests stream meanwhile; a paused load is silent on
        purpose and not counted. One clock read per chunk (``Member.last_chunk``) is all the
        streams pay; this loop wakes a few times a second."""
        every = min(0.25, self.stream_timeout_s / 10)
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            for m in self.members.values():
                if m.inflight and not m.paused and now - m.last_chunk > self.stream_timeout_s:
                    self._hung(m, now - m.last_chunk)

    def _hung(self, m: Member, silent_s: float) -> None:
        """``m`` stopped streaming: ejected as a failing server is (a health check re-admits it,
        and it reloads the learner's version first), and each of its requests cut: the backend
        continues it on another server from the tokens it had streamed (``Stamp.hung``)."""
        metrics.ROLLOUT_SERVER_HANGS.labels(public_url(m.url)).inc()
        log.error("rollout server %s: nothing streamed for %.1f s with %d requests in flight "
                  "(rollout.openai.stream_timeout_s %.1f): ejected; its requests continue on another server",
                  public_url(m.url), silent_s, len(m.inflight), self.stream_timeout_s)
        if self.router.health_interval_s > 0:  # else nothing would ever re-admit it
            self.router.eject(m.url, "stream_timeout")
        for stamp in m.stamps.values():
            stamp.hung = True
        for t in list(m.inflight):
            t.cancel()
        m.last_chunk = time.monotonic()
        self._notify()

    # -- reporting ----------------------------------------------------------------------------------
    def _export(self) -> None:
        counts = dict.fromkeys(("latest", "loading", "out"), 0)
        for m in self.members.values():
            counts[self._state(m)] += 1
        metrics.ROLLOUT_SERVERS_OUT.set(counts["out"])
        for state, n in counts.items():
            metrics.ROLLOUT_SERVERS.labels(state).set(n)

    def _state(self, m: Member) -> str:
        """latest, loading (updating, or not yet on the target) or out."""
        if m.out or m.url in self.router.ejected:
            return "out"
        return "loading" if m.updating or m.version != self.target else "latest"

    def status(self) -> str:
        """One line for the worker's log: each server's version, and which are out and why."""
        parts = []
        for m in self.members.values():
            state = ("ejected" if m.url in self.router.ejected else "update failed" if m.out
                     else "updating" if m.updating else "ok")
            lora = f" adapter {m.adapter}" if m.adapter else ""
            parts.append(f"{public_url(m.url)} v{'?' if m.version is None else m.version}{lora} {state} "
                         f"({self.router.servers[m.url].outstanding} in flight)")
        return f"rollout servers: target v{self.target} | " + " | ".join(parts)

    @property
    def out(self) -> list[str]:
        return [m.url for m in self.members.values() if m.out or m.url in self.router.ejected]
