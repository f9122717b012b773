"""The bus on librdkafka (issue 24), on the real broker: keys land on the partitions Java's
default partitioner picks, a revoke that arrives during a slow flush commits only what is in
Kafka (and finishes before the partitions move), and the record size limit is exact: a record
of the configured maximum goes through, one byte more is refused at once with a dead letter
that carries it, and the producer goes on; a lazy pause (the pipeline's regression) loses and
repeats nothing."""

from __future__ import annotations

import asyncio
import threading
import time

from streamrl.bus import Checkpoint, Reader, TopicPartition
from streamrl.records import DeadLetter, RecordError, Rewarded, Trajectory
from tests.helpers import read_topic, rewarded_from, trajectory

#: Kafka's murmur2 (positive hash mod partitions) for these keys on 8 partitions, as Java's
#: default partitioner, kafka-python and aiokafka place them.
KNOWN_8 = {b"g0": 5, b"g1": 6, b"g7": 4, b"abc": 3, b"21": 4, b"group-42": 1}


def test_keys_land_on_the_partitions_of_javas_default_partitioner(bus):
    async def main():
        async with bus.admin() as admin:
            counts = await admin.partition_counts([bus.topic("rewarded")])
        async with bus.producer("test") as p:
            placed = {key: (await (await p.send_bytes("rewarded", b"x", key=key))).partition for key in KNOWN_8}
        return counts, placed

    counts, placed = asyncio.run(main())
    assert counts == {bus.topic("rewarded"): 8}
    assert placed == KNOWN_8


def test_a_revoke_during_a_slow_flush_commits_only_flushed_outputs_before_the_partitions_move(bus):
    """Member A has outputs waiting in its producer (linger 6 s) when member B joins. A's
    revoke callback flushes them, then commits; B, assigned only after that callback returned,
    starts at A's commit and gets nothing again."""
    trajs = [trajectory(full=True, id=f"r{i}", group_id=f"g{i}") for i in range(6)]
    group = bus.config.group("revoke")

    async def main():
        async with bus.producer("test") as p:
            await asyncio.gather(*[await p.send(t) for t in trajs])
        events: list[tuple[str, float]] = []
        slow = await bus.producer("test", **{"linger.ms": 6000}).start()
        a = bus.consumer(["rollouts"], group, "test", on_revoked=lambda tps: revoked(tps))
        checkpoint = Checkpoint(a, slow)

        async def revoked(tps):
            events.append(("revoke", time.monotonic()))
            ok = await checkpoint.commit(tps)
            events.append(("committed" if ok else "refused", time.monotonic()))

        await a.start()
        got = []
        deadline = time.monotonic() + 60
        while len(got) < len(trajs) and time.monotonic() < deadline:
            got += await a.getmany(timeout_ms=200)
        for msg in got:
            tp = TopicPartition(msg.topic, msg.partition)
            checkpoint.take(tp, msg.offset, msg.timestamp)
            ack = await slow.send(rewarded_from(Trajectory.decode(msg.value)))
            ack.add_done_callback(lambda _f: events.append(("acked", time.monotonic())))
            checkpoint.done_when_acked(ack, tp, msg.offset)
        b = bus.consumer(["rollouts"], group, "test")
        await b.start()
        again, b_assigned, b_since = [], False, 0.0
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (b_assigned and time.monotonic() > b_since + 3):
            await a.getmany(timeout_ms=100)  # A serves the rebalance in its consume
            again += await b.getmany(timeout_ms=100)
            if b.assignment() and not b_assigned:
                b_assigned, b_since = True, time.monotonic()
        async with bus.admin() as admin:
            committed = await admin.committed(group, [TopicPartition(bus.topic("rollouts"), p) for p in range(8)])
        outputs = await read_topic(bus, "rewarded", len(trajs))
        await b.stop()
        await a.stop()
        await slow.stop()
        return got, events, again, committed, outputs

    got, events, again, committed, outputs = asyncio.run(main())
    assert len(got) == len(trajs)
    kinds = [k for k, _ in events]
    assert "revoke" in kinds and "committed" in kinds, kinds
    first_revoke = kinds.index("revoke")
    first_commit = kinds.index("committed")
    # the revoke came while every output was still in the producer, and the commit only after all were acked
    assert kinds[:first_revoke] == [] and kinds[first_revoke + 1:first_commit].count("acked") == len(trajs), kinds
    assert events[first_commit][1] - events[first_revoke][1] > 0.5  # it did wait for the slow flush
    want = {}
    for m in got:
        tp = TopicPartition(m.topic, m.partition)
        want[tp] = max(want.get(tp, 0), m.offset + 1)
    assert {tp: off for tp, off in committed.items() if off is not None} == want
    assert sorted(Rewarded.decode(o.value).id for o in outputs) == sorted(t.id for t in trajs)
    assert again == []  # B started at A's commit: the commit was done before the callback returned


def test_a_record_of_the_maximum_size_round_trips_and_one_byte_more_is_dead_lettered(bus):
    limit = bus.config.max_record_bytes
    assert limit == 16 * 1024 * 1024
    biggest = bytes(range(256)) * (limit // 256)
    too_big = biggest + b"!"

    async def main():
        async with bus.producer("test") as p:
            first = await (await p.send_bytes("rollouts", biggest, key=b"big"))
            try:
                await p.send_bytes("rollouts", too_big, key=b"big")
                refused = None
            except RecordError as exc:
                refused = exc
                await (await p.dead_letter(reason=exc.reason, detail=str(exc), value=too_big, key=b"big"))
            after = await (await p.send_bytes("rollouts", b"small", key=b"big"))  # not stuck
        async with Reader(bus, ["rollouts"], "test") as reader:
            ends = await reader.end_offsets()
            back = [m async for batch in reader.read(stop=ends) for m in batch]
        letters = await read_topic(bus, "deadletter", 1)
        return first, refused, after, back, letters

    first, refused, after, back, letters = asyncio.run(main())
    assert refused is not None and refused.reason == "oversize"
    assert f"limit {limit}" in str(refused)
    assert (after.partition, after.offset) == (first.partition, first.offset + 1)
    assert [m.value for m in back] == [biggest, b"small"]
    letter = DeadLetter.decode(letters[0].value, DeadLetter.size_limit(limit))
    assert letter.reason == "oversize" and letter.original_value() == too_big


def test_delivery_reports_are_served_on_the_loop_and_a_raising_on_delivery_strands_none(bus):
    """Reports are served on the event loop's thread (no thread of their own); an
    ``on_delivery`` that raises for one record is logged, and every other record's future and
    ``on_delivery`` still come."""
    told: list[tuple[str, object, bool]] = []

    def on_delivery(topic, error):
        told.append((topic, error, threading.current_thread() is threading.main_thread()))
        if len(told) == 1:
            raise RuntimeError("a caller's bug")

    async def main():
        async with bus.producer("test", on_delivery=on_delivery) as p:
            futures = [await p.send(trajectory(full=True, id=f"d{i}", group_id=f"g{i}")) for i in range(5)]
            return await asyncio.wait_for(asyncio.gather(*futures), 30)

    delivered = asyncio.run(main())
    assert [d.topic for d in delivered] == [bus.topic("rollouts")] * 5
    assert [(topic, error, on_loop) for topic, error, on_loop in told] == [("rollouts", None, True)] * 5


def test_pause_holds_records_in_the_client_then_pauses_librdkafka_and_resume_loses_nothing(bus):
    """``pause`` is lazy (librdkafka drops its prefetch on pause): records of a paused partition
    are held, not handed out; past ``hold_bytes`` librdkafka is paused too; after ``resume``
    every record comes once, in order."""
    part = TopicPartition(bus.topic("rollouts"), 6)  # KNOWN_8: key g1

    async def main():
        async with bus.producer("test") as p:
            for i in range(20):
                await p.send_bytes("rollouts", f"a{i}".encode(), key=b"g1")
        reader = bus.consumer(["rollouts"], None, "test")
        await reader.start(subscribe=False)
        reader.assign([part])
        reader.transport.hold_bytes = 1  # the first records held pause librdkafka too
        reader.pause([part])
        held = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not reader.transport._held:
            held += await reader.getmany(timeout_ms=100)
        paused_in_librdkafka = set(reader.transport._held)
        async with bus.producer("test") as p:
            for i in range(20, 30):
                await p.send_bytes("rollouts", f"a{i}".encode(), key=b"g1")
        reader.resume([part])
        got = []
        deadline = time.monotonic() + 20
        while len(got) < 30 and time.monotonic() < deadline:
            got += await reader.getmany(timeout_ms=200)
        await reader.stop()
        return held, paused_in_librdkafka, got

    held, paused_in_librdkafka, got = asyncio.run(main())
    assert held == []
    assert paused_in_librdkafka == {part}
    assert [m.value for m in got] == [f"a{i}".encode() for i in range(30)]
    assert [m.offset for m in got] == list(range(30))
