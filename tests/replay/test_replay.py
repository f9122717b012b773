"""Replay: every number of the report against a direct computation, bounds by offset, record
time and version, de-duplication, decode and scoring failures, determinism, a production
group's committed offsets left alone, GSM8K reference solutions and a judge that is down, on the
in-memory bus (``memory_bus`` fixture); the command line and publishing to an evaluation topic
on the real broker; and a checkpoint evaluation with the tiny policy."""

from __future__ import annotations

import asyncio
import statistics
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest

from streamrl.bus import Bus, TopicPartition
from streamrl.cli import main as cli
from streamrl.config import ConfigError
from streamrl.pipeline_config import PipelineConfig, load_config
from streamrl.records import Rewarded
from streamrl.replay import BoundError, Range, evaluate_policy, parse_bound, replay_topic, resolve_scorer
from streamrl.reward.config import RewardConfig, ScorerSpec
from streamrl.feed.prompts import gsm8k_ground_truth
from tests.helpers import JudgeServer, committed, gsm8k_path, read_topic, trajectory

T0 = 1_700_000_000.0  # 2023-11-14T22:13:20Z: record times far from the brokers' own timestamps
OLD = [0.0, 1.0, 0.25, 0.75]

# A user scorer: the length of the response / 10, and a refusal for "boom".
SCORER_PY = '''
from streamrl.scorers.base import ScoreError

def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    if solution_str == "boom":
        raise ScoreError("test_refused", "boom is not an answer")
    return {"score": len(solution_str) / 10, "length": len(solution_str)}
'''


def scorer_files(tmp_path: Path) -> tuple[Path, Path]:
    """The user scorer, and a scorer config (reward config format) that routes ``chat`` to it
    and leaves ``gsm8k`` to the built-in rule."""
    py = tmp_path / "length_scorer.py"
    py.write_text(SCORER_PY)
    yaml = tmp_path / "scorers.yaml"
    yaml.write_text(f"reward:\n  max_attempts: 2\n  retry_backoff_s: 0.01\n  scorers:\n"
                    f"    length: {{type: function, path: '{py}:compute_score', executor: inline, "
                    f"data_sources: [chat]}}\n")
    return py, yaml


def make_records() -> list[Rewarded]:
    """15 rewarded records: gsm8k and chat, versions 0-2, old rewards from elsewhere; one the
    user scorer refuses, one no scorer serves, one whose published reward a group hook replaced."""
    out = []
    for i in range(15):
        ds = "gsm8k" if i % 2 == 0 else "chat"
        response = ("#### 7" if i % 4 == 0 else "#### 8") if ds == "gsm8k" else "x" * (i % 7 + 1)
        info: dict[str, Any] = {"status": "ok"}
        reward = OLD[i % 4]
        if i == 12:
            ds, response = "chat", "boom"
        if i == 13:
            ds = "nobody"
        if i == 14:  # normalised by a group hook: the scorer's own reward was 1.0
            info["group"] = {"hook": "normalize", "status": "applied", "raw_reward": 1.0}
            reward = -0.5
        out.append(Rewarded(id=f"r{i:02d}", group_id=f"g{i // 2}", group_size=2, policy_version=i % 3,
                            data_source=ds, prompt="What is 3 + 4?", response=response, ground_truth="7",
                            reward=reward, reward_info=info, scorer={"name": "old", "version": "1"},
                            created_at=T0 + 10 * i - 5, scored_at=T0 + 10 * i))
    return out


DUPLICATED = ("r00", "r03", "r05")


async def publish(bus: Bus, records: list[Rewarded]) -> list[dict[str, Any]]:
    """Records, then three of them again (a redelivery), then two malformed messages; returns
    what landed where: [{"id" or None, "partition", "offset", "bad"}]."""
    producer = bus.producer("test")
    await producer.start()
    landed = []
    try:
        again = [r for r in records if r.id in DUPLICATED]
        for r in records + again:
            md = await producer.send_and_wait(r)
            landed.append({"id": r.id, "partition": md.partition, "offset": md.offset, "bad": None})
        no_reward = records[0].to_dict()
        del no_reward["reward"]
        for bad, value in (("bad_json", b"{not json"), ("schema", orjson.dumps(no_reward))):
            md = await (await producer.send_bytes("rewarded", value, key=b"g0"))
            landed.append({"id": None, "partition": md.partition, "offset": md.offset, "bad": bad})
    finally:
        await producer.stop()
    return landed


# -- the direct computation -----------------------------------------------------------------------

def expected_new(r: Rewarded) -> tuple[float | None, str | None]:
    """(new reward, failure reason) as the scorer config should give them, computed here."""
    if r.data_source == "nobody":
        return None, "unknown_data_source"
    if r.response == "boom":
        return None, "test_refused"
    if r.data_source == "gsm8k":
        return (1.0 if r.response.split()[-1] == r.ground_truth else 0.0), None
    return float(np.float32(len(r.response) / 10)), None


def expected_old(r: Rewarded) -> float:
    group = r.reward_info.get("group")
    return group["raw_reward"] if group else r.reward


def dist(values: list[float]) -> dict[str, Any] | None:
    if not values:
        return None
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {"n": len(values), "mean": statistics.fmean(values), "std": statistics.pstdev(values),
            "min": min(values), "p25": q[0], "median": q[1], "p75": q[2], "max": max(values)}


def summary(pairs: list[tuple[float | None, float | None]]) -> dict[str, Any]:
    """pairs: (old, new) per record, new None where scoring failed."""
    scored = [(o, n) for o, n in pairs if n is not None]
    both = [(o, n) for o, n in scored if o is not None]
    old, new = [o for o, _ in both], [n for _, n in scored]
    confusion = agreement = pearson = None
    if both:
        confusion = {"old1_new1": sum(o >= 0.5 and n >= 0.5 for o, n in both),
                     "old1_new0": sum(o >= 0.5 and n < 0.5 for o, n in both),
                     "old0_new1": sum(o < 0.5 and n >= 0.5 for o, n in both),
                     "old0_new0": sum(o < 0.5 and n < 0.5 for o, n in both)}
        agreement = (confusion["old1_new1"] + confusion["old0_new0"]) / len(both)
        if len(both) > 1 and len(set(old)) > 1 and len(set(n for _, n in both)) > 1:
            pearson = statistics.correlation(old, [n for _, n in both])
    return {"scored": len(scored), "compared": len(both),
            "mean_old": statistics.fmean(old) if old else None,
            "mean_new": statistics.fmean(new) if new else None,
            "agreement": agreement, "pearson": pearson, "confusion": confusion,
            "old": dist(old), "new": dist(new)}


def hist(pairs: list[tuple[float | None, float | None]], edges: list[float]) -> dict[str, Any]:
    scored = [(o, n) for o, n in pairs if n is not None]
    old = [o for o, _ in scored if o is not None]
    new = [n for _, n in scored]
    lo, hi = min(old + new), max(old + new)
    assert edges == pytest.approx(list(np.linspace(lo, hi, 11)))

    def count(values: list[float]) -> list[int]:
        counts = [0] * 10
        for v in values:
            i = next(i for i in range(10) if edges[i] <= v < edges[i + 1] or (i == 9 and v == edges[10]))
            counts[i] += 1
        return counts

    return {"edges": edges, "old": count(old) if old else None, "new": count(new)}


def expected_report(records: list[Rewarded], landed: list[dict[str, Any]], edges: list[float],
                    in_range: set[str] | None = None, window: set[tuple[int, int]] | None = None) -> dict[str, Any]:
    """The report for the messages in ``window`` ((partition, offset); None: all) whose record
    is in ``in_range`` (None: all)."""
    by_id = {r.id: r for r in records}
    msgs = [m for m in landed if window is None or (m["partition"], m["offset"]) in window]
    good = [m for m in msgs if m["bad"] is None]
    kept = [m for m in good if in_range is None or m["id"] in in_range]
    ids = sorted({m["id"] for m in kept})
    pairs = {i: (expected_old(by_id[i]), expected_new(by_id[i])[0]) for i in ids}
    decode_failures = sorted((m for m in msgs if m["bad"]), key=lambda m: (m["partition"], m["offset"]))
    first = {}
    for m in sorted(kept, key=lambda m: (m["partition"], m["offset"])):
        first.setdefault(m["id"], m)
    score_failures = [(i, expected_new(by_id[i])[1]) for i in ids if expected_new(by_id[i])[1]]
    failures = [{"stage": "decode", "reason": m["bad"], "partition": m["partition"], "offset": m["offset"],
                 "id": None} for m in decode_failures]
    failures += [{"stage": "score", "reason": reason, "partition": first[i]["partition"],
                  "offset": first[i]["offset"], "id": i} for i, reason in score_failures]
    reasons = sorted({f["reason"] for f in failures})

    def grouped(key) -> dict[str, Any]:
        keys = sorted({key(by_id[i]) for i in ids})
        return {str(k): {"records": sum(key(by_id[i]) == k for i in ids),
                         **summary([pairs[i] for i in ids if key(by_id[i]) == k])} for k in keys}

    return {"mode": "topic", "threshold": 0.5, "messages": len(msgs), "skipped": len(good) - len(kept),
            "duplicates": len(kept) - len(ids), "records": len(ids), "failed": len(failures),
            "failed_by_reason": {r: sum(f["reason"] == r for f in failures) for r in reasons},
            **summary(list(pairs.values())), "histogram": hist(list(pairs.values()), edges),
            "by_data_source": grouped(lambda r: r.data_source),
            "by_version": grouped(lambda r: r.policy_version), "failures": failures}


def assert_matches(got: Any, want: Any, where: str = "report") -> None:
    """``got`` equals ``want``; floats to 1e-12 relative; ``detail`` of failures only non-empty."""
    if isinstance(want, dict):
        assert isinstance(got, dict), where
        extra = set(got) - set(want) - {"detail"}
        assert not extra, f"{where}: unexpected keys {extra}"
        for k, v in want.items():
            assert k in got, f"{where}: missing {k}"
            assert_matches(got[k], v, f"{where}.{k}")
        if "detail" in got:
            assert got["detail"], f"{where}: empty detail"
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {got} != {want}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_matches(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-12, abs=1e-12), f"{where}: {got} != {want}"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def config(bus: Bus, *overrides: str) -> PipelineConfig:
    cfg = load_config(None, overrides)
    cfg.bus = bus.config
    return cfg


async def commit(bus: Bus, group: str, offsets: dict[int, int]) -> None:
    consumer = bus.consumer(["rewarded"], group, "test")
    await consumer.start(subscribe=False)
    try:
        name = bus.topic("rewarded")
        consumer.assign([TopicPartition(name, p) for p in range(8)])
        assert await consumer.commit({TopicPartition(name, p): o for p, o in offsets.items()})
    finally:
        await consumer.stop()


# -- tests -----------------------------------------------------------------------------------------

def test_replay_report_matches_direct_computation(memory_bus: Bus, tmp_path: Path) -> None:
    bus = memory_bus
    records = make_records()
    _, yaml = scorer_files(tmp_path)
    cfg = config(bus)

    async def scenario() -> tuple[list[dict[str, Any]], dict[int, int | None], dict[int, int | None], list[Path]]:
        landed = await publish(bus, records)
        # a production group that has read part of the topic
        used = sorted({m["partition"] for m in landed})
        await commit(bus, "production", {p: 1 for p in used})
        before = await committed(bus, "production")
        paths = [await replay_topic(cfg, topic="rewarded", scorer=str(yaml), out=tmp_path / f"run{k}",
                                    progress=False) for k in (1, 2)]
        return landed, before, await committed(bus, "production"), paths

    landed, before, after, (first, second) = asyncio.run(scenario())
    report = orjson.loads(first.read_bytes())
    want = expected_report(records, landed, report["histogram"]["edges"])
    assert_matches({k: v for k, v in report.items() if k not in ("source", "scorer", "files")}, want)
    # the numbers this data set was built to produce, as a guard on the computation itself
    assert (report["messages"], report["records"], report["duplicates"], report["failed"]) == (20, 15, 3, 4)
    assert report["failed_by_reason"] == {"bad_json": 1, "schema": 1, "test_refused": 1,
                                          "unknown_data_source": 1}
    assert report["scorer"]["spec"] == str(yaml)
    assert report["scorer"]["entries"].keys() == {"code", "digits", "gsm8k", "length", "math", "math_dapo", "geo3k",
                                                   "search_r1", "prime_math"}
    assert report["source"]["topic"] == bus.topic("rewarded") and report["source"]["from"] == []
    assert report["source"]["partitions"] == {
        str(p): [0, sum(m["partition"] == p for m in landed)] for p in range(8)}
    # the old reward of the record a group hook normalised is the scorer's own (1.0), not -0.5
    rows = [orjson.loads(line) for line in (first.parent / "results.jsonl").read_bytes().splitlines()]
    assert [r["id"] for r in rows] == [f"r{i:02d}" for i in range(15)]
    assert rows[14]["old_reward"] == 1.0 and rows[1]["reward_info"]["length"] == 2
    assert rows[12]["new_reward"] is None and rows[12]["reward_info"]["error"] == "test_refused"
    # the same replay gives the same report and results, byte for byte
    assert first.read_bytes() == second.read_bytes()
    assert (first.parent / "results.jsonl").read_bytes() == (second.parent / "results.jsonl").read_bytes()
    md = (first.parent / "report.md").read_text()
    assert "| 20 | 0 | 3 | 15 | 13 | 4 |" in md and "test_refused" in md
    assert (first.parent / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the production group's offsets did not move
    assert before == after and {p: o for p, o in after.items() if o is not None} == {
        p: 1 for p in {m["partition"] for m in landed}}


def test_replay_bounds_by_record_time_version_and_offset(memory_bus: Bus, tmp_path: Path) -> None:
    bus = memory_bus
    records = make_records()
    _, yaml = scorer_files(tmp_path)
    cfg = config(bus)

    async def scenario() -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
        landed = await publish(bus, records)
        runs = {
            # the records' own scored_at, 30 s to 80 s after T0 (ISO and unix seconds)
            "time": Range((parse_bound("time:2023-11-14T22:13:50Z"),), (parse_bound(f"time:{T0 + 80}"),)),
            "version": Range((parse_bound("version:1"),), (parse_bound("version:1"),)),
            "offset": Range((parse_bound("offset:1"),), (parse_bound("offset:1"),)),
            "all": Range((parse_bound("version:0"), parse_bound("time:0")), (parse_bound("version:2"),)),
        }
        reports = {}
        for name, bounds in runs.items():
            path = await replay_topic(cfg, topic="rewarded", scorer=str(yaml), out=tmp_path / name,
                                      bounds=bounds, progress=False)
            reports[name] = orjson.loads(path.read_bytes())
        return landed, reports

    landed, reports = asyncio.run(scenario())
    cases = {
        "time": ({r.id for r in records if T0 + 30 <= r.scored_at <= T0 + 80}, None),
        "version": ({r.id for r in records if r.policy_version == 1}, None),
        "offset": (None, {(m["partition"], m["offset"]) for m in landed if m["offset"] == 1}),
        "all": (None, None),
    }
    for name, (in_range, window) in cases.items():
        report = reports[name]
        want = expected_report(records, landed, report["histogram"]["edges"], in_range, window)
        assert_matches({k: v for k, v in report.items() if k not in ("source", "scorer", "files")}, want, name)
    assert sorted(reports["time"]["by_version"]) == ["0", "1", "2"]
    assert reports["time"]["records"] == 6 and reports["time"]["skipped"] == 10
    assert reports["version"]["by_version"].keys() == {"1"}
    assert reports["time"]["source"]["from"] == ["time:2023-11-14T22:13:50+00:00"]
    assert reports["all"]["source"]["to"] == ["version:2"]
    assert all(b - a <= 1 for a, b in reports["offset"]["source"]["partitions"].values())


def test_replay_gsm8k_reference_solutions_agree_with_their_answers(memory_bus: Bus, tmp_path: Path) -> None:
    bus = memory_bus
    rows = [orjson.loads(line) for line in gsm8k_path("test").read_bytes().splitlines()[:300]]
    records = [Rewarded(id=f"test-{i:04d}", group_id=f"test-{i:04d}", group_size=1, policy_version=0,
                        data_source="gsm8k", prompt=row["question"], response=row["answer"],
                        ground_truth=gsm8k_ground_truth(row["answer"]), reward=1.0,
                        scorer={"name": "reference", "version": "1"}) for i, row in enumerate(rows)]

    async def scenario() -> Path:
        producer = bus.producer("test")
        await producer.start()
        try:
            await asyncio.gather(*[await producer.send(r) for r in records])
        finally:
            await producer.stop()
        return await replay_topic(config(bus), topic="rewarded", scorer="gsm8k", out=tmp_path, progress=False)

    report = orjson.loads(asyncio.run(scenario()).read_bytes())
    assert (report["records"], report["scored"], report["failed"]) == (300, 300, 0)
    assert report["mean_new"] == 1.0 and report["agreement"] == 1.0
    assert report["confusion"] == {"old1_new1": 300, "old1_new0": 0, "old0_new1": 0, "old0_new0": 0}
    results = [orjson.loads(line) for line in (tmp_path / "results.jsonl").read_bytes().splitlines()]
    truth = {r.id: r.ground_truth for r in records}
    for r in results:  # the scorer read each solution's own final answer
        assert Fraction(r["reward_info"]["pred"]) == Fraction(truth[r["id"]])


def test_cli_replay_publishes_to_an_evaluation_topic(bus: Bus, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    records = make_records()
    py, _ = scorer_files(tmp_path)
    landed = asyncio.run(publish(bus, records))
    base = ["replay", "--bootstrap-servers", bus.config.bootstrap_servers, "--no-progress",
            f"bus.topic_prefix={bus.config.topic_prefix}", "reward.max_attempts=1", "metrics.host=127.0.0.1"]
    rc = cli([*base, "--topic", "rewarded", "--scorer", f"{py}:compute_score", "--from", "version:1",
              "--out", str(tmp_path / "out"), "--publish-topic", "rescored", "--format", "parquet"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and out[0].startswith("metrics: http://127.0.0.1:")
    path = Path(out[-1])
    assert path == tmp_path / "out" / "report.json"
    report = orjson.loads(path.read_bytes())
    # one function scores every record, whatever its data_source (r13's "nobody" included);
    # "boom" (r12) is version 0, so only the malformed messages fail
    kept = sorted(r.id for r in records if r.policy_version >= 1)
    assert "r13" in kept and "r12" not in kept
    assert report["scorer"]["entries"] == {"compute_score": "0"}
    assert report["records"] == len(kept) and report["failed_by_reason"] == {"bad_json": 1, "schema": 1}
    by_id = {r.id: r for r in records}
    new = {i: float(np.float32(len(by_id[i].response) / 10)) for i in kept if by_id[i].response != "boom"}
    assert report["mean_new"] == pytest.approx(statistics.fmean(new.values()), rel=1e-12)
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "out" / "results.parquet").to_pylist()
    assert [r["id"] for r in table] == kept
    # the evaluation topic has every re-scored record, with the new reward and where it came from
    msgs = asyncio.run(read_topic(bus, "rescored", len(new), timeout_s=20))
    published = {m.id: m for m in (Rewarded.decode(msg.value) for msg in msgs)}
    assert published.keys() == new.keys()
    for i, rec in published.items():
        assert rec.reward == new[i] and rec.scorer == {"name": "compute_score", "version": "0"}
        assert rec.reward_info["replay"]["old_reward"] == expected_old(by_id[i])
        assert rec.reward_info["replay"]["topic"] == bus.topic("rewarded")
        first = min((m for m in landed if m["id"] == i), key=lambda m: (m["partition"], m["offset"]))
        assert rec.reward_info["replay"]["offset"] == first["offset"]
    # bad input: a clear message, exit status 2
    for args, message in (
            (["--scorer", "gsm8k", "--from", "offset:x"], "not a whole number"),
            (["--scorer", "gsm8k", "--to", "when:3"], "expected offset:N"),
            (["--scorer", "nosuch"], "not a built-in scorer"),
            (["--scorer", "gsm8k", "--topic", "nosuch"], "does not exist"),
            (["--scorer", "gsm8k", "--publish-topic", "rewarded"], "is a pipeline topic")):
        assert cli([*base, "--out", str(tmp_path / "bad"), *args]) == 2
        assert message in capsys.readouterr().err
    # the full Kafka name replays the same topic as the short one
    assert cli([*base, "--topic", bus.topic("rewarded"), "--scorer", f"{py}:compute_score", "--from", "version:1",
                "--out", str(tmp_path / "full")]) == 0
    full = orjson.loads((tmp_path / "full" / "report.json").read_bytes())
    assert bus.topic("rewarded").count(".") == 1 and full["records"] == report["records"] == len(kept)
    assert full["mean_new"] == report["mean_new"]


def test_replay_of_trajectories_has_only_new_rewards(memory_bus: Bus, tmp_path: Path) -> None:
    """The rollouts topic carries trajectories: no old reward, so only the new side is reported."""
    bus = memory_bus
    trajectories = [trajectory(id=f"t{i}", group_id="g", group_size=3, policy_version=2, prompt="q",
                               response=f"#### {i}", ground_truth="1", response_ids=[1, 2, 3])
                    for i in range(3)]

    async def scenario() -> Path:
        producer = bus.producer("test")
        await producer.start()
        for t in trajectories:
            await producer.send_and_wait(t)
        await producer.stop()
        return await replay_topic(config(bus), topic="rollouts", scorer="gsm8k", out=tmp_path, progress=False)

    report = orjson.loads(asyncio.run(scenario()).read_bytes())
    assert (report["records"], report["scored"], report["compared"]) == (3, 3, 0)
    assert report["mean_new"] == pytest.approx(1 / 3) and report["mean_old"] is None
    assert report["old"] is None and report["confusion"] is None and report["agreement"] is None
    assert report["by_version"]["2"]["new"]["max"] == 1.0


def test_replay_with_a_judge_holds_while_it_is_down(memory_bus: Bus, tmp_path: Path) -> None:
    """A judge entry of the config re-scores rule-scored records through the stage's router and
    retries; while the judge is down the replay waits (never a 0), then finishes."""
    bus = memory_bus
    records = [r for r in make_records() if r.data_source == "gsm8k"]

    async def scenario() -> tuple[dict[str, Any], JudgeServer]:
        judge = JudgeServer(reply=lambda text: "Score: 9" if "answer:\n#### 7\n" in text else "Score: 1")
        judge.failing = True  # down until the test brings it back
        await judge.start()
        try:
            cfg = config(bus, "reward.retry_backoff_s=0.01", "reward.unavailable_backoff_max_s=0.1")
            cfg.reward.scorers["judge"] = ScorerSpec(type="judge", judge={
                "urls": [judge.url], "model": "judge", "timeout_s": 2.0, "max_retries": 1,
                "backoff_s": 0.01, "backoff_max_s": 0.02, "health_interval_s": 0.1})
            producer = bus.producer("test")
            await producer.start()
            for r in records:
                await producer.send_and_wait(r)
            await producer.stop()
            task = asyncio.create_task(replay_topic(cfg, topic="rewarded", scorer="judge", out=tmp_path,
                                                    progress=False))
            await asyncio.sleep(1.5)
            assert not task.done() and len(judge.chats) > 0  # held, not scored
            judge.failing = False
            path = await asyncio.wait_for(task, 30)
            return orjson.loads(path.read_bytes()), judge
        finally:
            await judge.stop()

    report, judge = asyncio.run(scenario())
    want = {r.id: float(np.float32(0.9 if r.response == "#### 7" else 0.1)) for r in records}
    results = [orjson.loads(line) for line in (tmp_path / "results.jsonl").read_bytes().splitlines()]
    assert {r["id"]: r["new_reward"] for r in results} == want
    assert all(r["reward_info"]["judge_score_raw"] in (1.0, 9.0) for r in results)
    assert report["failed"] == 0 and report["scorer"]["entries"] == {"judge": report["scorer"]["entries"]["judge"]}
    pairs = [(r.reward if "group" not in r.reward_info else 1.0, want[r.id]) for r in records]
    assert report["agreement"] == sum((o >= 0.5) == (n >= 0.5) for o, n in pairs) / len(pairs)


def test_bounds_and_scorer_specs_are_checked() -> None:
    assert parse_bound("time:2023-11-14T22:13:20") == parse_bound(f"time:{T0}") == parse_bound("time:1700000000")
    assert parse_bound("offset:5").value == 5 and parse_bound("version:0").kind == "version"
    for bad in ("offset:-1", "offsets:1", "time:yesterday", "version:1.5", "offset:"):
        with pytest.raises(BoundError):
            parse_bound(bad)
    with pytest.raises(ConfigError, match="no such file"):
        resolve_scorer("missing.yaml", RewardConfig())
    choice = resolve_scorer("math", RewardConfig())
    assert choice.entry == "math" and list(choice.reward.scorers) == ["math"]


def test_generate_evaluates_the_tiny_policy_on_held_out_prompts(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_bytes(b"\n".join(gsm8k_path("test").read_bytes().splitlines()[:3]) + b"\n")
    overrides = ["rollout.max_new_tokens=6", "rollout.temperature=0"]
    path = asyncio.run(evaluate_policy(load_config(None, overrides), policy="tiny", prompts=str(prompts),
                                       scorer="gsm8k", out=tmp_path / "a", samples=2, policy_version=4,
                                       progress=False))
    report = orjson.loads(path.read_bytes())
    from streamrl.scorers.gsm8k import compute_score

    rows = [orjson.loads(line) for line in (tmp_path / "a" / "results.jsonl").read_bytes().splitlines()]
    assert len(rows) == 6 and (report["records"], report["scored"], report["failed"]) == (6, 6, 0)
    answers = [gsm8k_ground_truth(orjson.loads(line)["answer"]) for line in prompts.read_bytes().splitlines()]
    assert sorted({r["ground_truth"] for r in rows}) == sorted(set(answers))
    new = [compute_score("gsm8k", r["response"], r["ground_truth"])["score"] for r in rows]
    assert [r["new_reward"] for r in rows] == new and all(r["response"] for r in rows)
    assert report["mean_new"] == pytest.approx(statistics.fmean(new), rel=1e-12)
    assert report["new"]["n"] == 6 and report["old"] is None and report["histogram"]["old"] is None
    assert report["mean_old"] is None and report["compared"] == 0 and report["agreement"] is None
    assert report["by_version"].keys() == {"4"} and report["by_data_source"]["gsm8k"]["records"] == 6
    assert report["source"]["prompt_count"] == 3 and report["messages"] is None
    # the command line, no broker needed; greedy decoding: the same evaluation, the same report
    monkeypatch.delenv("STREAMRL_BOOTSTRAP_SERVERS", raising=False)
    rc = cli(["replay", "--generate", "--policy", "tiny", "--prompts", str(prompts), "--scorer", "gsm8k",
              "--samples", "2", "--policy-version", "4", "--out", str(tmp_path / "b"), "--no-progress",
              "metrics.host=127.0.0.1", *overrides])
    assert rc == 0
    assert orjson.loads(Path(capsys.readouterr().out.strip().splitlines()[-1]).read_bytes()) == report
