"""The scorer table: user scorers by path and by module, sync and async, in worker processes
with a per-record timeout, signature checks at start, dict extras into reward_info, hybrids,
retries, fallbacks, and holding a record while its scorer is unavailable. Scoring is driven
through ``reward.scoring.Scoring`` (the stage's own code path) without a broker: nothing here
connects; ``test_reward_stage.py`` runs the stage on the real broker."""

from __future__ import annotations

import asyncio
import textwrap
import time

import pytest

from streamrl import metrics
from streamrl.config import ConfigError
from streamrl.errors import Failure
from streamrl.pipeline_config import PipelineConfig
from streamrl.records import Trajectory
from streamrl.reward.config import ScorerSpec
from streamrl.reward.scoring import Scoring
from streamrl.reward.stage import RewardStage
from tests.helpers import serve_app, trajectory

USER_SCORERS = '''
import asyncio, math, os, time
from streamrl.scorers.base import ScoreError, ScorerUnavailable

VERSION = "7"

def exact(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    return {"score": float(solution_str == ground_truth) + bonus, "pid": os.getpid(),
            "tag": (extra_info or {}).get("tag")}

async def judge_like(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    await asyncio.sleep(0.01)
    return {"score": 0.5, "router": kwargs.get("reward_router_address"),
            "saw_prompt": kwargs.get("prompt")}

async def needs_router(data_source, solution_str, ground_truth, extra_info=None, *,
                       reward_router_address, **kwargs):
    return {"score": 1.0, "router": reward_router_address}

def code(data_source, solution_str, ground_truth, extra_info=None, memory_limit_mb=256):
    return 1.0

def count_tokens(data_source, solution_str, ground_truth, extra_info=None, *,
                 reward_model_tokenizer):
    return {"score": 1.0, "tokens": len(reward_model_tokenizer(solution_str)["input_ids"]),
            "pid": os.getpid()}

def wrong_signature(text):
    return 1.0

def slow(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(float(solution_str))
    return 1.0

def nan(data_source, solution_str, ground_truth, extra_info=None):
    return math.nan

CALLS = {"flaky": 0, "down": 0}

def flaky(data_source, solution_str, ground_truth, extra_info=None):
    CALLS["flaky"] += 1
    if CALLS["flaky"] < 3:
        raise RuntimeError("transient")
    return 1.0

def always_fails(data_source, solution_str, ground_truth, extra_info=None):
    raise ScoreError("no_verdict", "cannot tell")

async def ask_router(data_source, solution_str, ground_truth, extra_info=None, *,
                     reward_router_address, **kwargs):
    import aiohttp
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://{reward_router_address}/v1/chat/completions",
                                json={"messages": [{"role": "user", "content": solution_str}]}) as resp:
            text = (await resp.json())["choices"][0]["message"]["content"]
    return {"score": float(text.rsplit(":", 1)[1]) / 10, "router": reward_router_address}

async def down_twice(data_source, solution_str, ground_truth, extra_info=None):
    CALLS["down"] += 1
    if CALLS["down"] <= 2:
        raise ScorerUnavailable("backend down")
    return 0.25
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "user_scorers.py"
    path.write_text(textwrap.dedent(USER_SCORERS))
    return path


def _stage(scorers: dict[str, ScorerSpec], **reward) -> Scoring:
    cfg = PipelineConfig()
    cfg.reward.process_workers = 2
    cfg.reward.retry_backoff_s = 0.01
    for k, v in reward.items():
        setattr(cfg.reward, k, v)
    cfg.reward.scorers.update(scorers)
    return Scoring(cfg.reward)


async def _score(stage: Scoring, traj: Trajectory):
    return await stage.score(stage.table.lookup(traj.data_source), traj)


def _run(stage: Scoring, coro_fn):
    async def main():
        await stage.table.start()
        try:
            return await coro_fn()
        finally:
            await stage.table.close()
    return asyncio.run(main())


def test_user_scorers_by_path_sync_inline_and_process_and_async(user_file):
    import os

    stage = _stage({
        "inline": ScorerSpec(type="function", path=f"{user_file}:exact", executor="inline",
                             kwargs={"bonus": 0.5}),
        "proc": ScorerSpec(type="function", path=f"{user_file}:exact", executor="process"),
        "async": ScorerSpec(type="function", path=f"{user_file}:judge_like"),
    })

    async def go():
        return [await _score(stage, trajectory(data_source=ds, response="42", extra_info={"tag": ds}))
                for ds in ("inline", "proc", "async")]

    (r1, i1), (r2, i2), (r3, i3) = _run(stage, go)
    assert (r1, i1["tag"], i1["pid"], i1["status"]) == (1.5, "inline", os.getpid(), "ok")
    assert (r2, i2["tag"], i2["status"]) == (1.0, "proc", "ok")
    assert i2["pid"] != os.getpid()  # ran in a worker process
    assert (r3, i3["saw_prompt"], i3["router"]) == (0.5, "What is six times seven?", None)
    entry = stage.table.lookup("inline")
    assert entry.label == {"name": "inline", "version": "7"}  # the module's VERSION


def test_user_scorer_by_module_name(user_file, monkeypatch):
    monkeypatch.syspath_prepend(str(user_file.parent))
    stage = _stage({"mod": ScorerSpec(type="function", path="user_scorers:exact",
                                      executor="process", data_sources=["a", "b"])})
    out = _run(stage, lambda: asyncio.gather(_score(stage, trajectory(data_source="a", response="42")),
                                             _score(stage, trajectory(data_source="b", response="41"))))
    assert [r for r, _ in out] == [1.0, 0.0]


@pytest.mark.parametrize("spec, reward, message", [
    (dict(path="{f}:wrong_signature"), {}, "does not take verl's scorer arguments"),
    (dict(path="{f}:exact", kwargs={"nope": 1}), {}, "nope"),
    (dict(path="{f}:needs_router"), {}, "requires 'reward_router_address'"),
    (dict(path="{f}:missing"), {}, "has no function 'missing'"),
    (dict(path="no/such/file.py:f"), {}, "no file"),
    (dict(path="{f}:slow", executor="fork"), {}, "executor"),
    (dict(path="{f}:judge_like", executor="process"), {}, "is async"),
    (dict(type="hybrid", parts={"ghost": 1.0}), {}, "ghost"),
    (dict(type="rule", rule="chess"), {}, "not a built-in rule"),
    (dict(type="telepathy"), {}, "type"),
    (dict(path="{f}:exact"), {"reward_router": "nowhere"}, "reward_router"),
])
def test_bad_scorer_config_fails_at_start_naming_the_field(user_file, spec, reward, message):
    spec = {"type": "function", **spec}
    if "path" in spec:
        spec["path"] = spec["path"].format(f=user_file)
    with pytest.raises(ConfigError) as err:
        _stage({"mine": ScorerSpec(**spec)}, **reward)
    assert "reward" in str(err.value) and message in str(err.value)


def test_a_function_that_needs_the_router_gets_it_when_one_is_configured(user_file):
    stage = _stage({"r": ScorerSpec(type="function", path=f"{user_file}:needs_router"),
                    "j": ScorerSpec(type="function", path=f"{user_file}:judge_like")},
                   reward_router="127.0.0.1:8123")
    (r1, i1), (r2, i2) = _run(stage, lambda: asyncio.gather(_score(stage, trajectory(data_source="r")),
                                                           _score(stage, trajectory(data_source="j"))))
    assert i1["router"] == i2["router"] == "127.0.0.1:8123"


def test_process_pool_timeout_kills_the_worker_and_never_blocks_the_loop(user_file):
    stage = _stage({
        "slow": ScorerSpec(type="function", path=f"{user_file}:slow", executor="process", timeout_s=1.0),
        "slow_fb": ScorerSpec(type="function", path=f"{user_file}:slow", executor="process",
                              timeout_s=1.0, fallbacks={"timeout": 0.0}),
        "fast": ScorerSpec(type="function", path=f"{user_file}:exact", executor="process"),
        "async": ScorerSpec(type="function", path=f"{user_file}:judge_like"),
    }, max_attempts=1)

    async def go():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        t = asyncio.create_task(ticker())
        started = time.monotonic()
        slow = asyncio.gather(_score(stage, trajectory(data_source="slow", response="30")), return_exceptions=True)
        slow_fb = _score(stage, trajectory(data_source="slow_fb", response="30"))
        quick = await _score(stage, trajectory(data_source="async"))
        quick_at = time.monotonic() - started
        (dead,), fallback = await asyncio.gather(slow, slow_fb)
        elapsed = time.monotonic() - started
        # the pool recovered from the killed workers
        after = await _score(stage, trajectory(data_source="fast", response="42"))
        t.cancel()
        return quick, quick_at, dead, fallback, elapsed, after, ticks

    quick, quick_at, dead, fallback, elapsed, after, ticks = _run(stage, go)
    assert quick[0] == 0.5 and quick_at < elapsed  # answered while the slow ones were running
    assert isinstance(dead, Failure) and dead.reason == "timeout"
    assert fallback[0] == 0.0 and fallback[1]["status"] == "fallback:timeout"
    assert elapsed < 10  # killed at 1 s, not after the 30 s sleep
    assert after[0] == 1.0
    assert ticks >= elapsed / 0.05 * 0.5  # the event loop kept running throughout


def test_retries_then_ok_or_dead_letter_and_non_finite(user_file):
    stage = _stage({
        "flaky": ScorerSpec(type="function", path=f"{user_file}:flaky", executor="inline"),
        "fails": ScorerSpec(type="function", path=f"{user_file}:always_fails", executor="inline"),
        "nan": ScorerSpec(type="function", path=f"{user_file}:nan", executor="inline"),
    }, max_attempts=3)
    before = metrics.REWARD_ATTEMPT_ERRORS.labels("fails", "no_verdict")._value.get()

    async def go():
        return await asyncio.gather(*(_score(stage, trajectory(data_source=ds)) for ds in ("flaky", "fails", "nan")),
                                    return_exceptions=True)

    flaky, fails, nan = _run(stage, go)
    assert flaky[0] == 1.0 and flaky[1]["attempts"] == 3 and flaky[1]["status"] == "ok"
    assert isinstance(fails, Failure) and fails.reason == "no_verdict"
    assert metrics.REWARD_ATTEMPT_ERRORS.labels("fails", "no_verdict")._value.get() - before == 3
    assert isinstance(nan, Failure) and nan.reason == "non_finite_reward"


def test_unavailable_scorer_holds_the_record_until_it_answers(user_file):
    stage = _stage({"down": ScorerSpec(type="function", path=f"{user_file}:down_twice")},
                   max_attempts=1, unavailable_backoff_max_s=0.05)
    before = metrics.REWARD_UNAVAILABLE.labels("down")._value.get()
    reward, info = _run(stage, lambda: _score(stage, trajectory(data_source="down")))
    assert (reward, info["status"]) == (0.25, "ok")  # held through two outages, never scored 0
    assert metrics.REWARD_UNAVAILABLE.labels("down")._value.get() - before == 2
    assert metrics.REWARD_HELD.labels("down")._value.get() == 0


def test_hybrid_weights_parts_and_reports_each(user_file):
    stage = _stage({
        "judge_part": ScorerSpec(type="function", path=f"{user_file}:judge_like", data_sources=[]),
        "mix": ScorerSpec(type="hybrid", parts={"gsm8k": 0.75, "judge_part": 0.25}),
    })
    reward, info = _run(stage, lambda: _score(stage, trajectory(data_source="mix", response="#### 42")))
    assert reward == pytest.approx(0.75 * 1.0 + 0.25 * 0.5)
    assert info["parts"]["gsm8k"] == {"score": 1.0, "weight": 0.75, "pred": "42"}
    assert info["parts"]["judge_part"]["score"] == 0.5
    assert stage.table.lookup("judge_part") is None  # a part only, serves no data source


def test_judge_entry_and_its_router_address_for_an_async_user_scorer(user_file):
    """A judge entry scores through a real OpenAI-style HTTP server; an async user function
    named with ``reward_router: judge`` gets the judge router's local proxy as its
    ``reward_router_address`` and reaches the same server through it."""
    from aiohttp import web

    async def main():
        seen = []

        async def chat(request):
            body = await request.json()
            seen.append(body["messages"][-1]["content"])
            return web.json_response({"choices": [{"message": {"content": "Fine work. Score: 8"}}],
                                      "usage": {"total_tokens": 20}})

        async def models(request):
            return web.json_response({"data": []})

        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/v1/models", models)
        runner, url = await serve_app(app)
        stage = _stage({"judge": ScorerSpec(type="judge", judge={"urls": [url]}),
                        "via_router": ScorerSpec(type="function", path=f"{user_file}:ask_router")},
                       reward_router="judge")
        await stage.table.start()
        try:
            judged = await _score(stage, trajectory(data_source="judge", response="six sevens are 42"))
            routed = await _score(stage, trajectory(data_source="via_router", response="hello"))
        finally:
            await stage.table.close()
            await runner.cleanup()
        return judged, routed, seen

    (jr, ji), (rr, ri), seen = asyncio.run(main())
    assert jr == pytest.approx(0.8) and ji["status"] == "ok" and ji["judge_score_raw"] == 8.0
    assert "six sevens are 42" in seen[0] and "What is six times seven?" in seen[0]  # the prompt went along
    assert rr == pytest.approx(0.8) and ri["router"].startswith("127.0.0.1:")
    assert seen[1] == "hello"


def test_the_example_config_builds_its_table(user_file):
    from pathlib import Path

    from streamrl.pipeline_config import load_config
    from streamrl.scorers.hybrid import HybridScorer
    from streamrl.scorers.judge import JudgeScorer

    example = Path(__file__).resolve().parents[2] / "configs" / "reward.example.yaml"
    cfg = load_config(example, [f"reward.scorers.code.path={user_file}:code"])
    cfg.bus.bootstrap_servers = "127.0.0.1:1"
    stage = RewardStage(cfg)
    route = {ds: e.name for ds, e in stage.table.routes.items()}
    assert route["openai/gsm8k"] == "gsm8k" and route["taco"] == "code"
    assert route["open_qa"] == "judge" and route["helpfulness"] == "helpful" and "rm" not in route
    assert isinstance(stage.table.lookup("open_qa").scorer, JudgeScorer)
    assert isinstance(stage.table.lookup("helpfulness").scorer, HybridScorer)
    assert stage.table.lookup("gsm8k").scorer.kwargs == {"method": "strict", "format_score": 0.0}


def test_the_reward_verb_fails_at_start_on_a_bad_scorer_naming_the_field(user_file):
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    base = [sys.executable, "-m", "streamrl", "reward", "--bootstrap-servers", "127.0.0.1:1"]
    needs_router = subprocess.run(
        [*base, "reward.scorers.mine.type=function", f"reward.scorers.mine.path={user_file}:needs_router"],
        capture_output=True, text=True, timeout=60, cwd=repo)
    assert needs_router.returncode == 2
    assert "reward.scorers.mine.path" in needs_router.stderr
    assert "reward_router_address" in needs_router.stderr
    assert "metrics:" not in needs_router.stdout  # before serving anything or connecting
    typo = subprocess.run([*base, "reward.max_attemptz=3"], capture_output=True, text=True,
                          timeout=60, cwd=repo)
    assert typo.returncode != 0 and "reward.max_attemptz" in typo.stderr


def test_builtin_group_hooks():
    from streamrl.reward.hooks import majority_vote, normalize

    members = [{"reward": r, "reward_info": {"pred": p}} for r, p in
               [(1.0, "42"), (0.0, "41"), (1.0, "42"), (0.0, None)]]
    assert [m["score"] for m in majority_vote(members)] == [1.0, 0.0, 1.0, 0.0]
    assert majority_vote(members)[0]["majority"] == "42"
    assert normalize([{"reward": 3.0}]) == [0.0]
    assert normalize([{"reward": 1.0}, {"reward": 0.0}], scale=False) == [0.5, -0.5]


def test_reward_model_tokenizer_reaches_functions_inline_and_in_workers(user_file):
    import os

    from streamrl.scorers.model import bundled_minilm_dir

    specs = {ex: ScorerSpec(type="function", path=f"{user_file}:count_tokens", executor=ex)
             for ex in ("inline", "process")}
    with pytest.raises(ConfigError, match="reward_model_tokenizer"):
        _stage(dict(specs))  # required, and none configured: fails at start
    stage = _stage(specs, reward_model_tokenizer=str(bundled_minilm_dir()))
    (_, inline), (_, worker) = _run(stage, lambda: asyncio.gather(
        _score(stage, trajectory(data_source="inline", response="hello world")),
        _score(stage, trajectory(data_source="process", response="hello world"))))
    assert inline["tokens"] == worker["tokens"] == 4  # [CLS] hello world [SEP]
    assert inline["pid"] == os.getpid() != worker["pid"]
