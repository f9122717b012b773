"""``streamrl gateway`` in front of a real OpenAI-compatible server (the tiny model behind
vLLM's token-id fields, ``test_openai_backend.CompletionsServer``), driven by agents written
with the ``openai`` client, on the real broker: several agents at once, multi-turn with tool
calls; each ended episode's trajectory has exactly the tokens the server sampled (mask 1, the
server's log-probs bit for bit, its version per token) and the tokens of the agent's messages
(mask 0); a reward given at the end is published unscored; an abandoned episode is a dead
letter; a gateway restarted on its journal takes its open episodes up again, and a repeated end
publishes nothing twice."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from streamrl.records import DeadLetter, Trajectory
from streamrl.rollout.backends.openai_server import OpenAIBackend
from streamrl.rollout.config import GatewayConfig, RolloutConfig
from streamrl.rollout.gateway import Gateway
from streamrl.rollout.tools.calculator import calculate
from streamrl.testing import score
from tests.helpers import read_topic, wait_for
from tests.rollout.test_agent_loops import RecordingPolicy, check, policy  # noqa: F401 - the fixture
from tests.rollout.test_openai_backend import CompletionsServer, start_server

openai = pytest.importorskip("openai")  # the dev extra installs it

CALC = {"type": "function", "function": {"name": "calculator", "description": "arithmetic",
                                         "parameters": {"type": "object",
                                                        "properties": {"expression": {"type": "string"}}}}}


async def agent(base: str, eid: str, question: str, end: dict[str, Any] | None) -> list[str]:
    """An agent written with the openai client: asks, runs the tools it is asked to, asks again,
    then ends its episode with ``end`` (None: leaves it open)."""
    client = openai.AsyncOpenAI(base_url=f"{base}/episodes/{eid}/v1", api_key="unused", max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": question}]
    said = []
    for _ in range(3):
        reply = await client.chat.completions.create(model="tiny", messages=messages, tools=[CALC], max_tokens=10)
        msg = reply.choices[0].message
        said.append(msg.content or "")
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            break
        for call in msg.tool_calls:
            value = calculate(json.loads(call.function.arguments)["expression"])
            messages.append({"role": "tool", "tool_call_id": call.id, "content": str(value)})
    await client.close()
    if end is not None:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{base}/episodes/{eid}/end", json=end) as r:
                assert r.status == 200, await r.text()
    return said


async def started(gateway: Gateway) -> asyncio.Task:
    task = asyncio.create_task(gateway.run())
    await wait_for(lambda: gateway.port is not None or task.done(), 60, "the gateway to listen")
    assert not task.done(), task.exception()
    return task


def gateway_cfg(tmp_path: Path, **kw: Any) -> RolloutConfig:
    return RolloutConfig(max_new_tokens=10, temperature=1.0,
                         gateway=GatewayConfig(port=0, state_dir=str(tmp_path / "journal"), **kw))


def test_agents_through_the_gateway(bus, policy: RecordingPolicy, tmp_path: Path):  # noqa: F811
    cfg = gateway_cfg(tmp_path, episode_timeout_s=3.0)
    policy.version = 0
    policy.calls.clear()

    async def go():
        server = CompletionsServer(policy)
        runner, url = await start_server(server)
        gateway = Gateway(bus, cfg, backend=OpenAIBackend(url, "tiny", max_retries=1))
        task = await started(gateway)
        base = f"http://127.0.0.1:{gateway.port}"
        try:
            said = await asyncio.gather(
                agent(base, "ep-a", "USE_TOOL: what is 3+4?", {"reward": 1.0}),
                agent(base, "ep-b", "USE_TOOL: and 3+4 again?", {"data_source": "gsm8k", "ground_truth": "7",
                                                                  "group_id": "g-b"}),
                agent(base, "ep-c", "Tell me a story.", {"reward": 0.0, "extra_info": {"who": "c"}}),
                agent(base, "ep-left", "Anyone there?", None))
            rollouts = await read_topic(bus, "rollouts", 3, timeout_s=60)
            letters = await read_topic(bus, "deadletter", 1, timeout_s=60)  # ep-left times out
            async with aiohttp.ClientSession() as http:  # a repeated end: answered, not published again
                async with http.post(f"{base}/episodes/ep-a/end", json={"reward": 1.0}) as r:
                    again = await r.json()
            await asyncio.sleep(1.0)
            rollouts = await read_topic(bus, "rollouts", 4, timeout_s=2)
            return said, rollouts, letters, again
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await runner.cleanup()

    said, rollouts, letters, again = asyncio.run(go())
    assert said[0][0] == "" and "#### 7" in said[0][1]  # a tool call (no text), then the answer
    trajs = {t.id: t for t in (Trajectory.decode(m.value) for m in rollouts)}
    assert sorted(trajs) == ["ep-a", "ep-b", "ep-c"] and again["again"] is True
    for t in trajs.values():
        n_calls = check(t, policy.calls, policy.tokenizer)
        assert n_calls == (2 if t.id != "ep-c" else 1)
    a = trajs["ep-a"]
    given = policy.tokenizer.decode([r for r, m in zip(a.array("response_ids"), a.array("response_mask")) if not m])
    assert "tool: 7" in given
    assert a.reward_score == 1.0 and trajs["ep-b"].reward_score is None and trajs["ep-b"].group_id == "g-b"
    assert trajs["ep-c"].extra_info["who"] == "c"
    [letter] = [DeadLetter.decode(m.value) for m in letters]
    assert letter.reason == "episode_abandoned" and letter.record_id == "ep-left"
    assert Trajectory.decode(letter.original_value()).response_ids is not None
    ra, rb = score([a, trajs["ep-b"]])
    assert ra.reward == 1.0 and ra.reward_info["status"] == "given"
    assert rb.reward == 1.0 and rb.scorer["name"] != "reward_score"  # "#### 7" scored by gsm8k


def test_a_restarted_gateway_takes_up_its_open_episodes(bus, policy: RecordingPolicy, tmp_path: Path):  # noqa: F811
    cfg = gateway_cfg(tmp_path)
    policy.version = 0
    policy.calls.clear()

    async def go():
        server = CompletionsServer(policy)
        runner, url = await start_server(server)
        first = Gateway(bus, cfg, backend=OpenAIBackend(url, "tiny", max_retries=1))
        task = await started(first)
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{first.port}/episodes/ep-r/v1", api_key="x",
                                    max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "Hello?"}]
        reply = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=10)
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        await client.close()
        task.cancel()  # gone without ending the episode (its journal was written before the answer)
        await asyncio.gather(task, return_exceptions=True)
        second = Gateway(bus, dataclasses.replace(cfg), backend=OpenAIBackend(url, "tiny", max_retries=1))
        task = await started(second)
        assert list(second.episodes) == ["ep-r"]
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{second.port}/episodes/ep-r/v1", api_key="x",
                                    max_retries=0)
        messages.append({"role": "user", "content": "Once more."})
        await client.chat.completions.create(model="tiny", messages=messages, max_tokens=10)
        with pytest.raises(openai.ConflictError):  # a conversation that does not extend the episode's
            await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Other"}] * 4)
        await client.close()
        async with aiohttp.ClientSession() as http:
            async with http.post(f"http://127.0.0.1:{second.port}/episodes/ep-r/end", json={"reward": 0.5}) as r:
                assert r.status == 200
        rollouts = await read_topic(bus, "rollouts", 1, timeout_s=30)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await runner.cleanup()
        return rollouts

    [m] = asyncio.run(go())
    t = Trajectory.decode(m.value)
    assert t.id == "ep-r" and t.reward_score == 0.5 and check(t, policy.calls, policy.tokenizer) == 2
    given = policy.tokenizer.decode([r for r, k in zip(t.array("response_ids"), t.array("response_mask")) if not k])
    assert "user: Once more." in given
    assert (tmp_path / "journal" / "ep-r.done").exists() and not (tmp_path / "journal" / "ep-r.json").exists()
