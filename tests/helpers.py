"""Helpers for the tests: reading topics back, real HTTP servers in the test process, and the
one reader of what the tests take from other projects (``shared/`` beside the clone)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Callable

import pytest
from aiohttp import web

from streamrl.bus import Bus, Message


#: beside the clone, as CI lays it: GSM8K (data/gsm8k/) and the deployment schemas (schemas/),
#: which the repository does not carry (it holds only what this project wrote)
SHARED = Path(__file__).resolve().parent.parent.parent / "shared"


def shared_path(rel: str) -> Path:
    """A file or folder of ``shared/`` beside the clone; a test that needs one fails (never skips)
    naming the path when it is not there."""
    path = SHARED / rel
    if not path.exists():
        pytest.fail(f"{path} is missing: the tests read it from the shared/ folder beside the clone "
                    f"(as CI lays it); put a copy there", pytrace=False)
    return path


def gsm8k_path(split: str = "test") -> Path:
    """GSM8K's ``train`` or ``test`` split as JSONL rows of ``question`` and ``answer``."""
    return shared_path(f"data/gsm8k/{split}.jsonl")


def gsm8k_run_config() -> list[str]:
    """``streamrl run`` arguments for the embedded pipeline on GSM8K rows from shared/ (the
    packaged ``local-gsm8k.yaml``, no warm start): the tests of the pipeline's mechanics (faults,
    resume, learner ranks, Ray, multi-turn) run at the shapes they were written for; the default
    config's generated task is for the tests of learning."""
    return ["configs/local-gsm8k.yaml", f"feed.dataset={gsm8k_path('train')}"]


async def read_topic(bus: Bus, topic: str, n: int, timeout_s: float = 30.0) -> list[Message]:
    """Read ``n`` messages of ``topic`` from the beginning, without a consumer group."""
    consumer = bus.consumer([topic], None, "test")
    await consumer.start()
    out: list[Message] = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < n and time.monotonic() < deadline:
            out.extend(await consumer.getmany(timeout_ms=200))
    finally:
        await consumer.stop()
    return out


def read_topic_sync(bus: Bus, topic: str, n: int, timeout_s: float = 30.0) -> list[Message]:
    return asyncio.run(read_topic(bus, topic, n, timeout_s))


async def serve_app(app, port: int = 0):
    """Serve an aiohttp ``app`` on 127.0.0.1 (``port`` 0: a free one), as the real judges, reward
    servers and completion servers of the tests do. Returns ``(runner, "http://127.0.0.1:PORT")``;
    ``await runner.cleanup()`` stops it."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, reuse_address=True).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


class AppServer:
    """A real HTTP server in the test process: a subclass adds its routes in ``routes``;
    ``await start()`` serves them on a free port (``self.url``), ``await stop()`` ends it."""

    _runner: web.AppRunner | None = None
    url = ""

    def routes(self, app: web.Application) -> None:
        raise NotImplementedError

    async def start(self):
        app = web.Application()
        self.routes(app)
        self._runner, self.url = await serve_app(app)
        return self

    async def stop(self) -> None:
        if self._runner:
            await self._runner.cleanup()


class JudgeServer(AppServer):
    """A judge speaking the OpenAI chat API: ``POST /v1/chat/completions`` answers ``reply`` (a
    string, or a function of the last message's content) after ``latency`` seconds;
    ``GET /v1/models`` is its health check. ``failing`` makes both answer 503; ``fail_next``
    makes the next N chat requests answer 500."""

    def __init__(self, reply: "str | Callable[[str], str]" = "The answer is right.\nScore: 7",
                 latency: float = 0.0):
        self.reply, self.latency = reply, latency
        self.failing = False
        self.fail_next = 0
        self.chats: list[tuple[float, dict, dict]] = []  # (time, headers, body)
        self.health_checks = 0

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.chats.append((time.monotonic(), dict(request.headers), body))
        if self.latency:
            await asyncio.sleep(self.latency)
        if self.failing:
            return web.Response(status=503, text="down")
        if self.fail_next > 0:
            self.fail_next -= 1
            return web.Response(status=500, text="boom")
        return web.json_response({
            "id": "c1", "object": "chat.completion", "model": body.get("model", "judge"),
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": self._reply(body)}}],
            "usage": {"prompt_tokens": 50, "completion_tokens": 10, "total_tokens": 60}})

    def _reply(self, body: dict) -> str:
        return self.reply if isinstance(self.reply, str) else self.reply(body["messages"][-1]["content"])

    async def _models(self, request: web.Request) -> web.Response:
        self.health_checks += 1
        if self.failing:
            return web.Response(status=503, text="down")
        return web.json_response({"object": "list", "data": [{"id": "judge", "object": "model"}]})

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
