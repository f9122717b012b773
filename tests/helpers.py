"""Small helpers for tests that read topics back."""

from __future__ import annotations

import asyncio
import time

from streamrl.bus import Bus, Message


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
    from aiohttp import web

    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, reuse_address=True).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"
