"""The reward stage: its logic on the in-memory bus (``streamrl.testing.run_stage``, or the
``memory_bus`` fixture where the test acts while it runs): a mixed stream where every record
reaches ``rewarded`` or dead letters with a reason, the group hook on complete, partial and
incomplete groups, an unavailable scorer held with back-pressure. On the real broker: two group
members (separate processes) sharing the partitions, one killed with SIGKILL mid-stream, losing
nothing."""

from __future__ import annotations

import asyncio
import math
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import orjson
import pytest

from streamrl import metrics
from streamrl.pipeline_config import PipelineConfig
from streamrl.reward.config import ScorerSpec
from streamrl.reward.stage import RewardStage
from streamrl.testing import run_stage
from tests.helpers import ROOT, Collector, produce, trajectory


USER_SCORERS = '''
import asyncio, math, os
from streamrl.scorers.base import ScoreError

def boom(data_source, solution_str, ground_truth, extra_info=None):
    raise ScoreError("boom", "this scorer always fails")

def nan(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": math.nan}

async def down_while_flagged(data_source, solution_str, ground_truth, extra_info=None):
    from streamrl.scorers.base import ScorerUnavailable
    if os.path.exists(extra_info["flag"]):
        raise ScorerUnavailable("judge down")
    return 1.0

async def slow_exact(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    await asyncio.sleep(0.05)
    return {"score": float(solution_str == ground_truth), "pid": os.getpid()}
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "stage_scorers.py"
    path.write_text(textwrap.dedent(USER_SCORERS))
    return path


def _pipeline(bus_config, **reward) -> PipelineConfig:
    cfg = PipelineConfig()
    cfg.bus = bus_config
    cfg.reward.group = f"reward-{bus_config.topic_prefix}"
    cfg.reward.retry_backoff_s = 0.01
    cfg.reward.process_workers = 1
    for k, v in reward.items():
        setattr(cfg.reward, k, v)
    return cfg


def _score_all(stage: RewardStage, records: list, timeout_s: float):
    """Run the stage until every record came out (rewarded or dead-lettered; ``run_stage``
    fails at ``timeout_s`` saying what came out); returns ``(rewarded, dead letters)``."""
    out = run_stage(stage, records, timeout_s=timeout_s,
                    until=lambda o: len(o["rewarded"]) + len(o["deadletter"]) >= len(records))
    return out["rewarded"], out["deadletter"]


def test_mixed_stream_every_record_reaches_rewarded_or_dead_letters(memory_bus, user_file):
    cfg = _pipeline(memory_bus.config)
    cfg.reward.scorers["boom"] = ScorerSpec(type="function", path=f"{user_file}:boom")
    cfg.reward.scorers["nan"] = ScorerSpec(type="function", path=f"{user_file}:nan")
    good_gsm8k = [trajectory(i, response="The answer is $42." if i % 2 else "#### 41", policy_version=3,
                             response_ids=[1, 2, 3], response_logprobs=[-0.5, -0.25, -0.125]) for i in range(6)]
    good_math = [trajectory(f"m{i}", data_source="math", response=r, ground_truth="\\frac{1}{2}")
                 for i, r in enumerate(["so $\\boxed{0.5}$", "$\\boxed{\\frac{1}{3}}$"])]
    schema_bad = orjson.loads(trajectory("x").encode())
    del schema_bad["response"]
    records = [*good_gsm8k, *good_math, trajectory("u", data_source="chess"),
               trajectory("b", data_source="boom"), trajectory("n", data_source="nan"),
               ("rollouts", b"k1", b'{"schema": "streamrl.traj'), ("rollouts", b"k2", orjson.dumps(schema_bad))]
    expected_dead = {"t-u": "unknown_data_source", "t-b": "boom", "t-n": "non_finite_reward"}
    stage = RewardStage(cfg)
    scored_before = metrics.REWARD_SCORED.labels("gsm8k", "ok")._value.get()

    rewarded, dead = _score_all(stage, records, 45)
    assert len(rewarded) + len(dead) == len(records)  # none lost, none doubled

    by_id = {r.id: r for r in rewarded}
    assert set(by_id) == {t.id for t in good_gsm8k + good_math}
    for i, t in enumerate(good_gsm8k):
        r = by_id[t.id]
        assert r.reward == (1.0 if i % 2 else 0.0)
        assert r.reward_info == {"status": "ok", "pred": "42" if i % 2 else "41"}
        assert r.scorer == {"name": "gsm8k", "version": "1"}
        assert r.array("response_logprobs").tolist() == [-0.5, -0.25, -0.125]  # forwarded intact
        assert r.policy_version == 3 and r.extra_info == {"i": str(i)}
    assert [by_id["t-m0"].reward, by_id["t-m1"].reward] == [1.0, 0.0]
    assert by_id["t-m0"].scorer["name"] == "math"
    assert all(math.isfinite(r.reward) for r in rewarded)

    reasons = {d.record_id: d.reason for d in dead if d.record_id}
    assert reasons == expected_dead
    undecodable = {d.original_value(): d.reason for d in dead if not d.record_id}
    assert undecodable == {records[-2][2]: "bad_json", records[-1][2]: "schema"}
    assert all(d.stage == "reward" and d.original_value() for d in dead)
    boom = next(d for d in dead if d.record_id == "t-b")
    assert "after 3 attempts" in boom.detail
    assert metrics.REWARD_SCORED.labels("gsm8k", "ok")._value.get() - scored_before == 6


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _member(bus_config, group: str, user_file: Path, port: int) -> subprocess.Popen:
    """``python -m streamrl reward`` as its own process, scoring with a 50 ms async scorer."""
    overrides = [f"metrics.port={port}", "metrics.host=127.0.0.1",
        f"bus.topic_prefix={bus_config.topic_prefix}", "bus.commit_interval_s=0.2",
        "bus.session_timeout_ms=4000", "reward.max_in_flight=4",
        "reward.scorers.slow.type=function", f"reward.scorers.slow.path={user_file}:slow_exact",
    ]
    return subprocess.Popen(
        [sys.executable, "-m", "streamrl", "reward", "--bootstrap-servers",
         bus_config.bootstrap_servers, "--group", group, *overrides],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)})


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def test_two_members_share_partitions_and_a_killed_one_loses_nothing(bus, user_file):
    n = 240
    records = [trajectory(i, data_source="slow", response="x" if i % 3 else "y", ground_truth="x") for i in range(n)]
    group = f"reward-{bus.config.topic_prefix}"
    ports = [_free_port() for _ in range(2)]
    members = [_member(bus.config, group, user_file, port) for port in ports]
    killed_pid = None
    try:
        async def main():
            nonlocal killed_pid
            async with Collector(bus) as out:
                await produce(bus, records)
                pids = lambda: {r.reward_info["pid"] for r in out.rewarded}  # noqa: E731
                # both members are scoring: the partitions are shared
                shared = await out.wait(lambda: len(pids()) == 2, 40)
                assert shared, f"only {pids()} scored ({len(out.rewarded)} records)"
                assert len({r.id for r in out.rewarded}) < n, "the stream finished before the kill"
                victim = next(m for m in members if m.pid in pids())
                victim.send_signal(signal.SIGKILL)
                killed_pid = victim.pid
                at_kill = len(out.rewarded)
                ok = await out.wait(lambda: {r.id for r in out.rewarded} >= {t.id for t in records}, 45)
                port = ports[1 - members.index(victim)]
                text = await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/metrics")
                return ok, at_kill, out.rewarded, out.dead, out.partitions, text

        ok, at_kill, rewarded, dead, partitions, survivor_metrics = asyncio.run(main())
    finally:
        outputs = []
        for m in members:
            if m.poll() is None:
                m.send_signal(signal.SIGTERM)
            try:
                outputs.append(m.communicate(timeout=20)[0])
            except subprocess.TimeoutExpired:
                m.kill()
                outputs.append(m.communicate()[0])
    ids = {r.id for r in rewarded}
    missing = {t.id for t in records} - ids
    assert ok and not missing, f"lost {len(missing)} records; member output:\n" + "\n".join(o[-2000:] for o in outputs)
    assert dead == []
    assert at_kill < n
    survivor = next(m for m in members if m.pid != killed_pid)
    assert survivor.returncode == 0  # SIGTERM: a clean stop
    assert "metrics: http://" in outputs[members.index(survivor)]
    by_id: dict[str, set[float]] = {}
    for r in rewarded:  # duplicates are allowed; they agree
        by_id.setdefault(r.id, set()).add(r.reward)
    assert all(len(v) == 1 for v in by_id.values())
    # the survivor took over the victim's partitions and finished them
    owners: dict[int, set[int]] = {}
    for r in rewarded:
        owners.setdefault(partitions[r.id], set()).add(r.reward_info["pid"])
    assert any(len(pids) == 2 for pids in owners.values()), owners
    # the survivor's Prometheus port: what it scored, and that it now owns every partition
    assert 'streamrl_reward_scored_records_total{scorer="slow",status="ok"}' in survivor_metrics
    assert f'streamrl_reward_partition_share{{group="{group}"}} 1.0' in survivor_metrics
    assert "streamrl_reward_score_seconds_bucket" in survivor_metrics
    assert sum(next(iter(v)) for v in by_id.values()) == len([i for i in range(n) if i % 3])


def test_group_hook_adjusts_complete_groups_and_times_out_incomplete_ones(memory_bus):
    cfg = _pipeline(memory_bus.config)
    cfg.reward.group_hook.function = "normalize"
    cfg.reward.group_hook.timeout_s = 3.0
    full = [trajectory(f"a{i}", group_id="A", group_size=4, response="#### 42" if i < 2 else "#### 7")
            for i in range(4)]
    # one member of B cannot be scored (unknown data source): the rest still complete the group
    partial = [trajectory(f"b{i}", group_id="B", group_size=3, response="#### 42" if i == 0 else "#### 1")
               for i in range(2)] + [trajectory("b2", group_id="B", group_size=3, data_source="chess")]
    # C says 3 samples and only 2 ever come: published unadjusted after the timeout
    incomplete = [trajectory(f"c{i}", group_id="C", group_size=3) for i in range(2)]
    records = full + partial + incomplete
    stage = RewardStage(cfg)

    rewarded, dead = _score_all(stage, records, 30)
    by_id = {r.id: r for r in rewarded}
    assert len(rewarded) == len(records) - 1 and [d.reason for d in dead] == ["unknown_data_source"]

    z = 0.5 / (1 / math.sqrt(3))  # (1 - mean) / sample std for [1, 1, 0, 0]
    for i in range(4):
        r = by_id[f"t-a{i}"]
        assert r.reward == pytest.approx(z if i < 2 else -z, rel=1e-5)
        g = r.reward_info["group"]
        assert (g["status"], g["raw_reward"], g["scored"], g["hook"]) == ("applied", float(i < 2), 4, "normalize")
        assert r.reward_info["status"] == "ok"
    b0, b1 = by_id["t-b0"], by_id["t-b1"]
    assert b0.reward_info["group"]["status"] == "applied" and b0.reward_info["group"]["failed"] == 1
    assert b0.reward == pytest.approx(1 / math.sqrt(2), rel=1e-5) and b1.reward == pytest.approx(-1 / math.sqrt(2), rel=1e-5)
    for i in range(2):
        c = by_id[f"t-c{i}"]
        assert c.reward_info["group"]["status"] == "incomplete" and c.reward == 1.0


def test_an_unavailable_scorer_holds_records_with_back_pressure_and_resumes(memory_bus, user_file, tmp_path):
    bus = memory_bus
    flag = tmp_path / "judge-is-down"
    flag.touch()
    cfg = _pipeline(bus.config, max_in_flight=4, unavailable_backoff_max_s=0.2)
    cfg.reward.scorers["flaky_judge"] = ScorerSpec(type="function", path=f"{user_file}:down_while_flagged")
    records = [trajectory(i, data_source="flaky_judge", extra_info={"flag": str(flag)}) for i in range(20)]
    stage = RewardStage(cfg)

    async def main():
        stop = asyncio.Event()
        run = asyncio.create_task(stage.run(stop))
        async with Collector(bus) as out:
            await produce(bus, records)
            held = await out.wait(lambda: metrics.REWARD_HELD.labels("flaky_judge")._value.get() == 4, 20)
            await asyncio.sleep(1.0)  # a while down: nothing is published, nothing more is taken
            during = (len(out.rewarded), len(out.dead), stage.loop.finished,
                      metrics.BUS_IN_FLIGHT.labels("reward")._value.get())
            flag.unlink()  # the backend is back
            done = await out.wait(lambda: len(out.rewarded) >= len(records), 30)
            stop.set()
            await run
        return held, during, done, out.rewarded, out.dead

    held, during, done, rewarded, dead = asyncio.run(main())
    assert held
    assert during == (0, 0, 0, 4)  # held at max_in_flight; no record scored 0 or dead-lettered
    assert done and dead == []
    assert {r.id for r in rewarded} == {t.id for t in records}
    assert all(r.reward == 1.0 and r.reward_info["status"] == "ok" for r in rewarded)
    assert metrics.REWARD_HELD.labels("flaky_judge")._value.get() == 0
