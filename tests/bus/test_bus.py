"""The bus on a real broker: dead letters for every kind of malformed message, records of real
sizes, redelivery after a member dies before committing, a clean shutdown that commits, a group
joined again after its members stopped together, exact
end offsets and ranges for a reader without a group, and the checkpoint's order."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, replace

import orjson
import pytest

from streamrl.bus import Bus, Checkpoint, Reader, StageLoop, TopicPartition
from streamrl.errors import Failure
from streamrl.records import DeadLetter, RecordError, Rewarded, Trajectory
from tests.helpers import read_topic, read_topic_sync, rewarded_from, trajectory, wait_for


async def run_loop_until(loop: StageLoop, finished: int, timeout_s: float = 30.0) -> None:
    task = asyncio.create_task(loop.run())
    deadline = time.monotonic() + timeout_s
    while loop.finished < finished and time.monotonic() < deadline and not task.done():
        await asyncio.sleep(0.05)
    loop.stop()
    await task
    assert loop.finished >= finished, f"finished {loop.finished} of {finished}"


def test_malformed_messages_go_to_dead_letters_and_the_stream_goes_on(bus_config):
    bus_config.max_record_bytes = 200_000  # the consuming side's limit; the writer below allows more
    bus = Bus(bus_config)
    writer = Bus(replace(bus_config, max_record_bytes=16 * 2**20))
    good = [trajectory(full=True, id=f"good-{i}", group_id=f"g{i}") for i in range(6)]
    wrong_types = orjson.loads(good[0].encode())
    wrong_types["policy_version"] = "seven"
    bad = {
        "bad_json": b'{"schema": "streamrl.trajectory/1", ',
        "wrong_schema": orjson.dumps({"hello": "world"}),
        "wrong_types": orjson.dumps(wrong_types),
        "oversize": trajectory(full=True, tokens=20_000, id="too-big").encode(),  # ~240 KB
        "handler_refuses": replace(good[0], id="refused").encode(),
    }

    async def main():
        async with writer.producer("test") as p:
            for i, traj in enumerate(good):
                await p.send_and_wait(traj)
                name = list(bad)[i] if i < len(bad) else None
                if name:
                    await (await p.send_bytes("rollouts", bad[name], key=b"g0"))

        async def handle(traj, msg):
            if traj.id == "refused":
                raise Failure("refused_by_test", "the handler said no")
            return [rewarded_from(traj)]

        loop = StageLoop(bus, stage="test", source="rollouts", group="g",
                         decode=lambda b: Trajectory.decode(b, bus_config.max_record_bytes), handle=handle)
        await run_loop_until(loop, len(good) + len(bad))
        return await read_topic(bus, "rewarded", len(good)), await read_topic(bus, "deadletter", len(bad))

    out, letters = asyncio.run(main())
    assert sorted(Rewarded.decode(m.value).id for m in out) == sorted(t.id for t in good)
    letters = [DeadLetter.decode(m.value) for m in letters]
    by_value = {letter.original_value(): letter for letter in letters}
    assert by_value.keys() == set(bad.values())  # the original bytes, exactly
    reasons = {name: by_value[value].reason for name, value in bad.items()}
    assert reasons == {"bad_json": "bad_json", "wrong_schema": "schema", "wrong_types": "schema",
                       "oversize": "oversize", "handler_refuses": "refused_by_test"}
    assert "policy_version" in by_value[bad["wrong_types"]].detail
    for letter in letters:
        assert letter.stage == "test"
        assert letter.source_topic == bus.topic("rollouts")
        assert letter.source_offset is not None and letter.source_partition is not None


def test_records_of_real_size_travel_and_over_the_limit_fail_fast(bus):
    """A 16-sample group of 32k-token trajectories (~6 MB) is above Kafka's 1 MB default."""
    group = [trajectory(full=True, tokens=32_768, id=f"long-{i}", group_id="big") for i in range(16)]

    async def main():
        async with bus.producer("test") as p:
            futures = [await p.send(t) for t in group]
            await asyncio.gather(*futures)
            too_big = b"x" * (bus.config.max_record_bytes + 1)
            started = time.monotonic()
            with pytest.raises(RecordError) as err:
                await p.send_bytes("rollouts", too_big)
            assert err.value.reason == "oversize" and time.monotonic() - started < 1.0
        return await read_topic(bus, "rollouts", len(group))

    msgs = asyncio.run(main())
    assert sum(len(m.value) for m in msgs) > 5_000_000
    back = {t.id: t for t in (Trajectory.decode(m.value) for m in msgs)}
    for traj in group:
        assert back[traj.id].array("response_logprobs").tobytes() == traj.response_logprobs.tobytes()
    assert len({m.partition for m in msgs}) == 1  # one key, one partition: a group stays together


MEMBER = """
import asyncio, sys
from streamrl.bus import Bus, StageLoop
from streamrl.config import BusConfig
from streamrl.records import Trajectory
cfg = BusConfig(**__import__("json").loads(sys.argv[1]))
taken = 0
async def handle(traj, msg):
    global taken
    taken += 1
    print("taken", taken, flush=True)
    await asyncio.sleep(3600)  # never finishes, so never commits
async def main():
    await StageLoop(Bus(cfg), stage="victim", source="rollouts", group="members",
                    decode=Trajectory.decode, handle=handle).run()
asyncio.run(main())
"""


def test_a_member_killed_before_committing_has_its_records_redelivered(bus_config):
    bus = Bus(bus_config)
    trajs = [trajectory(full=True, id=f"r{i}", group_id=f"g{i}") for i in range(12)]

    async def publish():
        async with bus.producer("test") as p:
            await asyncio.gather(*[await p.send(t) for t in trajs])

    asyncio.run(publish())
    victim = subprocess.Popen([sys.executable, "-c", MEMBER, json.dumps(asdict(bus_config))],
                              stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        deadline = time.monotonic() + 30
        taken = 0
        while taken < len(trajs) and time.monotonic() < deadline:
            line = victim.stdout.readline()
            if line.startswith("taken"):
                taken = int(line.split()[1])
        assert taken == len(trajs), "the first member did not take every record"
    finally:
        victim.send_signal(signal.SIGKILL)
        victim.wait()

    async def survivor():
        async def handle(traj, msg):
            return [rewarded_from(traj)]
        loop = StageLoop(bus, stage="survivor", source="rollouts", group="members",
                         decode=Trajectory.decode, handle=handle)
        await run_loop_until(loop, len(trajs), timeout_s=45)

    asyncio.run(survivor())
    out = read_topic_sync(bus, "rewarded", len(trajs))
    assert sorted(Rewarded.decode(m.value).id for m in out) == sorted(t.id for t in trajs)


def test_a_clean_stop_commits_so_nothing_is_redelivered(bus):
    trajs = [trajectory(full=True, id=f"c{i}", group_id=f"g{i}") for i in range(8)]
    seen: list[str] = []

    async def handle(traj, msg):
        seen.append(traj.id)
        return [rewarded_from(traj)]

    async def main():
        async with bus.producer("test") as p:
            await asyncio.gather(*[await p.send(t) for t in trajs])
        first = StageLoop(bus, stage="s", source="rollouts", group="once", decode=Trajectory.decode, handle=handle)
        await run_loop_until(first, len(trajs))
        second = StageLoop(bus, stage="s", source="rollouts", group="once", decode=Trajectory.decode, handle=handle)
        task = asyncio.create_task(second.run())
        # joined (waited for, not slept through), then fetched: nothing left to take
        await wait_for(lambda: second.consumer.assignment(), 30, "the second loop to join")
        await asyncio.sleep(2)
        second.stop()
        await task

    asyncio.run(main())
    assert sorted(seen) == sorted(t.id for t in trajs)


def test_a_group_whose_members_stop_together_is_joined_again(bus):
    """Issue 43: the group's leader stopping while the group rebalances (two members stopped
    together, the leader last) left the embedded broker naming that gone member as the leader of
    every later join, so no member ever got a partition again and the records behind the
    committed offsets were never read. A later member must take them."""
    first = [trajectory(full=True, id=f"a{i}", group_id=f"g{i}") for i in range(16)]
    later = [trajectory(full=True, id=f"b{i}", group_id=f"h{i}") for i in range(16)]
    seen: list[str] = []

    async def handle(traj, msg):
        seen.append(traj.id)
        return [rewarded_from(traj)]

    def member() -> StageLoop:
        return StageLoop(bus, stage="s", source="rollouts", group="together", decode=Trajectory.decode,
                         handle=handle)

    async def main():
        async with bus.producer("test") as p:
            await asyncio.gather(*[await p.send(t) for t in first])
        leader, other = member(), member()  # the first to join leads the group
        tasks = [asyncio.create_task(leader.run())]
        await wait_for(lambda: leader.consumer.assignment(), 30, "the leader to join")
        tasks.append(asyncio.create_task(other.run()))
        await wait_for(lambda: other.consumer.assignment() and len(leader.consumer.assignment()) < 8
                       and len(seen) >= len(first), 45, "both members to share the partitions")
        for loop in (other, leader):  # the leader stops while the group rebalances after the other
            loop.stop()
            await asyncio.sleep(0.2)
        await asyncio.gather(*tasks)
        async with bus.producer("test") as p:
            await asyncio.gather(*[await p.send(t) for t in later])
        await run_loop_until(member(), len(later), timeout_s=60)

    asyncio.run(main())
    assert sorted(set(seen)) == sorted(t.id for t in first + later)


async def produce_batches(bus: Bus, sizes: list[int]) -> None:
    """Records on one partition (one key), in separate produce batches of ``sizes``."""
    async with bus.producer("test") as p:
        n = 0
        for size in sizes:
            acks = []
            for _ in range(size):
                acks.append(await p.send(trajectory(full=True, id=f"b{n}", group_id="one")))
                n += 1
            await asyncio.gather(*acks)


def test_reader_end_offsets_are_exact_and_ranges_read_exactly(bus):
    """Batches of 5, 5, 5, 1, 1, 5 on one partition: the log end is 22 (the embedded broker
    lists 18, the last batch's first offset + 1; the reader corrects it). Ranges read exactly
    their offsets, and the reader follows on from where a range stopped."""
    async def main():
        await produce_batches(bus, [5, 5, 5, 1, 1, 5])
        async with Reader(bus, ["rollouts"], "test") as reader:
            ends = await reader.end_offsets()
            [tp] = [tp for tp, end in ends.items() if end]
            assert isinstance(tp, TopicPartition) and len(ends) == len(reader.partitions)
            everything = [m async for batch in reader.read() for m in batch]
            middle = [m async for batch in reader.read({tp: 3}, {tp: 12}) for m in batch]
            last = [m async for batch in reader.read({tp: 21}, {tp: 22}) for m in batch]
            async with bus.producer("test") as p:
                await p.send_and_wait(trajectory(full=True, id="after", group_id="one"))
            followed = []
            deadline = time.monotonic() + 10
            while not followed and time.monotonic() < deadline:
                followed = await reader.fetch(timeout_ms=200)
        return ends[tp], everything, middle, last, followed

    end, everything, middle, last, followed = asyncio.run(main())
    assert end == 22
    assert [m.offset for m in everything] == list(range(22))
    assert [m.offset for m in middle] == list(range(3, 12))
    assert [Trajectory.decode(m.value).id for m in last] == ["b21"]
    assert [(m.offset, Trajectory.decode(m.value).id) for m in followed] == [(22, "after")]


def test_checkpoint_flushes_then_saves_then_commits(bus):
    """What ``save`` sees: every output in Kafka, and the offsets not yet committed; after
    ``commit``, the group has them. The rebalance callback speaks streamrl's partitions."""
    trajs = [trajectory(full=True, id=f"k{i}", group_id=f"g{i}") for i in range(6)]

    async def main():
        async with bus.producer("test") as p:
            await asyncio.gather(*[await p.send(t) for t in trajs])
        assigned: list[set] = []
        consumer = bus.consumer(["rollouts"], "ckpt", "test", on_assigned=assigned.append)
        producer = bus.producer("test")
        await producer.start()
        await consumer.start()
        seen = {}
        try:
            got = []
            deadline = time.monotonic() + 30
            while len(got) < len(trajs) and time.monotonic() < deadline:
                got += await consumer.getmany(timeout_ms=200)
            checkpoint = Checkpoint(consumer, producer)
            for msg in got:
                tp = TopicPartition(msg.topic, msg.partition)
                checkpoint.take(tp, msg.offset, msg.timestamp)
                out = rewarded_from(Trajectory.decode(msg.value))
                checkpoint.done_when_acked(await producer.send(out), tp, msg.offset)
            parts = sorted({TopicPartition(m.topic, m.partition) for m in got})

            async def save(positions):
                seen["positions"] = positions
                async with Reader(bus, ["rewarded"], "test") as reader:
                    seen["outputs"] = sum((await reader.end_offsets()).values())
                async with bus.admin() as admin:
                    seen["committed_at_save"] = await admin.committed("ckpt", parts)

            assert await checkpoint.commit(save=save)
            async with bus.admin() as admin:
                seen["committed_after"] = await admin.committed("ckpt", parts)
        finally:
            await consumer.stop()
            await producer.stop()
        return got, assigned, seen

    got, assigned, seen = asyncio.run(main())
    want = {}
    for m in got:
        tp = TopicPartition(m.topic, m.partition)
        want[tp] = max(want.get(tp, 0), m.offset + 1)
    assert seen["outputs"] == len(trajs)  # flushed before the state was saved
    assert seen["positions"] == want
    assert set(seen["committed_at_save"].values()) == {None}  # saved before committed
    assert seen["committed_after"] == want
    assert assigned and all(type(tp) is TopicPartition for tps in assigned for tp in tps)
