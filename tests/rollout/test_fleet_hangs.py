"""A policy server that hangs mid-response (issue 57): frozen whole (SIGSTOP: a hung machine, its
connections left open, which no TCP error reports). The fleet notices within
``rollout.openai.stream_timeout_s`` of its last chunk, ejects it, and each of its requests
continues on the other server from the tokens it had streamed, under every ``on_update``; every
token is kept, with the behaviour log-prob and the version of the weights that decoded it.

The frozen server is a real separate process (``tests.rollout.streaming.TokenProcess``); the
other runs in the test. Both stream tokens whose ids and log-probs are a function of the
context and the weights' version (``tests.rollout.streaming``), so each token is traced to the
weights that decoded it."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import orjson
import pytest

from streamrl import metrics
from streamrl.errors import ConfigError
from streamrl.rollout.backends import SamplingParams
from streamrl.rollout.backends.openai_server import OpenAIBackend
from streamrl.rollout.config import OpenAIBackendConfig, RolloutConfig
from tests.rollout.streaming import PROMPT, TokenProcess, TokenServer, expected, weights_of

RATE, LENGTH, TIMEOUT = 50.0, 100, 1.0  # 2 s a response; the freeze noticed 1 s after the last chunk


@pytest.mark.parametrize("on_update", ["drain", "abort", "partial"])
def test_a_server_frozen_mid_stream_loses_no_tokens(on_update):
    frozen = TokenProcess(rate=RATE, length=LENGTH)

    async def go():
        live = await TokenServer(rate=RATE, length=LENGTH).start()
        backend = OpenAIBackend("", "policy", servers=[frozen.url, live.url], update_api="sglang",
                                on_update=on_update, stream_timeout_s=TIMEOUT, health_interval_s=0.5)
        hangs = metrics.ROLLOUT_SERVER_HANGS.labels(frozen.url)._value.get()
        try:
            await backend.use_starting_weights(0)
            request = asyncio.create_task(backend.generate([PROMPT], 4, SamplingParams(max_new_tokens=2 * LENGTH)))
            while len(live.requests) < 2:  # two samples on each server
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)  # ~25 tokens in
            frozen.freeze()
            at = time.monotonic()
            (group,) = await asyncio.wait_for(request, 60)
            ejected = frozen.url in backend.fleet.router.ejected
            return (group, live, at, backend.fleet.failed_over, ejected,
                    metrics.ROLLOUT_SERVER_HANGS.labels(frozen.url)._value.get() - hangs)
        finally:
            await backend.close()
            await live.stop()

    try:
        group, live, frozen_at, failed_over, ejected, hangs = asyncio.run(go())
    finally:
        frozen.stop()
    assert failed_over == 2 and ejected and hangs == 1
    ids, lps = expected(len(PROMPT), [(0, LENGTH)])
    for s in group:  # every token kept, each the weights' own after its context, stamped with them
        assert s.finish_reason == "stop" and s.response_ids == ids and s.prompt_ids == PROMPT
        np.testing.assert_allclose(s.response_logprobs, lps, rtol=1e-6)
        assert s.version_runs().per_token().tolist() == weights_of(len(PROMPT), s.response_ids,
                                                                  s.response_logprobs.tolist(), range(-1, 2))
        assert s.policy_version == 0 and s.token_versions is None
    # the frozen server's two requests continued on the live one from the tokens they had
    # streamed (not from the prompt), asking for what was left of the budget
    continued = [(r, t) for r, t in zip(live.requests, live.arrivals) if t > frozen_at]
    assert len(continued) == 2
    for body, _ in continued:
        streamed = len(body["prompt"]) - len(PROMPT)
        assert 5 < streamed < LENGTH and body["prompt"][len(PROMPT):] == ids[:streamed]
        assert body["max_tokens"] == 2 * LENGTH - streamed
    took = min(t for _, t in continued) - frozen_at
    print(f"\n{on_update}: frozen -> continuing on the other server in {took:.2f} s "
          f"(stream_timeout_s {TIMEOUT})")
    assert took < TIMEOUT + 1.5


@pytest.mark.parametrize("on_update", ["drain", "partial"])
def test_a_server_frozen_as_a_version_loads_continues_its_requests_on_the_new_weights(tmp_path, on_update):
    """The server freezes, and the learner announces version 1 before the freeze is noticed: the
    frozen server cannot load it (nor answer partial's pause), the live one does. The frozen
    server's requests continue on the live one once it is on version 1: their tokens of
    version 0 kept, the rest version 1's, each stamped with the weights that decoded it."""
    frozen = TokenProcess(rate=RATE, length=LENGTH)

    async def go():
        live = await TokenServer(rate=RATE, length=LENGTH).start()
        backend = OpenAIBackend("", "policy", servers=[frozen.url, live.url], update_api="sglang",
                                on_update=on_update, stream_timeout_s=TIMEOUT, health_interval_s=0.5,
                                update_timeout_s=2.0, update_retry_s=0.5)
        try:
            await backend.use_starting_weights(0)
            request = asyncio.create_task(backend.generate([PROMPT], 4, SamplingParams(max_new_tokens=2 * LENGTH)))
            while len(live.requests) < 2:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)
            frozen.freeze()
            at = time.monotonic()
            await backend.load_weights(str(tmp_path / "v1"), 1)
            (group,) = await asyncio.wait_for(request, 60)
            return group, live, at, backend.fleet.failed_over
        finally:
            await backend.close()
            await live.stop()

    try:
        group, live, frozen_at, failed_over = asyncio.run(go())
    finally:
        frozen.stop()
    assert failed_over == 2 and live.version == 1
    spanning = 0
    for s in group:
        stamped = s.version_runs().per_token().tolist()
        assert len(s.response_ids) == LENGTH and s.finish_reason == "stop"
        assert stamped == weights_of(len(PROMPT), s.response_ids, s.response_logprobs.tolist(), range(-1, 3))
        assert stamped[0] == 0 and s.policy_version == 0
        spanning += stamped[-1] == 1
    assert spanning >= 2  # the frozen server's two at least (partial: the live one's too)
    continued = [r for r, t in zip(live.requests, live.arrivals) if t > frozen_at and len(r["prompt"]) > len(PROMPT)]
    assert len(continued) >= 2 and all(5 < len(r["prompt"]) - len(PROMPT) < LENGTH for r in continued)


def test_a_paused_load_is_not_a_hang(tmp_path):
    """A server whose requests are paused for a load longer than ``stream_timeout_s`` streams
    nothing on purpose: it is not cut out."""
    from tests.rollout.streaming import PausingServer

    async def go():
        server = await PausingServer(rate=100, load_s=1.0).start()
        backend = OpenAIBackend("", "policy", servers=[server.url], update_api="sglang", on_update="partial",
                                stream_timeout_s=0.4, health_interval_s=0)
        try:
            await backend.use_starting_weights(0)
            request = asyncio.create_task(backend.generate([PROMPT], 2, SamplingParams(max_new_tokens=64)))
            await asyncio.sleep(0.1)
            await backend.load_weights(str(tmp_path / "v1"), 1)
            (group,) = await request
            return group, backend.fleet
        finally:
            await backend.close()
            await server.stop()

    group, fleet = asyncio.run(go())
    assert fleet.paused == 1 and fleet.failed_over == 0 and not fleet.router.ejected
    assert all(s.token_versions and s.token_versions[-1][0] == 1 for s in group)


def test_stream_timeout_is_validated_and_reaches_the_fleet():
    cfg = RolloutConfig(backend="openai", openai=OpenAIBackendConfig(model="m", update_api="sglang"))
    assert cfg.openai.stream_timeout_s == 30.0
    for bad in (-1.0, float("nan")):
        with pytest.raises(ConfigError, match="rollout.openai.stream_timeout_s"):
            RolloutConfig(backend="openai", openai=OpenAIBackendConfig(model="m", stream_timeout_s=bad)).validate()
    watched = OpenAIBackend("", "m", servers=["http://x:1"], update_api="sglang", stream_timeout_s=5.0)
    assert watched.streamed and watched.fleet.stream_timeout_s == 5.0
    off = OpenAIBackend("", "m", servers=["http://x:1"], update_api="sglang", stream_timeout_s=0)
    assert not off.streamed and off.fleet.stream_timeout_s == 0
    hosted = OpenAIBackend("", "m", servers=["http://x:1"])  # update_api none: whole answers, version 0
    assert not hosted.streamed and hosted.fleet.members["http://x:1"].version == 0
    # following servers serve nothing until an announcement names their weights; not following: 0
    assert watched.fleet.members["http://x:1"].version is None
    assert OpenAIBackend("", "m", servers=["http://x:1"], update_api="sglang",
                         follow_policy=False).fleet.members["http://x:1"].version == 0


def test_stream_events_split_across_network_reads_are_read_whole():
    """Server-sent events arrive in whatever pieces the network makes: one split mid-JSON,
    two in one read, CRLF line ends, the last without a newline before the stream closes."""
    from aiohttp import web

    from tests.helpers import AppServer

    def event(i: int, reason: str | None) -> bytes:
        choice = {"index": 0, "text": f"<{i}>", "finish_reason": reason,
                  "logprobs": {"tokens": [f"token_id:{100 + i}"], "token_logprobs": [-0.5]}}
        return b"data: " + orjson.dumps({"choices": [choice]})

    class Pieces(AppServer):
        def routes(self, app: web.Application) -> None:
            app.router.add_post("/v1/completions", self._complete)

        async def _complete(self, request: web.Request) -> web.StreamResponse:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            first = event(0, None) + b"\r\n\r\n"
            for piece in (first[:17], first[17:] + event(1, None) + b"\n\n" + event(2, None)[:9],
                          event(2, None)[9:] + b"\n\n", event(3, "stop")):
                await resp.write(piece)
                await asyncio.sleep(0.05)
            return resp

    async def go():
        server = await Pieces().start()
        backend = OpenAIBackend("", "m", servers=[server.url], on_update="partial", health_interval_s=0)
        try:
            (group,) = await backend.generate([[1, 2]], 1, SamplingParams(max_new_tokens=8))
            return group[0]
        finally:
            await backend.close()
            await server.stop()

    s = asyncio.run(go())
    assert s.response_ids == [100, 101, 102, 103] and s.text == "<0><1><2><3>" and s.finish_reason == "stop"


def test_the_rollout_stage_loses_nothing_to_a_frozen_server(memory_bus):
    """The rollout worker on two servers, one frozen mid-stream: every trajectory reaches the
    rollouts topic whole, each token the weights' own after its context and stamped with them."""
    from streamrl.records import PolicyVersion, Prompt, Trajectory
    from streamrl.rollout.worker import RolloutWorker
    from tests.helpers import read_topic

    bus = memory_bus
    frozen = TokenProcess(rate=RATE, length=LENGTH)

    async def go():
        live = await TokenServer(rate=RATE, length=LENGTH).start()
        cfg = RolloutConfig(backend="openai", group_size=2, max_new_tokens=2 * LENGTH, servers=[frozen.url, live.url],
                            openai=OpenAIBackendConfig(model="policy", api_key_env="", update_api="sglang",
                                                       stream_timeout_s=TIMEOUT, health_interval_s=0.5))
        worker = RolloutWorker(bus, cfg)
        producer = bus.producer("learner")
        await producer.start()
        await producer.send_and_wait(PolicyVersion(version=0, weights_uri=None))  # the servers' own weights
        task = asyncio.create_task(worker.run())
        try:
            for i in range(2):
                await producer.send_and_wait(Prompt(group_id=f"g{i}", group_size=2, data_source="gsm8k",
                                                    prompt=f"{i} + 1 =", ground_truth=str(i + 1)))
            while len(live.requests) < 2:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.5)
            frozen.freeze()
            records = [Trajectory.decode(m.value) for m in await read_topic(bus, "rollouts", 4, timeout_s=60)]
            return records, worker.backend.fleet.failed_over
        finally:
            await producer.stop()
            worker.stop()
            await task
            await live.stop()

    try:
        records, failed_over = asyncio.run(go())
    finally:
        frozen.stop()
    assert sorted(r.id for r in records) == ["g0-0", "g0-1", "g1-0", "g1-1"] and failed_over >= 1
    for r in records:
        prompt = r.array("prompt_ids").tolist()
        ids, lps = r.array("response_ids").tolist(), r.array("response_logprobs").tolist()
        assert len(ids) == LENGTH and r.policy_version == 0 and r.token_versions is None
        assert weights_of(len(prompt), ids, lps, range(-1, 2)) == [0] * LENGTH
