"""A judge outage under the real reward stage: while the judge server is down the stage holds
its records (no progress, nothing scored 0, nothing dead-lettered) and it resumes when the
server is back. The in-memory bus (``memory_bus`` fixture: the stage's logic, not Kafka, is under
test), a real aiohttp judge server in this process, real sockets:
"down" means nothing listens on the judge's port."""

from __future__ import annotations

import asyncio

import numpy as np
from aiohttp import web

from streamrl import metrics
from streamrl.broker import free_port
from streamrl.pipeline_config import PipelineConfig
from streamrl.reward.config import ScorerSpec
from streamrl.reward.stage import RewardStage
from tests.helpers import Collector, produce, serve_app, trajectory, wait_for

NAME = "outage_judge"


class Judge:
    """An OpenAI-compatible judge on a fixed port that can be taken down and brought back."""

    def __init__(self, port: int):
        self.port, self.runner, self.requests = port, None, 0

    async def up(self) -> None:
        async def chat(request: web.Request) -> web.Response:
            await request.read()
            self.requests += 1
            return web.json_response({"choices": [{"index": 0, "message": {
                "role": "assistant", "content": "Correct.\nScore: 7"}}]})

        async def models(request: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": "judge"}]})

        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/v1/models", models)
        self.runner, _ = await serve_app(app, self.port)

    async def down(self) -> None:
        await self.runner.cleanup()
        self.runner = None


def test_judge_outage_holds_records_and_resumes(memory_bus):
    bus = memory_bus
    port = free_port()
    cfg = PipelineConfig()
    cfg.bus = bus.config
    cfg.reward.group = f"reward-{bus.config.topic_prefix}"
    cfg.reward.max_in_flight = 4
    cfg.reward.retry_backoff_s = 0.01
    cfg.reward.unavailable_backoff_max_s = 0.2
    cfg.reward.process_workers = 1
    cfg.reward.scorers[NAME] = ScorerSpec(type="judge", data_sources=["judged"], judge={
        "urls": [f"http://127.0.0.1:{port}/v1"], "timeout_s": 2.0, "max_retries": 1,
        "backoff_s": 0.01, "backoff_max_s": 0.02, "eject_after": 1, "health_interval_s": 0.2})
    stage = RewardStage(cfg)
    judge = Judge(port)
    records = [trajectory(i, data_source="judged", response="42") for i in range(14)]
    first, second = records[:6], records[6:]
    held = metrics.REWARD_HELD.labels(NAME)

    async def main():
        await judge.up()
        stop = asyncio.Event()
        run = asyncio.create_task(stage.run(stop))
        reader = await Collector(bus).start()
        out = {"rewarded": reader.rewarded, "dead": reader.dead}
        try:
            await produce(bus, first)
            assert await wait_for(lambda: len(out["rewarded"]) == len(first), 30)

            await judge.down()
            await produce(bus, second)
            assert await wait_for(lambda: held._value.get() == 4, 20)  # max_in_flight, all held
            requests_down = judge.requests
            await asyncio.sleep(1.5)  # a while down: no progress, nothing scored, nothing dead
            during = (len(out["rewarded"]), len(out["dead"]), held._value.get())

            await judge.up()  # back: a health check re-admits it and the held records go on
            done = await wait_for(lambda: len(out["rewarded"]) >= len(first) + len(second), 30)
            stop.set()
            await run
        finally:
            await reader.stop()
            if judge.runner is not None:
                await judge.down()
        return requests_down, during, done, out

    requests_down, during, done, out = asyncio.run(main())
    assert requests_down == len(first)  # the down server answered nothing
    assert during == (len(first), 0, 4)
    assert done and out["dead"] == []
    assert {r.id for r in out["rewarded"]} == {t.id for t in first + second}
    for r in out["rewarded"]:  # every record judged for real: never a 0 for the outage
        assert r.reward == np.float32(0.7) and r.reward_info["status"] == "ok"
        assert r.reward_info["judge_score_raw"] == 7.0
    assert held._value.get() == 0
