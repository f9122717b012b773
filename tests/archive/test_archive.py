"""The topic archive (``streamrl.archive``): Parquet files through fsspec that replay reads with
no broker. Records round-trip exactly (token arrays included), the stage
dead-letters what its schema cannot hold and goes on, and a SIGKILLed archive stage loses
nothing (readers drop the duplicates a restart may write). The schema drift is the stage's
logic (``run_stage`` on the in-memory bus); the kill is about Kafka's commits (real broker)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pytest

from streamrl.archive import store
from streamrl.archive.stage import STAGE, ArchiveStage
from streamrl.bus import Bus
from streamrl.pipeline_config import PipelineConfig
from streamrl.records import DeadLetter, Rewarded, Trajectory, as_plain
from streamrl.replay.sources import Range, parse_bound, read_archive
from streamrl.testing import run_stage
from tests.helpers import ROOT, committed, last_json_line, wait_for_sync



def records(n: int, seed: int = 0) -> list[Rewarded]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ids = rng.integers(-2**31, 2**31 - 1, size=int(rng.integers(1, 50)), dtype=np.int64).astype(np.int32)
        logprobs = rng.standard_normal(len(ids)).astype(np.float32) * np.float32(1e-30 if i % 3 == 0 else 3)
        out.append(Rewarded(
            group_id=f"g{i // 2}", group_size=2, policy_version=i % 3, data_source="gsm8k" if i % 2 else "math",
            prompt=[{"role": "user", "content": f"q{i} ünïcode"}], response=f"r{i}", ground_truth=str(i),
            extra_info={"index": i, "nested": {"x": [1, 2.5, None]}}, prompt_ids=ids[:3],
            response_ids=ids, response_logprobs=logprobs, response_mask=(ids % 2).astype(np.uint8),
            reward=float(np.float32(i / 7)), reward_info={"rule": 1.0}, scorer={"name": "gsm8k", "version": "1"}))
    return out


@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_uri_round_trips_records_and_their_arrays_exactly(tmp_path, scheme):
    uri = f"memory://archive-{uuid.uuid4().hex}" if scheme == "memory" else f"file://{tmp_path}/archive"
    recs = records(12)
    letter = DeadLetter.for_message(stage="reward", reason="schema", detail="bad", topic="streamrl.rollouts",
                                    partition=1, offset=7, key=b"k", value=b"\x00\xffraw", record_id="x")
    batch, dead = store.Batch("rewarded"), store.Batch("deadletter")
    for i, rec in enumerate(recs):
        batch.add(store.to_row("rewarded", i % 2, i, 1_700_000_000_000 + i, rec.encode()), 0.0)
    dead.add(store.to_row("deadletter", 0, 3, 1_700_000_000_000, letter.encode()), 0.0)
    writer = store.Writer(uri)
    writer.write("rewarded", batch.table())
    writer.write("deadletter", dead.table())

    [table] = store.read_tables(uri, "rewarded")
    # the filter columns are real, typed columns; the arrays Arrow lists of their own dtype
    assert table.schema.field("policy_version").type == pa.int64()
    assert table.schema.field("reward").type == pa.float32()
    assert table.schema.field("response_ids").type == pa.list_(pa.int32())
    assert table.schema.field("response_logprobs").type == pa.list_(pa.float32())
    assert table.column("data_source").to_pylist() == [r.data_source for r in recs]
    for i, rec in enumerate(recs):
        back = Rewarded.from_dict(store.record_dict(table, i))
        assert as_plain(back) == as_plain(rec)
        for name in ("prompt_ids", "response_ids", "response_logprobs", "response_mask"):
            assert back.array(name).tobytes() == rec.array(name).tobytes()  # bit for bit
    [dtable] = store.read_tables(uri, "deadletter")
    assert dtable.column("reason").to_pylist() == ["schema"] and dtable.column("stage").to_pylist() == ["reward"]
    assert DeadLetter.from_dict(store.record_dict(dtable, 0)).original_value() == b"\x00\xffraw"

    read = read_archive(uri, "rewarded", Range((parse_bound("version:1"),), (parse_bound("version:1"),)),
                        keep_arrays=True)
    assert sorted(loc.record.id for loc in read.records) == sorted(r.id for r in recs if r.policy_version == 1)


def test_a_file_is_complete_or_absent(tmp_path):
    """A half-written local file has a hidden name that readers skip."""
    (tmp_path / "rewarded").mkdir()
    (tmp_path / "rewarded" / ".part-x.parquet.tmp").write_bytes(b"PAR1 half")
    assert store.files(str(tmp_path), "rewarded") == [] and not store.is_archive(str(tmp_path))


def stage_config(bus_config, uri: str, **archive) -> PipelineConfig:
    cfg = PipelineConfig(bus=bus_config)
    cfg.archive.uri = uri
    cfg.archive.roll_seconds = 0.3
    cfg.archive.drain_timeout_s = 10
    for k, v in archive.items():
        setattr(cfg.archive, k, v)
    return cfg.archive.validate() and cfg


def test_schema_drift_goes_to_dead_letters_and_the_stage_goes_on(memory_bus, tmp_path):
    good = records(4, seed=1)
    drifted = orjson.dumps({**good[0].to_dict(), "id": "drift", "policy_version": "v7"})  # a producer on a newer schema
    drifted2 = orjson.dumps({**good[0].to_dict(), "id": "drift2", "reward": {"score": 1.0}})

    stage = ArchiveStage(stage_config(memory_bus.config, str(tmp_path), topics=["rewarded"]))
    inputs = [good[0], ("rewarded", b"g", drifted), ("rewarded", b"g", drifted2), *good[1:]]
    out = run_stage(stage, inputs, until=lambda _: stage.written["rewarded"] >= len(good), timeout_s=60)
    read = read_archive(str(tmp_path), "rewarded")
    assert sorted(loc.record.id for loc in read.records) == sorted(r.id for r in good)  # went on past it
    decoded = sorted(out["deadletter"], key=lambda d: d.source_offset)
    assert [(d.stage, d.reason) for d in decoded] == [("archive", "archive_schema")] * 2
    assert "policy_version" in decoded[0].detail and "reward" in decoded[1].detail
    assert decoded[0].original_value() == drifted  # the original bytes, nothing lost
    assert stage.dead_letters == 2


def start_archive(bus_config, uri: str, log: Path, commit_interval_s: float) -> subprocess.Popen:
    """``streamrl archive`` as compose and ``streamrl run`` start it, rolling files every 0.3 s."""
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "streamrl", "archive", "--bootstrap-servers", bus_config.bootstrap_servers,
             f"bus.topic_prefix={bus_config.topic_prefix}", f"bus.commit_interval_s={commit_interval_s}",
             f"--uri={uri}", "archive.roll_seconds=0.3", "archive.drain_timeout_s=10"],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_archive_stage_killed_mid_run_loses_nothing(bus_config, tmp_path):
    bus, uri, log = Bus(bus_config), str(tmp_path / "archive"), tmp_path / "archive.log"
    rollouts = [Trajectory(**{k: v for k, v in as_plain(r).items() if k in Trajectory.__dataclass_fields__
                              and k != "schema"}) for r in records(30, seed=2)]
    first, second = records(40, seed=3), records(40, seed=4)

    async def publish(topic, recs):
        async with bus.producer("test") as producer:
            await producer.send_all(recs)

    asyncio.run(publish("rollouts", rollouts))
    asyncio.run(publish("rewarded", first))
    # The first run never commits on its clock (files roll every 0.3 s), so the kill leaves files
    # whose records are not committed; the restart commits often.
    proc = start_archive(bus_config, uri, log, commit_interval_s=3600)
    try:
        wait_for_sync(lambda: store.files(uri, "rewarded"), 60, f"no file written: {log.read_text()[-2000:]}")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        at_kill = asyncio.run(committed(bus, bus.config.group(STAGE)))
        uncommitted = [loc for loc in read_archive(uri, "rewarded").records if loc.offset >= (at_kill[loc.partition] or 0)]
        asyncio.run(publish("rewarded", second))
        proc = start_archive(bus_config, uri, log, commit_interval_s=0.5)

        def complete() -> bool:
            ids = {loc.record.id for loc in read_archive(uri, "rewarded").records}
            return ids >= {r.id for r in first + second}
        wait_for_sync(complete, 90, f"records missing: {log.read_text()[-2000:]}")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    read = read_archive(uri, "rewarded")
    assert sorted(loc.record.id for loc in read.records) == sorted(r.id for r in first + second)
    assert uncommitted, f"the kill left nothing uncommitted: {at_kill}"
    assert read.duplicates == len(uncommitted)  # the restart re-read exactly what was not committed
    assert read.messages == len(first) + len(second) + read.duplicates
    assert {loc.record.id for loc in read_archive(uri, "rollouts").records} == {r.id for r in rollouts}
    assert "archive: group" in log.read_text()  # the start-up banner, as every stage prints it


@pytest.mark.e2e
def test_run_archives_every_rewarded_record_and_replay_reads_it_with_no_broker(bootstrap, tmp_path):
    """``streamrl run`` (on the test broker, to compare with its topic after), then replay from
    its archive with no broker: every rewarded record once, re-scored as the run scored it."""
    from streamrl.config import BusConfig
    from streamrl.replay.sources import read_range

    prefix = f"t{uuid.uuid4().hex[:10]}"
    run = subprocess.run(
        [sys.executable, "-m", "streamrl", "run", "configs/local.yaml", "--bootstrap-servers", bootstrap,
         f"bus.topic_prefix={prefix}", f"run.out_dir={tmp_path / 'runs'}", "run.reward_members=1",
         "feed.limit=48", "learner.versions=1"],
        cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = last_json_line(run.stdout)
    archive = summary["archive"]
    assert archive == str(Path(summary["out"]) / "archive") and f"archive {archive}" in run.stderr
    on_topic = asyncio.run(read_range(Bus(BusConfig(bootstrap_servers=bootstrap, topic_prefix=prefix)), "rewarded"))
    assert len(on_topic.records) == summary["records"]["rewarded"] > 0

    archived = read_archive(archive, "rewarded")
    assert [loc.record.id for loc in archived.records] == [loc.record.id for loc in on_topic.records]
    [scorer] = {loc.record.scorer["name"] for loc in archived.records}  # whatever the run scored with
    env = {k: v for k, v in os.environ.items() if k != "STREAMRL_BOOTSTRAP_SERVERS"}
    env["PYTHONPATH"] = str(ROOT)
    replay = subprocess.run(
        [sys.executable, "-m", "streamrl", "replay", "--archive", archive, "--scorer", scorer,
         "--out", str(tmp_path / "replay"), "--no-progress"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert replay.returncode == 0, replay.stderr[-3000:]
    report = orjson.loads(Path(replay.stdout.strip().splitlines()[-1]).read_bytes())
    assert report["records"] == len(on_topic.records) and report["failed"] == 0
    assert report["agreement"] == 1.0 and report["mean_new"] == pytest.approx(report["mean_old"], abs=1e-6)

    # inside the run directory, with nothing running: the run's archive, named, and what it holds
    here = subprocess.run([sys.executable, "-m", "streamrl", "replay"], cwd=summary["out"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert here.returncode == 0, here.stderr[-3000:]
    assert "reading the archive archive" in here.stderr
    inventory = last_json_line(here.stdout)
    assert inventory["records"] == len(on_topic.records)
    assert sum(v["n"] for v in inventory["by_version"].values()) == len(on_topic.records)


def test_replay_without_a_scorer_reports_what_a_topic_or_an_archive_holds(bus_config, tmp_path):
    bus, uri = Bus(bus_config), str(tmp_path / "archive")
    recs = records(9, seed=5)
    letter = DeadLetter.for_message(stage="reward", reason="timeout", detail="", topic=None, partition=None,
                                    offset=None, key=None, value=b"{}")

    async def publish():
        async with bus.producer("test") as producer:
            await producer.send_all(recs + recs[:2])  # two redelivered: counted once
            await producer.send_and_wait(letter)
        stage = ArchiveStage(stage_config(bus_config, uri, topics=["rewarded", "deadletter"]))
        stop = asyncio.Event()
        task = asyncio.create_task(stage.run(stop))
        while stage.written["rewarded"] < len(recs) + 2 or not stage.written["deadletter"]:
            await asyncio.sleep(0.2)
        stop.set()
        await task

    asyncio.run(asyncio.wait_for(publish(), 60))
    env = {k: v for k, v in os.environ.items() if k != "STREAMRL_BOOTSTRAP_SERVERS"}
    env["PYTHONPATH"] = str(ROOT)
    base = [sys.executable, "-m", "streamrl", "replay"]
    from_topic = subprocess.run([*base, "--bootstrap-servers", bus_config.bootstrap_servers,
                                 f"bus.topic_prefix={bus_config.topic_prefix}"],
                                cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env)
    from_archive = subprocess.run([*base, "--archive", uri], cwd=tmp_path, capture_output=True, text=True,
                                  timeout=120, env=env)
    want_versions = {str(v): sum(r.policy_version == v for r in recs) for v in (0, 1, 2)}
    for proc in (from_topic, from_archive):
        assert proc.returncode == 0, proc.stderr[-2000:]
        inv = last_json_line(proc.stdout)
        assert inv["records"] == len(recs) and inv["duplicates"] == 2
        assert {v: s["n"] for v, s in inv["by_version"].items()} == want_versions
        assert inv["by_data_source"]["math"]["mean_reward"] == pytest.approx(
            np.mean([r.reward for r in recs if r.data_source == "math"]))
        assert inv["dead_letters"] == {"reward: timeout": 1}
        assert "policy_version" in proc.stderr and "reward: timeout" in proc.stderr  # the tables

    here = subprocess.run(base, cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env)
    assert here.returncode == 0 and "reading the archive archive" in here.stderr  # ./archive, named
    (tmp_path / "empty").mkdir()
    nothing = subprocess.run(base, cwd=tmp_path / "empty", capture_output=True, text=True, timeout=60, env=env)
    assert nothing.returncode == 2 and "no broker and no archive: pass --archive" in nothing.stderr


RELEASE = """
import sys
import orjson
from streamrl.archive import store
from streamrl.archive.stage import release_free_memory
from tests.archive.test_archive import records

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

base = [r.encode() for r in records(64)]
warm = store.Batch("rewarded")  # the first file loads Arrow's writer: not a batch's memory
warm.add(store.to_row("rewarded", 0, 0, 1_700_000_000_000, base[0]), 0.0)
store.Writer(sys.argv[1]).write("rewarded", warm.table())
release_free_memory()
before = rss()
batch, pins = store.Batch("rewarded"), []
for i in range(8_000):
    value = orjson.dumps({**orjson.loads(base[i % 64]), "id": f"r{i}", "extra_info": {"pad": "x" * 2000}})
    batch.add(store.to_row("rewarded", 0, i, 1_700_000_000_000 + i, value), 0.0)
    if i % 50 == 0:
        pins.append(bytearray(600))  # what a stage allocates from glibc meanwhile and keeps
peak = rss()
store.Writer(sys.argv[1]).write("rewarded", batch.table())
del batch, value
held = rss()
release_free_memory()
print(before, peak, held, rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator and /proc: Linux")
def test_a_written_batchs_memory_goes_back_to_the_system(tmp_path):
    """Issue 68: the archive stage's resident memory followed the largest batch it ever held
    (+40 MB per 1,000 versions of the main job, its Python objects flat): glibc keeps freed
    memory in its arenas while anything allocated after it lives on. After a file is written the
    stage hands the free pages back (``release_free_memory``): a batch of ~50 MB, with small
    objects kept alive among its rows, leaves at most a fifth of it resident."""
    out = subprocess.run([sys.executable, "-c", RELEASE, str(tmp_path / "archive")], cwd=ROOT, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-2000:]
    before, peak, held, after = map(float, out.stdout.split())
    burst = peak - before
    assert burst > 30, (before, peak, held, after)
    assert held - before > burst / 2, (before, peak, held, after)  # glibc kept it: what the stage saw
    assert after - before < burst / 5, (before, peak, held, after)
