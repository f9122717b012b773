"""Poison replies stay per record (issue: survives faults). Two real judges in this process: a
healthy one, and one that answers HTTP 200 with null content, empty choices, garbage or a 20 MB
body for some records. Under the real reward stage (``run_stage``, on the in-memory bus: what is
tested here is the scorer and the stage, not Kafka) every record ends
rewarded or dead-lettered in bounded time, the poison records with the reason, the healthy
server is never ejected and keeps its traffic, and no reply is read past the size bound."""

from __future__ import annotations

import asyncio
import resource

from aiohttp import web

from streamrl import metrics
from streamrl.pipeline_config import PipelineConfig
from streamrl.records import Trajectory
from streamrl.reward.config import ScorerSpec
from streamrl.reward.stage import RewardStage
from streamrl.testing import memory_bus, run_stage_async
from tests.helpers import serve_app, trajectory

NAME = "poison_judge"
POISON = {"null": {"choices": [{"message": {"role": "assistant", "content": None}}]},
          "empty": {"choices": []},
          "garbage": b"<html>oops</html>",
          "huge": b'{"choices": [{"message": {"content": "' + b"x" * (20 * 1024 * 1024) + b'"}}]}'}


def answer(kind: str) -> web.Response:
    reply = POISON.get(kind)
    if reply is None:
        return web.json_response({"choices": [{"message": {"role": "assistant", "content": "Score: 9"}}]})
    if isinstance(reply, bytes):
        return web.Response(body=reply, content_type="application/json")
    return web.json_response(reply)


async def judge(poisonous: bool, seen: list[str]) -> tuple[web.AppRunner, str]:
    """A judge; the poisonous one answers each record by the kind its response names."""

    async def chat(request: web.Request) -> web.Response:
        text = (await request.json())["messages"][-1]["content"]
        kind = next((k for k in POISON if f"[{k}]" in text), "ok")
        seen.append(kind)
        return answer(kind if poisonous else "ok")

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "judge"}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    return await serve_app(app)


async def score_through_the_stage(urls: list[str], records: list[Trajectory], max_attempts: int,
                                  max_retries: int, eject_after: int) -> tuple[list[str], dict[str, list]]:
    """The real reward stage with one judge entry over ``urls``, until every record came out
    rewarded or dead-lettered (``run_stage`` fails after 60 s saying what came out); returns
    (ejected servers, outputs)."""
    bus = memory_bus()
    cfg = PipelineConfig()
    cfg.bus = bus.config
    cfg.reward.group = f"reward-{bus.config.topic_prefix}"
    cfg.reward.max_attempts = max_attempts
    cfg.reward.retry_backoff_s = 0.01
    cfg.reward.scorers[NAME] = ScorerSpec(type="judge", data_sources=["judged"], judge={
        "urls": urls, "timeout_s": 5.0, "max_retries": max_retries, "backoff_s": 0.01, "backoff_max_s": 0.02,
        "eject_after": eject_after, "health_interval_s": 0.0})
    stage = RewardStage(cfg)
    out = await run_stage_async(stage, records, timeout_s=60,
                                until=lambda o: len(o["rewarded"]) + len(o["deadletter"]) >= len(records))
    return stage.table.entries[NAME].scorer.router.ejected, {"rewarded": out["rewarded"], "dead": out["deadletter"]}


def test_poison_replies_fail_their_record_alone():
    kinds = ["ok", "null", "ok", "empty", "ok", "garbage", "ok", "huge"] * 3
    records = [trajectory(id=f"p-{i}", group_id=f"g-{i}", data_source="judged", prompt="q", response=f"answer [{k}]",
                          ground_truth="a") for i, k in enumerate(kinds)]

    async def main():
        healthy_seen: list[str] = []
        poison_seen: list[str] = []
        healthy, healthy_url = await judge(False, healthy_seen)
        poison, poison_url = await judge(True, poison_seen)
        try:
            # both URLs on one judge: the poisonous server answers everything, poison for some
            ejected, out = await score_through_the_stage([poison_url, healthy_url], records,
                                                         max_attempts=1, max_retries=2, eject_after=2)
        finally:
            await healthy.cleanup()
            await poison.cleanup()
        return ejected, out, healthy_seen, poison_seen

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    ejected, out, healthy_seen, poison_seen = asyncio.run(main())
    rewarded = {r.id for r in out["rewarded"]}
    dead = {d.record_id: d for d in out["dead"]}
    # a poison reply from one server is retried on the other, which scores it: every record is
    # rewarded, with the healthy server's 9; none is lost, none is dead
    assert rewarded | dead.keys() == {r.id for r in records}
    assert all(r.reward_info["judge_score_raw"] == 9.0 for r in out["rewarded"])
    assert ejected == []  # poison replies never eject a server
    assert healthy_seen and poison_seen  # both kept their traffic
    assert set(poison_seen) & {"null", "empty", "garbage", "huge"}  # poison was served, and survived
    # any 20 MB body was never read whole (the bound is 1 MiB)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 200 * 1024


def url_of(out: dict[str, list]) -> str:
    """The judge's URL as its metric label, read from a dead letter's detail."""
    detail = next(d.detail for d in out["dead"] if d.reason == "reply_too_large")
    return detail.split(": ", 1)[1].split("/v1/")[0]


def test_a_judge_that_only_answers_poison_dead_letters_the_record_with_the_reason():
    records = [trajectory(id=f"q-{i}", group_id=f"h-{i}", data_source="judged", prompt="q", response=f"answer [{k}]",
                          ground_truth="a")
               for i, k in enumerate(["null", "ok", "garbage", "ok", "huge"])]

    async def main():
        seen: list[str] = []
        poison, url = await judge(True, seen)
        try:
            return await score_through_the_stage([url], records, max_attempts=2, max_retries=1, eject_after=1)
        finally:
            await poison.cleanup()

    ejected, out = asyncio.run(main())
    assert ejected == []  # eject_after 1, yet the server is up: not ejected
    assert sorted(r.id for r in out["rewarded"]) == ["q-1", "q-3"]
    dead = {d.record_id: d for d in out["dead"]}
    assert sorted(dead) == ["q-0", "q-2", "q-4"]
    assert [dead[i].reason for i in ("q-0", "q-2", "q-4")] == ["bad_reply", "bad_reply", "reply_too_large"]
    assert "TypeError" in dead["q-0"].detail and "JSONDecodeError" in dead["q-2"].detail
    too_large = metrics.ROUTER_ERRORS.labels(NAME, url_of(out), "reply_too_large")._value.get()
    assert too_large >= 2  # both tries of q-4 stopped at the bound
