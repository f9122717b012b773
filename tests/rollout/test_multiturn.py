"""Multi-turn rollouts and tools as verl users write them: interactions picked per sample from a
verl interaction config, tools from a verl tool config with per-sample ``tools_kwargs``, turn
scores folded into the reward by ``reward.turn_scores``, the response mask over model and
non-model tokens, and a verl multi-turn GSM8K setup through ``streamrl run``.

The policy is the real tiny transformers model. Where a test needs the model to say something
(a tool call), ``ScriptedPolicy`` picks the text of each turn from the context and takes the
model's own log-probs of exactly those tokens (a forward pass at the sampling temperature), so
everything after the sampler (context, masks, log-probs, records) is what a real run produces."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from streamrl.bus import Bus
from streamrl.chat import ChatRenderer
from streamrl.config import BusConfig, ConfigError
from streamrl.errors import Failure
from streamrl.records import Prompt, Rewarded, Trajectory
from streamrl.rollout.backends import Completion, SamplingParams
from streamrl.rollout.backends.transformers_engine import TransformersBackend
from streamrl.feed.config import FeedConfig
from streamrl.rollout.config import InteractionConfig, MultiTurnConfig, RolloutConfig
from streamrl.rollout.episode import run_group
from streamrl.rollout.multiturn import MultiTurn
from streamrl.feed.prompts import build_prompts
from streamrl.rollout.tools.calculator import CalculationError, CalculatorTool, calculate
from streamrl.rollout.tools.parser import ToolCall, ToolCallError, parse_tool_calls
from streamrl.testing import score
from tests.helpers import last_json_line, read_topic_sync, recompute_logprobs

try:  # a verl user's imports; streamrl's compatible bases when verl is not installed
    from verl.interactions.base import BaseInteraction
    from verl.tools.base_tool import BaseTool
    from verl.tools.schemas import ToolResponse
except ImportError:
    from streamrl.rollout.interactions.base import BaseInteraction
    from streamrl.rollout.tools.base import BaseTool
    from streamrl.rollout.tools.schemas import ToolResponse

ROOT = Path(__file__).resolve().parents[2]
PARAMS = SamplingParams(max_new_tokens=64, temperature=1.0)


# -- a verl user's interaction and tool, written as for verl ------------------------------------

class CountingInteraction(BaseInteraction):
    """Asks again once, then stops; scores 0.25 per answer seen. Remembers what it was given."""

    calls: list[tuple[str, dict]] = []

    def __init__(self, config):
        super().__init__(config)
        self._instance_dict = {}

    async def start_interaction(self, instance_id=None, **kwargs):
        if instance_id is None:
            instance_id = str(uuid.uuid4())
        self._instance_dict[instance_id] = 0
        CountingInteraction.calls.append(("start", dict(kwargs)))
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        self._instance_dict[instance_id] += 1
        n = self._instance_dict[instance_id]
        CountingInteraction.calls.append(("respond", dict(kwargs)))
        return n >= 2, f"try again ({self.config['tone']})", 0.25 * n, {"round": n}

    async def calculate_score(self, instance_id, **kwargs):
        return 0.25 * self._instance_dict[instance_id]

    async def finalize_interaction(self, instance_id, **kwargs):
        del self._instance_dict[instance_id]


JUDGE_SOURCE = '''
try:
    from verl.interactions.base import BaseInteraction
except ImportError:
    from streamrl.rollout.interactions.base import BaseInteraction


class JudgeInteraction(BaseInteraction):
    """Right when the last answer ends with '#### <ground truth>'."""

    def __init__(self, config):
        super().__init__(config)
        self._instance_dict = {}

    async def start_interaction(self, instance_id=None, ground_truth=None, **kwargs):
        self._instance_dict[instance_id] = ground_truth
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        answer = [m for m in messages if m["role"] == "assistant"][-1]["content"]
        right = answer.strip().endswith("#### " + str(self._instance_dict[instance_id]))
        reply = self.config["praise"] if right else "Wrong, query was " + kwargs["query"]
        return right, reply, 1.0 if right else 0.0, {}

    async def finalize_interaction(self, instance_id, **kwargs):
        del self._instance_dict[instance_id]
'''


class EchoTool(BaseTool):
    """Echoes its text with the configured prefix; step reward 0.5; can fail or be slow."""

    def __init__(self, config, tool_schema):
        super().__init__(config, tool_schema)
        self._instance_dict = {}
        self.released: list[tuple[dict, dict]] = []

    async def create(self, instance_id=None, **kwargs):
        if instance_id is None:
            instance_id = str(uuid.uuid4())
        self._instance_dict[instance_id] = {"calls": 0, "create": kwargs}
        return instance_id, ToolResponse()

    async def execute(self, instance_id, parameters, **kwargs):
        if parameters.get("fail"):
            raise RuntimeError("echo was asked to fail")
        if parameters.get("sleep"):
            await asyncio.sleep(parameters["sleep"])
        state = self._instance_dict[instance_id]
        state["calls"] += 1
        state["execute"] = kwargs
        return ToolResponse(text=self.config["prefix"] + str(parameters.get("text"))), 0.5, {"calls": state["calls"]}

    async def calc_reward(self, instance_id, **kwargs):
        return 0.1 * self._instance_dict[instance_id]["calls"] + kwargs.get("bonus", 0.0)

    async def release(self, instance_id, **kwargs):
        self.released.append((self._instance_dict.pop(instance_id), kwargs))


ECHO_SCHEMA = {"type": "function", "function": {
    "name": "echo", "description": "Repeat a text.",
    "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}

# -- the policy: the tiny model, told what to say ----------------------------------------------

TOOL_TURN = ('<tool_call>{"name": "calculator", "arguments": {"expression": "2*(3+4)/7"}}</tool_call>\n'
             '<tool_call>{"name": "echo", "arguments": {"text": "hi"}}</tool_call>')
BAD_TURN = ('<tool_call>not json</tool_call>'
            '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": {"expression": "__import__(\'os\')"}}</tool_call>'
            '<tool_call>{"name": "echo", "arguments": {"fail": true}}</tool_call>'
            '<tool_call>{"name": "echo", "arguments": {"text": "slow", "sleep": 5}}</tool_call>')


def script(context: str) -> str:
    """Turn 1: a tool call where the question asks for one, else a wrong answer; then '#### 7'."""
    turn = context.count("\nassistant: ")
    if turn == 1 and "USE_TOOL" in context:
        return TOOL_TURN
    if turn == 1 and "BAD_CALLS" in context:
        return BAD_TURN
    return "so #### 5" if turn == 1 else "so #### 7"


class ScriptedPolicy(TransformersBackend):
    def __init__(self) -> None:
        super().__init__("tiny", seed=0)
        self.said: list[list[int]] = []  # every response's token ids, in order

    def _generate(self, prompts, n, params):
        tok, out = self.tokenizer, []
        for p in prompts:
            ids = p if isinstance(p, list) else tok(p, add_special_tokens=False)["input_ids"]
            resp = tok(script(tok.decode(ids)), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            lps = recompute_logprobs(self.model, list(ids), resp, params.temperature or 1.0).astype(np.float32)
            samples = [Completion(text=tok.decode(resp, skip_special_tokens=True), prompt_ids=list(ids),
                                  response_ids=list(resp), response_logprobs=lps.copy(), finish_reason="stop",
                                  policy_version=self.version) for _ in range(n)]
            self.said += [s.response_ids for s in samples]
            out.append(samples)
        return out


@pytest.fixture(scope="module")
def policy() -> ScriptedPolicy:
    torch.set_num_threads(1)
    return ScriptedPolicy()


# -- the verl setup, written by the test ------------------------------------------------------

def write_configs(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "judge_interaction.py").write_text(JUDGE_SOURCE)
    interactions = tmp_path / "interactions.yaml"
    interactions.write_text(
        "interaction:\n"
        "  - name: counting\n"
        "    class_name: tests.rollout.test_multiturn.CountingInteraction\n"  # verl's dotted form
        "    config: {tone: kind}\n"
        "  - class_name: judge_interaction.py:JudgeInteraction\n"  # a file beside the config; name 'judge'
        "    config: {praise: Right.}\n")
    tools = tmp_path / "tools.yaml"
    tools.write_text(json.dumps({"tools": [
        {"class_name": "streamrl.rollout.tools.calculator.CalculatorTool", "config": {"type": "native"}},
        {"class_name": "tests.rollout.test_multiturn.EchoTool", "config": {"type": "native", "prefix": "echo:"},
         "tool_schema": ECHO_SCHEMA}]}))  # JSON is YAML
    return interactions, tools


ECHO_KWARGS = {"echo": {"create_kwargs": {"secret": "s3"}, "execute_kwargs": {"mode": "loud"},
                        "calc_reward_kwargs": {"bonus": 1.0}, "release_kwargs": {"why": "done"}}}


def verl_row(tag: str, interaction_kwargs: dict | None, tools_kwargs: dict | None = None) -> dict:
    """A row as verl's multi-turn preprocessing writes it."""
    extra: dict[str, Any] = {"split": "train", "index": 0, "interaction_kwargs": interaction_kwargs}
    if tools_kwargs is not None:
        extra.update(need_tools_kwargs=True, tools_kwargs=tools_kwargs)
    return {"data_source": "gsm8k",
            "prompt": [{"role": "user", "content": f"{tag}: Tom has 3 apples and buys 4. How many?"}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": "7"}, "extra_info": extra}


def dataset(tmp_path: Path) -> Path:
    rows = [verl_row("A", {"name": "counting", "query": "q-A", "ground_truth": "7"}),
            verl_row("B", {"name": "judge", "query": "q-B", "ground_truth": "7"}),
            verl_row("C USE_TOOL", {"name": "judge", "query": "q-C", "ground_truth": "7"}, ECHO_KWARGS)]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)  # the struct columns are unified, as in verl's files
    return path


def rollout_cfg(interactions: Path, tools: Path, **multi_turn: Any) -> RolloutConfig:
    limits = {"max_assistant_turns": 3, "max_user_turns": 2, "max_parallel_calls": 2, **multi_turn}
    mt = MultiTurnConfig(interaction_config_path=str(interactions), tool_config_path=str(tools), **limits)
    return RolloutConfig(multi_turn=mt).validate()


def prompts_of(path: Path) -> list[Prompt]:
    return list(build_prompts(FeedConfig(dataset=str(path), data_source="", prompt_template="",
                                         ground_truth="verl", group_size=2, shuffle=False)))


def generate(policy: ScriptedPolicy, multi: MultiTurn, prompts: list[Prompt]) -> list[list[Trajectory]]:
    renderer = ChatRenderer(policy.tokenizer)
    return [asyncio.run(run_group(p, 2, policy, PARAMS, renderer, multi)) for p in prompts]


@pytest.fixture(scope="module")
def episodes(policy, tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("multiturn")
    CountingInteraction.calls.clear()
    multi = MultiTurn.from_config(rollout_cfg(*write_configs(tmp_path)))
    groups = generate(policy, multi, prompts_of(dataset(tmp_path)))
    return multi, groups


# -- the tests ----------------------------------------------------------------------------------

def test_each_sample_runs_the_interaction_it_names_with_its_kwargs(episodes):
    multi, (a, b, c) = episodes
    assert set(multi.interactions) == {"counting", "judge"}  # 'judge' derived from JudgeInteraction, as verl does
    for t in a:  # counting: asks again once, 0.25 per answer
        assert [m["role"] for m in t.turns] == ["assistant", "user", "assistant"]
        assert t.turns[1]["content"] == "try again (kind)"
        assert [m.get("score") for m in t.turns] == [0.25, None, 0.5]
        assert t.extra_info["interaction"] == "counting" and t.extra_info["turn_scores"] == [0.25, 0.5]
        assert t.extra_info["turn_info"] == [{"round": 1}, {"round": 2}]
    # verl passes the whole interaction_kwargs (name included) to start and to every response
    starts = [kw for what, kw in CountingInteraction.calls if what == "start"]
    responds = [kw for what, kw in CountingInteraction.calls if what == "respond"]
    assert len(starts) == 2 and len(responds) == 4
    for kw in starts + responds:
        assert kw["name"] == "counting" and kw["query"] == "q-A" and kw["ground_truth"] == "7"
    assert multi.interactions["counting"]._instance_dict == {}  # every episode finalized
    for t in b:  # judge: wrong, told so with its query, then right
        assert [m["role"] for m in t.turns] == ["assistant", "user", "assistant"]
        assert t.turns[0]["content"] == "so #### 5" and t.turns[1]["content"] == "Wrong, query was q-B"
        assert [m.get("score") for m in t.turns] == [0.0, None, 1.0] and t.response == "so #### 7"
        assert t.extra_info["interaction"] == "judge"
    for t in c:  # judge with tools: the tool turn is answered by the tools, not the interaction
        assert [m["role"] for m in t.turns] == ["assistant", "tool", "tool", "assistant"]
        assert t.turns[0]["tool_calls"] == [{"name": "calculator", "arguments": {"expression": "2*(3+4)/7"}},
                                            {"name": "echo", "arguments": {"text": "hi"}}]
        assert "score" not in t.turns[0]
        assert t.turns[1] == {"role": "tool", "name": "calculator", "content": "2", "score": 0.0}
        assert t.turns[2] == {"role": "tool", "name": "echo", "content": "echo:hi", "score": 0.5,
                              "metrics": {"calls": 1}}
        assert t.turns[3]["score"] == 1.0 and t.response == "so #### 7"
        assert t.extra_info["tool_calls"] == 2
        assert t.extra_info["tool_rewards"] == {"calculator": 0.0, "echo": pytest.approx(1.1)}
        Trajectory.decode(t.encode())  # the records pass the topic's schema
    # per-sample tools_kwargs reached the tool: create_kwargs both as keywords and as create_kwargs=
    # (verl's two loops), execute/calc_reward/release kwargs at their calls; one instance per episode
    echo = multi.tool_map["echo"].tool
    assert len(echo.released) == 2 and echo._instance_dict == {}
    for state, release_kwargs in echo.released:
        assert state["create"] == {"secret": "s3", "create_kwargs": {"secret": "s3"}}
        assert state["execute"] == {"mode": "loud"} and release_kwargs == {"why": "done"}


def test_tool_schemas_are_in_the_prompt_and_tool_turns_are_not_trained_on(episodes, policy):
    multi, groups = episodes
    tok = policy.tokenizer
    for t in [t for g in groups for t in g]:
        prompt_ids, ids = t.array("prompt_ids"), t.array("response_ids")
        mask, lps = t.array("response_mask"), t.array("response_logprobs")
        assert len(ids) == len(mask) == len(lps)
        # the tokens the model produced, counted from the turns: exactly the positions with mask 1
        model_tokens = sum(len(tok(m["content"], add_special_tokens=False)["input_ids"]) + 1  # + its <eos>
                           for m in t.turns if m["role"] == "assistant")
        assert int(mask.sum()) == model_tokens
        assert np.all(lps[mask == 0] == 0.0)
        # log-probs on mask 1 are the model's own in the context it really had
        want = recompute_logprobs(policy.model, prompt_ids.tolist(), ids.tolist(), PARAMS.temperature)
        np.testing.assert_allclose(lps[mask == 1], want[mask == 1], atol=2e-4)
        # and the tools were described to the model (the tiny tokenizer has no template: as text)
        head = tok.decode(prompt_ids)
        assert head.startswith("system: # Tools") and '"name": "calculator"' in head and '"name": "echo"' in head
    c = groups[2][0]
    mask, ids = c.array("response_mask"), c.array("response_ids")
    zero = np.flatnonzero(mask == 0)
    assert tok.decode(ids[zero[0]:zero[-1] + 1]) == "\ntool: 2\ntool: echo:hi\nassistant: "


@pytest.mark.parametrize("reducer, weight, gamma, want", [
    ("none", 1.0, 1.0, [1.0, 1.0, 1.0]),
    ("sum", 1.0, 1.0, [1.75, 2.0, 2.5]),         # A: .25+.5  B: 0+1  C: 0 (calculator) + .5 (echo) + 1
    ("last", 0.5, 1.0, [1.25, 1.5, 1.5]),
    ("mean", 1.0, 1.0, [1.375, 1.5, 1.5]),
    ("max", 2.0, 1.0, [2.0, 3.0, 3.0]),
    ("discounted", 1.0, 0.9, [1.7, 1.9, 2.26]),  # sum gamma**t * s_t
])
def test_the_reward_reduces_the_turn_scores(episodes, reducer, weight, gamma, want):
    _, groups = episodes
    records = [groups[i][0] for i in range(3)]
    out = score(records, reward={"turn_scores": {"reducer": reducer, "weight": weight, "gamma": gamma}})
    assert all(isinstance(r, Rewarded) for r in out), out
    assert [r.reward for r in out] == pytest.approx(want, abs=1e-6)
    for r in out:
        assert r.reward_info["status"] == "ok"
        if reducer == "none":
            assert "turn_reward" not in r.reward_info
        else:
            info = r.reward_info["turn_scores"]
            assert info["reducer"] == reducer and info["scorer_reward"] == 1.0  # '#### 7' is right
            assert r.reward_info["turn_reward"] == pytest.approx(r.reward - 1.0, abs=1e-6)
    single = score([{"response": "#### 7", "ground_truth": "7"}], reward={"turn_scores": {"reducer": "sum"}})[0]
    assert single.reward == 1.0 and "turn_reward" not in single.reward_info  # no turns: nothing added


def test_tool_errors_go_back_to_the_model_and_the_call_limit_holds(policy, tmp_path):
    interactions, tools = write_configs(tmp_path)
    rows = [verl_row("D BAD_CALLS", {"name": "judge", "query": "q-D", "ground_truth": "7"}),
            verl_row("E USE_TOOL", None, ECHO_KWARGS)]  # no interaction: tools only
    path = tmp_path / "more.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    d_prompt, e_prompt = prompts_of(path)
    wide = MultiTurn.from_config(rollout_cfg(interactions, tools, max_parallel_calls=8, tool_timeout_s=0.5))
    ((d, _),) = generate(policy, wide, [d_prompt])
    assert [m["role"] for m in d.turns] == ["assistant"] + ["tool"] * 5 + ["assistant"]
    assert d.turns[0]["tool_calls"][0] == {"error": d.turns[1]["error"].split(": ", 1)[1]}
    texts = [m["content"] for m in d.turns[1:6]]
    assert texts[0].startswith("Error when executing tool: the tool call could not be read: the tool call is not valid JSON")
    assert texts[1] == "Error when executing tool: no tool named 'nope' (tools: calculator, echo)"
    assert texts[2] == "Error: only numbers, + - * / ** and parentheses are allowed (found a function call)"
    assert texts[3] == "Error when executing tool: RuntimeError: echo was asked to fail"
    assert texts[4] == "Error when executing tool: timed out after 0.5s"
    assert d.turns[-1]["score"] == 1.0  # the episode went on and ended as the interaction said
    narrow = MultiTurn.from_config(rollout_cfg(interactions, tools, max_parallel_calls=1))
    ((e, _),) = generate(policy, narrow, [e_prompt])
    assert [m["role"] for m in e.turns] == ["assistant", "tool", "assistant"]  # echo's call was ignored
    assert e.turns[0]["ignored_tool_calls"] == 1 and "interaction" not in e.extra_info
    assert e.extra_info["tool_rewards"] == {"calculator": 0.0}
    # a model that keeps calling tools stops at max_user_turns (tool rounds count as user turns)
    capped = MultiTurn.from_config(rollout_cfg(interactions, tools, max_user_turns=0))
    ((f, _),) = generate(policy, capped, [e_prompt])
    assert [m["role"] for m in f.turns] == ["assistant"] and f.array("response_mask").all()


def test_the_calculator_parses_and_never_runs_code():
    assert calculate("2*(3+4)/7") == 2.0
    assert calculate("-2 ** 2 + 10 / 4") == -1.5
    for code, why in [("__import__('os')", "function call"), ("(1).real", "attribute access"),
                      ("x + 1", "a name"), ("'a' * 3", "only numbers"), ("[1][0]", "subscript"),
                      ("9 ** 9 ** 9", "too large"), ("1 / 0", "division by zero"), ("1 +", "not a valid"),
                      ("True + 1", "only numbers"), ("1" * 300, "longer than"), ("+".join(["1"] * 100), "more than")]:
        with pytest.raises(CalculationError, match=why):
            calculate(code)

    async def go():
        tool = CalculatorTool({}, None)
        iid, _ = await tool.create()
        ok = await tool.execute(iid, {"expression": "2*(3+4)/7"})
        bad = await tool.execute(iid, {"expression": "__import__('os').system('true')"})
        missing = await tool.execute(iid, {})
        return tool, ok, bad, missing

    tool, ok, bad, missing = asyncio.run(go())
    assert tool.name == "calculator" and ok[0].text == "2" and ok[1] == 0.0
    assert bad[0].text.startswith("Error: ") and "function call" in bad[0].text
    assert missing[0].text.startswith("Error: ")


def test_hermes_tool_calls_are_read_as_data():
    calls = parse_tool_calls('think <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call> and '
                             '<tool_call>{"name": "g", "arguments": "{\\"b\\": 2}"}</tool_call>'
                             '<tool_call>{"name": "h", "arguments": [1]}</tool_call><tool_call>oops')
    assert calls[:2] == [ToolCall("f", {"a": 1}), ToolCall("g", {"b": 2})]
    assert isinstance(calls[2], ToolCallError) and len(calls) == 3  # the unclosed block is no call
    assert parse_tool_calls("no calls here") == []


def test_the_feed_carries_verls_per_sample_fields(tmp_path):
    kwargs = {"interaction_kwargs": {"name": "judge", "query": "q", "ground_truth": "7"},
              "tools_kwargs": {"calculator": {"create_kwargs": {"ground_truth": "7"}}}}
    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text(json.dumps({"question": "3+4?", "answer": "#### 7", "extra_info": kwargs}) + "\n")
    (p,) = build_prompts(FeedConfig(dataset=str(jsonl), prompt_template="{question}", shuffle=False))
    assert p.extra_info["interaction_kwargs"] == kwargs["interaction_kwargs"]
    assert p.extra_info["tools_kwargs"] == kwargs["tools_kwargs"]
    # verl's parquet: struct columns unified across rows (missing keys become None)
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist([verl_row("A", {"name": "counting", "tone": "x"}),
                                         verl_row("B", {"name": "judge", "query": "q-B"}, ECHO_KWARGS),
                                         verl_row("C", None)]), path)
    a, b, c = prompts_of(path)
    assert a.extra_info["interaction_kwargs"] == {"name": "counting", "tone": "x", "query": None}
    assert b.extra_info["tools_kwargs"]["echo"]["create_kwargs"] == {"secret": "s3"}
    assert c.extra_info["interaction_kwargs"] is None
    multi = MultiTurn(interactions={"counting": object(), "judge": object()})
    assert multi.interaction_for(a)[0] == "counting" and multi.interaction_for(b)[2]["query"] == "q-B"
    assert multi.interaction_for(b)[2]["ground_truth"] == "7"  # the prompt's, when the kwargs carry none
    assert multi.interaction_for(c) is None
    with pytest.raises(Failure, match="unknown_interaction"):
        MultiTurn(interactions={"judge": object(), "other": object()}).interaction_for(a)


def test_config_errors_name_the_field(tmp_path):
    interactions, tools = write_configs(tmp_path)
    bad = tmp_path / "bad.yaml"

    def load(text: str, field: str = "interaction_config_path") -> None:
        bad.write_text(text)
        MultiTurn.from_config(RolloutConfig(multi_turn=MultiTurnConfig(**{field: str(bad)})))

    with pytest.raises(ConfigError, match="duplicate interaction name 'judge'"):
        load("interaction:\n  - {class_name: streamrl.rollout.interactions.gsm8k.Gsm8kInteraction, name: judge}\n"
             "  - {class_name: streamrl.rollout.interactions.gsm8k.Gsm8kInteraction, name: judge}\n")
    with pytest.raises(ConfigError, match=r"interaction\[0\].class_name.*cannot load"):
        load("interaction:\n  - {class_name: no_such_module.Thing}\n")
    with pytest.raises(ConfigError, match="unknown keys"):
        load("interaction:\n  - {class: streamrl.rollout.interactions.gsm8k.Gsm8kInteraction}\n")
    with pytest.raises(ConfigError, match=r"tools\[0\].config.type.*mcp"):
        load("tools:\n  - {class_name: streamrl.rollout.tools.calculator.CalculatorTool, config: {type: mcp}}\n",
             "tool_config_path")
    with pytest.raises(ConfigError, match=r"tools\[0\].tool_schema.*type must be 'function'"):
        load("tools:\n  - {class_name: streamrl.rollout.tools.calculator.CalculatorTool, tool_schema: {type: x}}\n",
             "tool_config_path")
    with pytest.raises(ConfigError, match="rollout.multi_turn.interaction_config_path.*no file"):
        MultiTurn.from_config(RolloutConfig(multi_turn=MultiTurnConfig(interaction_config_path="nowhere.yaml")))
    with pytest.raises(ConfigError, match="rollout.interaction.name"):
        RolloutConfig(interaction=InteractionConfig(name="gsm8k"),
                      multi_turn=MultiTurnConfig(interaction_config_path=str(interactions))).validate()
    with pytest.raises(ConfigError, match="reward.turn_scores.reducer"):
        score([], reward={"turn_scores": {"reducer": "median"}})
    # the packaged examples, by their relative names
    multi = MultiTurn.from_config(RolloutConfig(multi_turn=MultiTurnConfig(
        interaction_config_path="interaction_config/gsm8k.yaml", tool_config_path="tool_config/gsm8k.yaml")))
    assert list(multi.interactions) == ["gsm8k"] and multi.interactions["gsm8k"].method == "strict"
    assert [t.name for t in multi.tools] == ["calc_gsm8k_reward", "calculator"]


def test_the_learner_trains_only_where_the_mask_is_1(episodes):
    from streamrl.learner.config import LearnerConfig
    from streamrl.learner.samples import Sample as TrainSample
    from streamrl.learner.trainer import Trainer

    _, groups = episodes
    trajs = [t for g in groups for t in g]

    def samples(behaviour_shift: np.ndarray | None = None) -> list[TrainSample]:
        out = []
        for i, t in enumerate(trajs):
            lps = t.array("response_logprobs").copy()
            if behaviour_shift is not None:
                lps = lps + behaviour_shift(t.array("response_mask"))
            out.append(TrainSample(id=t.id, group_id=t.group_id, prompt_ids=t.array("prompt_ids"),
                                   response_ids=t.array("response_ids"), reward=float(i % 3), policy_version=0,
                                   behaviour_logprobs=lps.astype(np.float32), response_mask=t.array("response_mask")))
        return out

    def step(batch: list[TrainSample]) -> dict[str, float]:
        return Trainer(LearnerConfig(policy="tiny", micro_batch_size=16)).step(batch)

    base = step(samples())
    assert base["tokens"] == sum(int(t.array("response_mask").sum()) for t in trajs)
    # garbage behaviour log-probs where the mask is 0 change nothing; where it is 1 they do
    on_zero = step(samples(lambda m: np.where(m == 0, -7.0, 0.0)))
    on_one = step(samples(lambda m: np.where(m == 1, -0.7, 0.0)))
    assert on_zero["loss"] == pytest.approx(base["loss"], abs=1e-7) and on_zero["grad_norm"] == pytest.approx(base["grad_norm"])
    assert abs(on_one["loss"] - base["loss"]) > 1e-4


@pytest.mark.e2e
def test_a_verl_multiturn_gsm8k_setup_runs_through_streamrl_run(bootstrap, tmp_path):
    """verl's own interaction and tool config files (naming verl's classes: streamrl's equivalents
    stand in when verl is not installed), a parquet as verl's multi-turn preprocessing writes it,
    and nothing but streamrl overrides around them."""
    interactions = tmp_path / "gsm8k_interaction_config.yaml"
    interactions.write_text('interaction:\n  - name: "gsm8k"\n'
                            '    class_name: "verl.interactions.gsm8k_interaction.Gsm8kInteraction"\n    config: {}\n')
    tools = tmp_path / "gsm8k_tool_config.yaml"
    tools.write_text('tools:\n  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"\n    config: \n      type: native\n'
                     '    tool_schema:\n      type: "function"\n      function:\n        name: "calc_gsm8k_reward"\n'
                     '        description: "A tool for calculating the reward of gsm8k."\n'
                     '        parameters:\n          type: "object"\n          properties:\n            answer:\n'
                     '              type: "string"\n              description: "The answer, digits"\n'
                     '          required: ["answer"]\n')
    rows = []
    for i, (question, truth) in enumerate([("Tom has 3 apples and buys 4. How many?", "7"),
                                           ("Ann has 10 pens and gives away 2. How many left?", "8"),
                                           ("What is 6 times 7?", "42"), ("What is 9 plus 10?", "19")]):
        q = question + " Let's think step by step and output the final answer after `####`."
        rows.append({"data_source": "openai/gsm8k",
                     "prompt": [{"role": "system", "content": "You are a math expert. Use the calc_gsm8k_reward tool."},
                                {"role": "user", "content": q}],
                     "ability": "math", "reward_model": {"style": "rule", "ground_truth": truth},
                     "extra_info": {"split": "train", "index": i, "question": question, "need_tools_kwargs": True,
                                    "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": truth}}},
                                    "interaction_kwargs": {"name": "gsm8k", "query": q, "ground_truth": truth}}})
    data = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    prefix = f"t{uuid.uuid4().hex[:10]}"
    proc = subprocess.run(
        [sys.executable, "-m", "streamrl", "run", "configs/local-gsm8k.yaml", "--bootstrap-servers", bootstrap,
         f"bus.topic_prefix={prefix}", f"run.out_dir={tmp_path / 'runs'}", "run.reward_members=1",
         f"feed.dataset={data}",  # verl's format, recognised by its columns: no feed key to set
         "feed.limit=4", "feed.group_size=2", "learner.groups_per_mini_batch=2", "rollout.trajectories_per_version=4",
         "learner.versions=1", f"rollout.multi_turn.interaction_config_path={interactions}",
         f"rollout.multi_turn.tool_config_path={tools}", "rollout.multi_turn.max_assistant_turns=2",
         "rollout.multi_turn.max_user_turns=1", "reward.turn_scores.reducer=last"],
        cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = last_json_line(proc.stdout)
    assert summary["ended"] in ("done", "data_exhausted") and 1 <= summary["versions"] <= 2 and summary["deadletters"] == 0
    bus = Bus(BusConfig(bootstrap_servers=bootstrap, topic_prefix=prefix))
    n = summary["records"]["rewarded"]
    records = [Rewarded.decode(m.value) for m in read_topic_sync(bus, "rewarded", n)]
    assert n >= 4 and len(records) == n
    tok = TransformersBackend("tiny").tokenizer
    for r in records:
        assert r.data_source == "openai/gsm8k" and r.extra_info["interaction"] == "gsm8k"
        assert r.extra_info["interaction_kwargs"]["query"].startswith(r.extra_info["question"])
        assistant = [t for t in r.turns if t["role"] == "assistant"]
        assert 1 <= len(assistant) <= 2 and all(t["role"] in ("assistant", "user", "tool") for t in r.turns)
        scored = [t["score"] for t in r.turns if "score" in t]
        assert scored and all(s in (0.0, 1.0, -0.05) for s in scored)
        info = r.reward_info
        assert info["turn_scores"]["reducer"] == "last" and info["turn_reward"] == scored[-1]
        assert r.reward == pytest.approx(info["turn_scores"]["scorer_reward"] + info["turn_reward"], abs=1e-6)
        mask = r.array("response_mask")
        assert len(mask) == len(r.array("response_ids")) and 0 < mask.sum() <= len(mask)
        assert '"name": "calc_gsm8k_reward"' in tok.decode(r.array("prompt_ids"))  # the tool's schema was offered


def test_chat_templates_get_the_tools_and_tool_turns_extend_the_context_exactly():
    from streamrl.policy import byte_tokenizer

    tok = byte_tokenizer()
    tok.chat_template = ("{% if tools %}<|system|>\n{% for t in tools %}{{ t['function']['name'] }};{% endfor %}<eos>\n"
                         "{% endif %}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<eos>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    r = ChatRenderer(tok)
    q = [{"role": "user", "content": "q"}]
    tools = [ECHO_SCHEMA]
    assert r.prompt_text(q, tools) == "<|system|>\necho;<eos>\n<|user|>\nq<eos>\n<|assistant|>\n"  # via tools=
    call = '<tool_call>{"name": "echo", "arguments": {"text": "x"}}</tool_call>'
    new = [{"role": "tool", "content": "x"}, {"role": "tool", "content": "y"}]
    context = r.prompt_text(q, tools) + call + "<eos>" + r.turn_text(q, call, new, stopped=True, tools=tools)
    assert context == tok.apply_chat_template(q + [{"role": "assistant", "content": call}, *new], tools=tools,
                                              add_generation_prompt=True, tokenize=False)
    # a template that does not render tools: they are described in the system message instead
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<eos>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
    r = ChatRenderer(tok)
    text = r.prompt_text([{"role": "system", "content": "Be brief."}, *q], tools)
    assert text.startswith("<|system|>\nBe brief.\n\n# Tools") and '"name": "echo"' in text
    assert r.turn_text(q, call, new, stopped=True, tools=tools) == "\n<|tool|>\nx<eos>\n<|tool|>\ny<eos>\n<|assistant|>\n"
