"""verl's agent-loop API in the rollout workers (``rollout.agent``): verl's own single-turn and
tool agent loops (verl's classes where verl's agent loop imports; else verl's files on
streamrl's base, ``tests/rollout/verl_agent_loops.py``) and an agent loop of the test's own with
two tools and a simulated user, written against streamrl's base with verl's names.

What is checked, for every trajectory: each ``generate`` call's prompt is exactly the prefix of
``prompt_ids + response_ids`` the loop built before it; the tokens under mask 1 are exactly the
tokens the engine sampled, in order, with the engine's log-probs bit for bit and the version of
the weights that decoded each (a newer version is loaded between calls); every other token is
given (log-prob 0, the version before it); a loop's ``reward_score`` is the reward the reward
group publishes, and a trajectory without one is scored by its data source's scorer.

The policy is the real tiny transformers model; where a loop needs it to call a tool the text of
that turn is scripted and its log-probs are the model's own (a forward pass), as in
``test_multiturn``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest

from streamrl.config import ConfigError
from streamrl.errors import Failure
from streamrl.feed.config import FeedConfig
from streamrl.feed.prompts import row_to_prompt
from streamrl.records import DeadLetter, Prompt, Rewarded, Trajectory
from streamrl.rollout.agent_loops import AgentLoopBase, AgentLoopOutput, AgentLoops, register
from streamrl.rollout.backends import SamplingParams
from streamrl.rollout.config import AgentConfig, MultiTurnConfig, RolloutConfig
from streamrl.rollout.multiturn import MultiTurn
from streamrl.rollout.worker import RolloutWorker
from streamrl.testing import score
from streamrl.verl import read_verl_keys
from tests.helpers import read_topic
from tests.rollout.agent_loop_checks import RecordingPolicy, check, policy  # noqa: F401 - the fixture
from tests.rollout import verl_agent_loops

VERL = verl_agent_loops.load()
if VERL is not None:
    VerlSingleTurn, VerlTool, HOW = VERL  # the YAML's _target_s name these


# -- the test's own agent loop: two tools and a simulated user ---------------------------------

async def add(a: int, b: int) -> str:
    return str(a + b)


async def shout(text: str) -> str:
    return text.upper() + "!"


@register("two_tools_and_user")
class TwoToolsAndUser(AgentLoopBase):
    """Model turn; both tools answer; model turn; a simulated user asks again; model turn. Its
    own reward: 0.25 plus the config entry's ``bonus``."""

    def __init__(self, *args: Any, bonus: float = 0.0, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.bonus = bonus

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        messages = list(kwargs["raw_prompt"])
        ids = await self.ct_build_initial_tokens(messages)
        n_prompt, mask, logprobs = len(ids), [], []
        for step in ("tools", "user", None):
            out = await self.server_manager.generate(request_id=uuid4().hex, prompt_ids=ids,
                                                     sampling_params=sampling_params)
            merged, mask, logprobs = await self.ct_merge_assistant_token(ids, out.token_ids, mask, logprobs,
                                                                         assistant_logprobs=out.log_probs)
            ids = merged.token_ids
            messages.append({"role": "assistant", "content": self.tokenizer.decode(out.token_ids,
                                                                                   skip_special_tokens=True)})
            if step is None:
                break
            before = list(messages)
            if step == "tools":
                messages += [{"role": "tool", "content": await add(2, 5)}, {"role": "tool", "content": await shout("ok")}]
            else:
                messages.append({"role": "user", "content": "Are you sure?"})
            merged, mask, logprobs = await self.ct_merge_context_msg(before, messages, ids, mask, logprobs)
            ids = merged.token_ids
        return AgentLoopOutput(prompt_ids=ids[:n_prompt], response_ids=ids[n_prompt:], response_mask=mask,
                               response_logprobs=logprobs, reward_score=0.25 + self.bonus, num_turns=len(messages),
                               metrics={})


def write_config(tmp_path: Path) -> RolloutConfig:
    loops = tmp_path / "agent_loops.yaml"
    loops.write_text(
        "- name: verl_single\n  _target_: tests.rollout.test_agent_loops.VerlSingleTurn\n"
        "- name: verl_tool\n  _target_: tests.rollout.test_agent_loops.VerlTool\n"
        "- name: two_tools_and_user\n  _target_: tests.rollout.test_agent_loops.TwoToolsAndUser\n  bonus: 0.5\n")
    tools = tmp_path / "tools.yaml"
    tools.write_text(json.dumps({"tools": [{"class_name": "streamrl.rollout.tools.calculator.CalculatorTool",
                                            "config": {"type": "native"}}]}))
    return RolloutConfig(max_new_tokens=10, temperature=1.0, group_size=2, max_in_flight=4,
                         multi_turn=MultiTurnConfig(tool_config_path=str(tools), max_assistant_turns=3),
                         agent=AgentConfig(agent_loop_config_path=str(loops), default_agent_loop="verl_single",
                                           response_length=200))


def prompt(tag: str, agent: str | None, text: str = "Tom has 3 apples and buys 4. How many?") -> Prompt:
    extra: dict[str, Any] = {"index": 0}
    if agent is not None:
        extra["agent_name"] = agent
    return Prompt(group_id=f"g-{tag}-{uuid4().hex[:6]}", group_size=2, data_source="gsm8k",
                  prompt=[{"role": "user", "content": f"{tag}: {text}"}], ground_truth="7", extra_info=extra)


EXPECTED_CALLS = {"verl_single": 1, "verl_tool": 2, "two_tools_and_user": 3}


def test_verl_loops_and_our_own_stamp_every_sampled_token(policy: RecordingPolicy, tmp_path: Path):  # noqa: F811
    """verl's two loops and the test's own, two episodes each at once, a newer weights version
    before every call: tokens, masks, log-probs and versions exact; rewards as verl has them."""
    if VERL is None:
        pytest.skip("verl is not installed: its own loop files cannot be loaded")  # the dev extra has no verl
    cfg = write_config(tmp_path).validate()
    agents = AgentLoops(cfg, tools=[t.tool for t in MultiTurn.from_config(cfg).tools])
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    tok = policy.tokenizer

    async def newer_weights() -> None:  # as the worker's before_turn loading a version (between batches)
        async with policy._lock:
            policy.version += 1

    async def go() -> dict[str, list[Trajectory]]:
        out = {}
        for name, tag in (("verl_single", "A"), ("verl_tool", "USE_TOOL"), ("two_tools_and_user", "C")):
            out[name] = await agents.run_group(prompt(tag, name), 2, policy, params, newer_weights)
        return out

    policy.calls.clear()
    got = asyncio.run(go())
    for name, trajs in got.items():
        assert len(trajs) == 2 and {t.id for t in trajs} == {f"{trajs[0].group_id}-{i}" for i in range(2)}
        for t in trajs:
            assert check(t, policy.calls, tok) == EXPECTED_CALLS[name], name
            assert t.extra_info["agent_name"] == name
    tool = got["verl_tool"][0]
    given = tok.decode([r for r, m in zip(tool.array("response_ids"), tool.array("response_mask")) if not m])
    assert "tool: 7" in given  # verl's ToolAgentLoop ran streamrl's calculator on the scripted call
    own = got["two_tools_and_user"][0]
    given = tok.decode([r for r, m in zip(own.array("response_ids"), own.array("response_mask")) if not m])
    assert "tool: 7" in given and "tool: OK!" in given and "user: Are you sure?" in given
    assert len({v for t in got["two_tools_and_user"] for v, _ in t.token_versions or []}) >= 3

    # rewards: the loop's own reward_score is published as the reward; the others are scored
    assert all(t.reward_score == 0.75 for t in got["two_tools_and_user"])
    assert all(t.reward_score is None for n in ("verl_single", "verl_tool") for t in got[n])
    rewarded = score([*got["two_tools_and_user"], *got["verl_tool"], *got["verl_single"]])
    assert all(isinstance(r, Rewarded) for r in rewarded), rewarded
    assert [r.reward for r in rewarded[:2]] == [0.75, 0.75]
    assert all(r.scorer["name"] == "reward_score" and r.reward_info["status"] == "given" for r in rewarded[:2])
    assert all(r.scorer["name"] != "reward_score" for r in rewarded[2:])
    assert [r.reward for r in rewarded[2:4]] == [1.0, 1.0]  # "so #### 7" decoded from the whole response


def test_a_worker_runs_each_prompts_agent_loop_on_the_broker(bus, policy: RecordingPolicy, tmp_path: Path):  # noqa: F811
    """Through a rollout worker on the real broker: each prompt's agent_name picks its loop,
    none picks default_agent_loop, verl's built-in name runs the worker's own turn loop, and an
    unknown name is a dead letter naming the known ones."""
    if VERL is None:
        pytest.skip("verl is not installed: its own loop files cannot be loaded")
    cfg = write_config(tmp_path)
    policy.version = 0
    policy.calls.clear()
    prompts = [prompt("USE_TOOL", "verl_tool"), prompt("B", "two_tools_and_user"), prompt("D", None),
               prompt("E", "single_turn_agent"), prompt("F", "nobody")]

    async def go():
        worker = RolloutWorker(bus, cfg, backend=policy)
        task = asyncio.create_task(worker.run())
        producer = bus.producer("test")
        await producer.start()
        try:
            for p in prompts:
                await producer.send_and_wait(p)
            rollouts = await read_topic(bus, "rollouts", 8, timeout_s=90)
            letters = await read_topic(bus, "deadletter", 1, timeout_s=30)
        finally:
            await producer.stop()
            worker.stop()
            await task
        return rollouts, letters

    rollouts, letters = asyncio.run(go())
    trajs = [Trajectory.decode(m.value) for m in rollouts]
    by_group = {p.group_id: [t for t in trajs if t.group_id == p.group_id] for p in prompts}
    assert [len(v) for v in by_group.values()] == [2, 2, 2, 2, 0]
    names = {p.group_id: p.extra_info.get("agent_name") for p in prompts}
    for gid, ts in list(by_group.items())[:3]:
        for t in ts:
            want = names[gid] or "verl_single"
            assert t.extra_info["agent_name"] == want
            assert check(t, policy.calls, policy.tokenizer) == EXPECTED_CALLS[want]
            assert t.reward_score == (0.75 if want == "two_tools_and_user" else None)
    native = by_group[prompts[3].group_id]
    assert all("agent_name" not in t.extra_info or t.extra_info["agent_name"] == "single_turn_agent" for t in native)
    assert all("generate_calls" not in t.extra_info for t in native)  # streamrl's own turn loop served it
    [letter] = [DeadLetter.decode(m.value) for m in letters]
    assert letter.reason == "unknown_agent_loop" and "'nobody'" in letter.detail and "verl_tool" in letter.detail


def test_an_agent_loop_on_a_server_fleet(policy: RecordingPolicy, tmp_path: Path):  # noqa: F811
    """The loop's generate calls go to an OpenAI-compatible server (the tiny model behind vLLM's
    token-id fields) through the fleet backend, which has no tokenizer: the loop renders with the
    policy's; tokens and log-probs still exactly the engine's."""
    from streamrl.rollout.backends.openai_server import OpenAIBackend
    from tests.rollout.completions_server import CompletionsServer, start_server

    cfg = write_config(tmp_path)
    agents = AgentLoops(cfg)
    policy.version = 0

    async def go() -> list[Trajectory]:
        runner, url = await start_server(CompletionsServer(policy))
        backend = OpenAIBackend(url, "tiny-policy", max_retries=1)
        try:
            return await agents.run_group(prompt("S", "two_tools_and_user"), 2, backend,
                                          SamplingParams(max_new_tokens=10, temperature=1.0))
        finally:
            await backend.close()
            await runner.cleanup()

    policy.calls.clear()
    trajs = asyncio.run(go())
    assert len(policy.calls) == 6
    for t in trajs:
        assert check(t, policy.calls, policy.tokenizer) == 3 and t.reward_score == 0.75


def test_a_bad_agent_loop_config_fails_at_start_naming_the_field(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    for text, says in (("- name: x\n  _target_: tests.rollout.test_agent_loops.NoSuchLoop\n", "_target_"),
                       ("- name: x\n  _target_: tests.rollout.test_agent_loops.RecordingPolicy\n", "async def run"),
                       ("name: x\n", "list"), ("- _target_: a.B\n", "'name'")):
        bad.write_text(text)
        with pytest.raises(ConfigError, match="rollout.agent.agent_loop_config_path") as err:
            AgentLoops(RolloutConfig(agent=AgentConfig(agent_loop_config_path=str(bad))))
        assert says in str(err.value)
    with pytest.raises(ConfigError, match="rollout.agent.default_agent_loop"):
        AgentLoops(RolloutConfig(agent=AgentConfig(default_agent_loop="nobody")))
    # a class registered with ``register`` needs no config entry
    agents = AgentLoops(RolloutConfig(agent=AgentConfig(default_agent_loop="two_tools_and_user")))
    assert agents.runs(prompt("x", None)) and not agents.runs(prompt("x", "tool_agent"))
    with pytest.raises(Failure, match="not registered"):
        agents.resolve("nobody")


def test_the_verl_agent_keys_are_mapped_and_the_data_column_reaches_the_worker():
    r = "actor_rollout_ref.rollout.agent."
    out = {o.key: o for o in read_verl_keys([(r + "agent_loop_config_path", "loops.yaml"),
                                             (r + "default_agent_loop", "my_agent"), (r + "num_workers", 8),
                                             (r + "custom_async_server.path", "my_server.py")])}
    assert out[r + "agent_loop_config_path"].sets == {"rollout.agent.agent_loop_config_path": "loops.yaml"}
    assert out[r + "default_agent_loop"].sets == {"rollout.agent.default_agent_loop": "my_agent"}
    assert out[r + "num_workers"].kind == "ignored"
    assert out[r + "custom_async_server.path"].kind == "refused"
    row = {"data_source": "gsm8k", "prompt": [{"role": "user", "content": "hi"}], "agent_name": "tool_agent",
           "reward_model": {"style": "rule", "ground_truth": "7"}, "extra_info": {"index": 3}}
    assert row_to_prompt(row, 0, 0, FeedConfig(dataset="x", format="verl")).extra_info["agent_name"] == "tool_agent"
