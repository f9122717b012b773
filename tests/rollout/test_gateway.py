"""``streamrl gateway`` in front of a real OpenAI-compatible server (the tiny model behind
vLLM's token-id fields, ``test_openai_backend.CompletionsServer``), driven by agents written
with the ``openai`` client, on the real broker: several agents at once, multi-turn with tool
calls; each ended episode's trajectory has exactly the tokens the server sampled (mask 1, the
server's log-probs bit for bit, its version per token) and the tokens of the agent's messages
(mask 0); a reward given at the end is published unscored; an abandoned episode is a dead
letter; ``streamrl gateway`` SIGKILLed mid-episode and restarted on its journal takes its open
episode up again, and a repeated end publishes nothing twice."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from streamrl import metrics
from streamrl.records import DeadLetter, Trajectory
from streamrl.rollout.backends.openai_server import OpenAIBackend
from streamrl.rollout.config import GatewayConfig, RolloutConfig
from streamrl.rollout.gateway import Gateway
from streamrl.rollout.tools.calculator import calculate
from streamrl.testing import score
from tests.helpers import read_topic, wait_for
from tests.rollout.agent_loop_checks import RecordingPolicy, check, policy  # noqa: F401 - the fixture
from tests.rollout.completions_server import CompletionsServer, start_server

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
    before = {o: metrics.GATEWAY_EPISODES.labels(o)._value.get() for o in ("published", "abandoned")}
    calls_before = metrics.GATEWAY_CALLS.labels("ok")._value.get()

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
            rollouts = await read_topic(bus, "rollouts")  # every record to its end: one more would be a repeat
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
    assert metrics.GATEWAY_EPISODES.labels("published")._value.get() - before["published"] == 3
    assert metrics.GATEWAY_EPISODES.labels("abandoned")._value.get() - before["abandoned"] == 1
    assert metrics.GATEWAY_CALLS.labels("ok")._value.get() - calls_before == 2 + 2 + 1 + 1
    ra, rb = score([a, trajs["ep-b"]])
    assert ra.reward == 1.0 and ra.reward_info["status"] == "given"
    assert rb.reward == 1.0 and rb.scorer["name"] != "reward_score"  # "#### 7" scored by gsm8k


@pytest.mark.e2e
def test_streamrl_gateway_sigkilled_mid_episode(bus, bootstrap, policy: RecordingPolicy, tmp_path: Path):  # noqa: F811
    """``streamrl gateway`` as its own process, SIGKILLed with one episode ended and one open:
    restarted on its journal, the open one goes on and ends; each is on the topic once."""
    import os
    import signal
    import sys

    policy.version = 0
    policy.calls.clear()
    root = Path(__file__).resolve().parents[2]

    async def start_gateway(url: str) -> tuple[asyncio.subprocess.Process, str, list[str]]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "streamrl", "gateway", "--bootstrap-servers", bootstrap,
            f"bus.topic_prefix={bus.config.topic_prefix}", "rollout.backend=openai", f"rollout.servers=[{url}]",
            "rollout.openai.model=tiny", "rollout.openai.health_interval_s=0", "rollout.max_new_tokens=10",
            "rollout.gateway.port=0", f"rollout.gateway.state_dir={tmp_path / 'journal'}", "metrics.port=0",
            cwd=root, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, "PYTHONPATH": str(root)})
        lines: list[str] = []
        while True:
            line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
            assert line, "the gateway ended before serving:\n" + "".join(lines)
            lines.append(line)
            if "gateway: serving http://" in line:
                return proc, line.split("serving ")[1].split("/episodes")[0], lines

    async def call(base: str, eid: str, messages: list[dict[str, Any]]) -> None:
        client = openai.AsyncOpenAI(base_url=f"{base}/episodes/{eid}/v1", api_key="x", max_retries=0)
        reply = await client.chat.completions.create(model="tiny", messages=messages, max_tokens=10)
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        await client.close()

    async def end(base: str, eid: str, reward: float) -> dict:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{base}/episodes/{eid}/end", json={"reward": reward}) as r:
                assert r.status == 200, await r.text()
                return await r.json()

    async def go():
        server = CompletionsServer(policy)
        runner, url = await start_server(server)
        proc, base, _ = await start_gateway(url)
        try:
            a = [{"role": "user", "content": "First agent."}]
            await call(base, "ep-done", a)
            await end(base, "ep-done", 1.0)
            b = [{"role": "user", "content": "Second agent."}]
            await call(base, "ep-open", b)
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
            proc, base, lines = await start_gateway(url)
            assert any("took up 1 open episodes" in line for line in lines), lines
            again = await end(base, "ep-done", 1.0)
            b.append({"role": "user", "content": "Still there?"})
            await call(base, "ep-open", b)
            with pytest.raises(openai.ConflictError):  # a conversation that does not extend the episode's
                await call(base, "ep-open", [{"role": "user", "content": "Other."}] * 4)
            await end(base, "ep-open", 0.5)
            await read_topic(bus, "rollouts", 2, timeout_s=60)
            await asyncio.sleep(1.0)
            rollouts = await read_topic(bus, "rollouts")  # every record to its end: one more would be a repeat
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
                await asyncio.wait_for(proc.wait(), 60)
            await runner.cleanup()
        return again, rollouts

    again, rollouts = asyncio.run(go())
    trajs = sorted((Trajectory.decode(m.value) for m in rollouts), key=lambda t: t.id)
    assert [t.id for t in trajs] == ["ep-done", "ep-open"] and again["again"] is True
    assert [t.reward_score for t in trajs] == [1.0, 0.5]
    assert [check(t, policy.calls, policy.tokenizer) for t in trajs] == [1, 2]
    given = policy.tokenizer.decode([r for r, k in zip(trajs[1].array("response_ids"), trajs[1].array("response_mask"))
                                     if not k])
    assert "user: Still there?" in given
    journal = tmp_path / "journal"
    assert sorted(p.name for p in journal.iterdir()) == ["ep-done.done", "ep-open.done"]
