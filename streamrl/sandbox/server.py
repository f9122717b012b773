"""``streamrl sandbox``'s HTTP service: SandboxFusion's API, so verl's sandbox client (and any
other SandboxFusion user) calls it unchanged.

- ``POST /run_code``: SandboxFusion's ``RunCodeRequest`` (``code``, ``language``, ``stdin``,
  ``run_timeout``, ``compile_timeout``, ``memory_limit_MB``, ``files``, ``fetch_files``) →
  ``RunCodeResponse`` (``status`` Success / Failed / SandboxError, ``message``,
  ``compile_result``, ``run_result`` with ``status``, ``execution_time``, ``return_code``,
  ``stdout``, ``stderr``). As in SandboxFusion, a program that fails (non-zero exit, killed at a
  limit, over its time) is ``Failed``; ``SandboxError`` is the service's own failure only, which a
  caller may retry elsewhere.
- ``GET /v1/ping`` (``pong``, as SandboxFusion), ``GET /health`` (the isolation, languages, slots,
  queue), ``GET /metrics`` (Prometheus, ``streamrl_sandbox_*``).

The service's limits cap what a request may ask: a request's ``run_timeout`` and
``memory_limit_MB`` are taken up to the service's maxima.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from streamrl import metrics
from streamrl.sandbox.isolation import Executor, Limits, RunResult

#: SandboxFusion's request fields, by type (anything else in a request is ignored, as pydantic does)
_NUMBER_FIELDS = ("compile_timeout", "run_timeout")


@dataclass(frozen=True)
class ServiceLimits:
    """The most a request may ask for, and the limits it cannot change."""

    max_run_timeout_s: float = 30.0
    max_memory_mb: int = 2048
    default_memory_mb: int = 1024  # a request's memory_limit_MB of -1 (SandboxFusion's default)
    base: Limits = Limits()

    def for_request(self, run_timeout: float, memory_mb: int) -> Limits:
        memory = self.default_memory_mb if memory_mb <= 0 else min(memory_mb, self.max_memory_mb)
        wall = min(max(run_timeout, 0.1), self.max_run_timeout_s)
        return dataclasses.replace(self.base, wall_s=wall, memory_mb=memory, cpu_s=0.0)


class BadRequest(ValueError):
    pass


def parse_request(body: Any) -> dict[str, Any]:
    """SandboxFusion's ``RunCodeRequest`` as plain values, or ``BadRequest`` naming the field."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object (SandboxFusion's RunCodeRequest)")
    code, language = body.get("code"), body.get("language")
    if not isinstance(code, str):
        raise BadRequest("field 'code' must be a string")
    if not isinstance(language, str):
        raise BadRequest("field 'language' must be a string")
    stdin = body.get("stdin")
    if stdin is not None and not isinstance(stdin, str):
        raise BadRequest("field 'stdin' must be a string or null")
    out: dict[str, Any] = {"code": code, "language": language, "stdin": stdin}
    for name in _NUMBER_FIELDS:
        value = body.get(name, 10)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BadRequest(f"field {name!r} must be a number of seconds")
        out[name] = float(value)
    memory = body.get("memory_limit_MB", -1)
    if isinstance(memory, bool) or not isinstance(memory, int):
        raise BadRequest("field 'memory_limit_MB' must be an integer (-1: the service's default)")
    out["memory_limit_MB"] = memory
    if body.get("files") or body.get("fetch_files"):
        raise BadRequest("fields 'files' / 'fetch_files': this sandbox runs one program with stdin; "
                         "files in and out are not served")
    return out


def response(result: RunResult) -> dict[str, Any]:
    """SandboxFusion's ``RunCodeResponse`` for one run."""
    if result.status == "Error":
        status, message = "SandboxError", result.stderr
    elif result.status == "TimeLimitExceeded" or result.return_code != 0:
        status, message = "Failed", ""
    else:
        status, message = "Success", ""
    return {"status": status, "message": message, "compile_result": None, "run_result": result.api(),
            "executor_pod_name": socket.gethostname(), "files": {}}


def outcome(result: RunResult) -> str:
    if result.status == "Error":
        return "sandbox_error"
    if result.limit:
        return f"{result.limit}_limit"
    return "success" if result.return_code == 0 else "failed"


def build_app(executor: Executor, limits: ServiceLimits) -> web.Application:
    metrics.SANDBOX_SLOTS.set(executor.n_slots)
    iso = executor.isolation
    metrics.SANDBOX_ISOLATION.info({"level": iso.level, "tool": iso.tool or "none",
                                    "layers": ",".join(k for k, v in iso.layers.items() if v),
                                    "slot_uids": str(iso.slot_uids).lower()})
    running = {"n": 0}
    metrics.SANDBOX_WAITING.set_function(lambda: executor.waiting)
    metrics.SANDBOX_IN_FLIGHT.set_function(lambda: running["n"])

    async def run_code(request: web.Request) -> web.Response:
        try:
            args = parse_request(orjson.loads(await request.read()))
        except (orjson.JSONDecodeError, BadRequest) as exc:
            metrics.SANDBOX_REJECTED.labels("bad_request").inc()
            return web.json_response({"detail": str(exc)}, status=422)
        run_limits = limits.for_request(args["run_timeout"], args["memory_limit_MB"])
        language = args["language"] if args["language"] in executor.runtimes else "other"
        running["n"] += 1
        metrics.SANDBOX_REQUESTS.inc()
        started = time.perf_counter()
        try:
            result = await executor.run(args["language"], args["code"], args["stdin"], run_limits)
        finally:
            running["n"] -= 1
        metrics.SANDBOX_EXECUTIONS.labels(language, outcome(result)).inc()
        metrics.SANDBOX_SECONDS.labels(language).observe(time.perf_counter() - started)
        return web.Response(body=orjson.dumps(response(result)), content_type="application/json")

    async def ping(_: web.Request) -> web.Response:
        return web.json_response("pong")

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "isolation": iso.level, "tool": iso.tool,
                                  "layers": iso.layers, "languages": executor.languages(),
                                  "slots": executor.n_slots, "waiting": executor.waiting,
                                  "in_flight": running["n"]})

    async def prometheus(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application(client_max_size=16 << 20)
    app.router.add_post("/run_code", run_code)
    app.router.add_get("/v1/ping", ping)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", prometheus)
    return app


def default_slots() -> int:
    return max(1, len(os.sched_getaffinity(0)))
