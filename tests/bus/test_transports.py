"""The two transports keep one contract: every assertion here runs on the real embedded broker
(``bus_config``) and on the in-memory one (``streamrl.testing.memory_bus``), so stage logic
tested on memory means what it means on Kafka. The memory broker's own limits (one member per
group, no rebalancing) are asserted at the end."""

from __future__ import annotations

import asyncio
import time

import pytest

from streamrl import metrics
from streamrl.bus import Bus, Reader, StageLoop, TopicPartition
from streamrl.errors import Failure
from streamrl.bus.lag import ConsumerLag
from streamrl.records import DEADLETTER, REWARDED, ROLLOUTS, Rewarded, Trajectory, topic_of
from streamrl.testing import memory_bus
from tests.helpers import trajectory


@pytest.fixture(params=["kafka", "memory"])
def any_bus(request) -> Bus:
    if request.param == "kafka":
        return Bus(request.getfixturevalue("bus_config"))
    return memory_bus(commit_interval_s=0.2)


async def take(consumer, n: int, timeout_s: float = 30.0) -> list:
    out: list = []
    deadline = time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        out += await consumer.getmany(timeout_ms=200)
    return out


def test_send_consume_commit_resume_seek_pause(any_bus):
    bus = any_bus
    delivered: list[tuple[str, object]] = []
    records = [trajectory(id=f"t{i}", group_id=f"g{i % 3}") for i in range(9)]

    async def main():
        async with bus.producer("test", on_delivery=lambda topic, err: delivered.append((topic, err))) as p:
            acks = await asyncio.gather(*[await p.send(r) for r in records])
        assert delivered == [("rollouts", None)] * 9  # one call per record, after the broker has it
        assert {a.topic for a in acks} == {bus.topic(ROLLOUTS)}
        by_key: dict[str, set[int]] = {}
        for r, a in zip(records, acks):
            by_key.setdefault(r.group_id, set()).add(a.partition)
        assert all(len(parts) == 1 for parts in by_key.values())  # a key stays on its partition

        group = f"{bus.config.topic_prefix}-contract"
        first = await bus.consumer([ROLLOUTS], group, "test").start()
        try:
            got = await take(first, 9)
            assert sorted(ROLLOUTS.decode(m.value).id for m in got) == sorted(r.id for r in records)
            for m in got:
                assert first.highwater(TopicPartition(m.topic, m.partition)) is not None
            # commit a third of it: the group's committed offsets are what a new member resumes from
            keep = sorted(got, key=lambda m: (m.partition, m.offset))[:3]
            offsets: dict[TopicPartition, int] = {}
            for m in keep:
                tp = TopicPartition(m.topic, m.partition)
                offsets[tp] = max(offsets.get(tp, 0), m.offset + 1)
            assert await first.commit(offsets)
        finally:
            await first.stop()
        async with bus.admin() as admin:
            assert await admin.committed(group, list(offsets)) == offsets

        second = await bus.consumer([ROLLOUTS], group, "test").start()
        try:
            rest = await take(second, 6)
            assert {ROLLOUTS.decode(m.value).id for m in rest} == {r.id for r in records} - {
                ROLLOUTS.decode(m.value).id for m in keep}
            tp = TopicPartition(keep[0].topic, keep[0].partition)
            # seek: read a partition again from its start
            second.seek(tp, 0)
            again = await take(second, 1)
            assert again and again[0].offset == 0 and (again[0].topic, again[0].partition) == tp
            assert await second.position(tp) == second.highwater(tp)
            # pause: nothing of a paused partition arrives; resumed, it does
            second.pause([tp])
            async with bus.producer("test") as p:
                await p.send_and_wait(trajectory(id="t100", group_id=keep[0].key.decode()))
            assert second.paused() == {tp}
            assert [m for m in await second.getmany(timeout_ms=500) if (m.topic, m.partition) == tp] == []
            second.resume([tp])
            late = await take(second, 1)
            assert [ROLLOUTS.decode(m.value).id for m in late] == ["t100"]
        finally:
            await second.stop()

    asyncio.run(main())


def test_stage_loop_reader_and_dead_letters(any_bus):
    """A StageLoop (its Checkpoint included) and a Reader run unchanged: outputs go to their
    type's topic, a bad message's original bytes go to dead letters with the reason, the loop
    commits what it finished, and its lag gauges (``bus.lag.ConsumerLag``) say nothing waits."""
    bus = any_bus
    records = [trajectory(id=f"t{i}", group_id=f"g{i}") for i in range(4)]

    async def handle(t: Trajectory, msg):
        if t.id == "t3":
            raise Failure("refused", "the handler says no")
        return [Rewarded.from_trajectory(t, reward=1.0, reward_info={}, scorer={"name": "x"})]

    async def main():
        async with bus.producer("test") as p:
            for r in records:
                await p.send_and_wait(r)
            await (await p.send_bytes(ROLLOUTS, b"{not json", key=b"bad"))
        group = f"{bus.config.topic_prefix}-loop"
        loop = StageLoop(bus, stage="test", source=ROLLOUTS, group=group, handle=handle, on_commit=ConsumerLag())
        task = asyncio.create_task(loop.run())
        deadline = time.monotonic() + 60
        while loop.finished < 5 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        loop.stop()
        await task
        async with Reader(bus, [REWARDED, DEADLETTER], "test") as reader:
            out = [m async for batch in reader.read() for m in batch]
        rewarded = [REWARDED.decode(m.value) for m in out if m.topic == bus.topic(REWARDED)]
        letters = [DEADLETTER.decode(m.value, bus.largest_record) for m in out if m.topic == bus.topic(DEADLETTER)]
        assert sorted(r.id for r in rewarded) == ["t0", "t1", "t2"]
        assert sorted((d.reason, d.record_id) for d in letters) == [("bad_json", None), ("refused", "t3")]
        assert next(d for d in letters if d.reason == "bad_json").original_value() == b"{not json"
        async with Reader(bus, [ROLLOUTS], "test") as reader:
            ends = await reader.end_offsets()
        async with bus.admin() as admin:
            committed = await admin.committed(group, list(ends))
        assert {tp: committed[tp] or 0 for tp in ends} == ends  # everything finished is committed
        read = {tp for tp, end in ends.items() if end}
        assert read and all(metrics.CONSUMER_LAG.labels("test", group, tp.topic, str(tp.partition))._value.get() == 0
                            for tp in read)
        assert metrics.CONSUMER_LAG._metrics.keys() >= {("test", group, tp.topic, str(tp.partition)) for tp in read}

    asyncio.run(main())


def test_topics_route_by_type_and_memory_limits():
    bus = memory_bus()
    assert topic_of(Rewarded(**{**trajectory().__dict__, "schema": "streamrl.rewarded/1"}, reward=0.0)) is REWARDED
    assert topic_of(trajectory()) is ROLLOUTS  # a Rewarded is a Trajectory, routed by exact type

    async def main():
        first = await bus.consumer([ROLLOUTS], "g", "test").start()
        with pytest.raises(RuntimeError, match="one member"):
            await bus.consumer([ROLLOUTS], "g", "test").start()
        await first.stop()
        await (await bus.consumer([ROLLOUTS], "g", "test").start()).stop()  # the group is free again
        with pytest.raises(LookupError, match="nope"):
            async with bus.producer("test") as p:
                await p.send(trajectory(), topic="nope")

    asyncio.run(main())
    with pytest.raises(ValueError, match="bus.bootstrap_servers"):
        Bus(bus.config.__class__(bootstrap_servers="memory://bad name"))
    with pytest.raises(ValueError, match="bus.bootstrap_servers"):
        Bus(bus.config.__class__(bootstrap_servers="kafka://host:9092"))


def test_the_reward_stage_runs_unchanged_on_memory():
    """A stage built from a config whose ``bus`` is a memory bus: no broker, well under a second."""
    from streamrl.pipeline_config import PipelineConfig
    from streamrl.reward.stage import RewardStage

    bus = memory_bus(commit_interval_s=0.1)
    cfg = PipelineConfig()
    cfg.bus, cfg.reward.process_workers = bus.config, 1

    async def main():
        stage = RewardStage(cfg)
        async with bus.producer("test") as p:
            for i in range(4):
                await p.send_and_wait(trajectory(id=f"t{i}", group_id=f"g{i}", response=f"#### {40 + i % 2}",
                                                 ground_truth="40"))
        stop = asyncio.Event()
        task = asyncio.create_task(stage.run(stop))
        deadline = time.monotonic() + 20
        while (stage.loop is None or stage.loop.finished < 4) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        stop.set()
        await task
        async with Reader(bus, [REWARDED], "test") as reader:
            return [REWARDED.decode(m.value) for batch in [b async for b in reader.read()] for m in batch]

    assert sorted((r.id, r.reward) for r in asyncio.run(main())) == [("t0", 1.0), ("t1", 0.0), ("t2", 1.0), ("t3", 0.0)]
