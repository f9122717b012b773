"""What the run's status line and summary say, read from a real broker: records that exist on
``rollouts`` but that the reward group has not consumed are named by group and partition (issue
43: "48 rollouts not scored yet" said the symptom, not where); every dead letter is counted at
the stage that made it, so the summary's identities hold (issue 57)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from streamrl.bus import Bus, TopicPartition
from streamrl.records import DeadLetter, Distilled, PolicyVersion
from streamrl.supervisor.display import summary_line
from streamrl.supervisor.launcher import LocalLauncher
from streamrl.supervisor.observer import Observer, RecentIds
from streamrl.supervisor.watch import diagnose
from tests.helpers import produce, rewarded_from, trajectory


def test_a_stall_names_the_group_and_the_partitions_it_has_not_consumed(bus: Bus, tmp_path):
    trajs = [trajectory(full=True, id=f"s{i}", group_id="one-group") for i in range(6)]  # one key: one partition
    group = bus.config.group("reward", "")

    async def main() -> tuple[list[str], int, int]:
        await produce(bus, trajs)
        consumer = bus.consumer(["rollouts"], group, "test")  # the group scored 2 of them
        await consumer.start()
        try:
            got: list = []
            for _ in range(60):
                got += await consumer.getmany(timeout_ms=1_000, max_records=2 - len(got))
                if len(got) == 2:
                    break
            tp = TopicPartition(got[0].topic, got[0].partition)
            assert await consumer.commit({tp: got[1].offset + 1})
        finally:
            await consumer.stop()
        observer = Observer(bus, reward_group=group)
        await observer.start()
        try:
            obs = await observer.poll()
            _, waits = await diagnose(LocalLauncher(tmp_path), obs, observer)
        finally:
            await observer.stop()
        return waits, tp.partition, got[1].offset + 1

    waits, partition, committed = asyncio.run(main())
    assert waits == [f"reward: 6 rollouts not scored yet; group {group} has not consumed partition(s) "
                     f"{partition} (4 from offset {committed})"], waits


def _letter(bus: Bus, stage: str, reason: str, source: str, record) -> DeadLetter:
    """A dead letter as ``stage`` makes it: the record's bytes and id, the topic it came from (a
    rollout worker's ``stale`` one names ``rollouts``, where the record never went)."""
    return DeadLetter.for_message(stage=stage, reason=reason, detail="", topic=bus.topic(source), partition=None,
                                  offset=None, key=record.key, value=record.encode(), record_id=record.id)


def _observe(bus: Bus, teacher_input: str, **records: list) -> dict:
    async def main() -> dict:
        for topic, batch in records.items():
            await produce(bus, batch, topic=topic)
        observer = Observer(bus, reward_group=bus.config.group("reward", ""), teacher_input=teacher_input)
        await observer.start()
        try:
            for _ in range(20):  # until every dead letter is read
                obs = await observer.poll()
                if sum(obs.deadletters.values()) == len(records["deadletter"]):
                    break
        finally:
            await observer.stop()
        return obs.records()

    return asyncio.run(main())


@pytest.mark.parametrize("teacher", ["", "rewarded"])
def test_every_dead_letter_is_counted_where_it_happened_and_the_identities_hold(bus: Bus, teacher: str):
    """Issue 57: a rollout worker's ``stale`` letters (``rollout.max_span``) were counted as the
    reward group's, the teacher's (source ``rewarded``) as the learner's, and the learner's on
    ``distilled`` nowhere. Each kind made here as its stage makes it, read back from the broker."""
    trajs = [trajectory(i) for i in range(10)]  # t-0..t-9 on rollouts
    stale = trajectory("stale")  # dead-lettered by its rollout worker: never on rollouts
    rewarded = [rewarded_from(t) for t in trajs[:7]]  # t-7 dead at the reward stage; t-8, t-9 unscored
    letters = [_letter(bus, "rollout", "stale", "rollouts", stale),
               _letter(bus, "reward", "scorer_error", "rollouts", trajs[7])]
    records: dict[str, list] = {"rollouts": trajs, "rewarded": rewarded}
    if teacher:  # t-0..t-4 distilled, t-5 dead at the teacher, t-6 undistilled; the learner drops t-4
        distilled = [Distilled.annotate(r, logprobs=np.zeros(1, np.float32), ids=None, topk=0, teacher={})
                     for r in rewarded[:5]]
        records["distilled"] = distilled
        letters += [_letter(bus, "teacher", "teacher_error", "rewarded", rewarded[5]),
                    _letter(bus, "learner", "non_finite", "distilled", distilled[4])]
        trained = 3
    else:  # the learner drops t-6
        letters.append(_letter(bus, "learner", "non_finite", "rewarded", rewarded[6]))
        trained = 4
    records["deadletter"] = letters
    records["policy"] = [PolicyVersion(version=1, trained_records=trained)]
    r = _observe(bus, teacher, **records)
    assert r["rollouts"] == r["rewarded"] + r["dead_at_reward"] + r["unscored"], r
    assert (r["rollouts"], r["rewarded"], r["dead_at_reward"], r["unscored"], r["dead_at_rollout"]) == (10, 7, 1, 2, 1)
    if teacher:
        assert r["rewarded"] == r["distilled"] + r["dead_at_teacher"] + r["undistilled"], r
        assert (r["distilled"], r["dead_at_teacher"], r["undistilled"]) == (5, 1, 1), r
        assert r["distilled"] == r["trained"] + r["dead_at_learner"] + r["untrained"], r
        assert (r["trained"], r["dead_at_learner"], r["untrained"]) == (3, 1, 1), r
    else:
        assert r["rewarded"] == r["trained"] + r["dead_at_learner"] + r["untrained"], r
        assert (r["trained"], r["dead_at_learner"], r["untrained"]) == (4, 1, 2), r
    summary = {"ended": "done", "versions": 1, "reward_first": 1.0, "reward_last": 1.0, "records": r,
               "deadletters": len(letters), "plot": "r.png"}
    line = summary_line(summary)
    assert "10 rollouts = 7 rewarded + 1 dead-lettered + 2 unscored" in line, line
    assert "1 dead-lettered by the rollout workers (rollout.max_span)" in line, line
    assert ("7 rewarded = 5 distilled + 1 dead-lettered + 1 undistilled" in line) == bool(teacher), line


def test_a_long_run_keeps_a_bounded_window_of_ids_and_its_summary_counts_each_record_once(memory_bus: Bus):
    """Issue 68: the supervisor kept every rewarded id it ever read (~28 MB more per 1,000
    versions of the main job). 120 versions of 64 records, 10 s apart on the observer's clock:
    the ids it keeps stay within the window's bounds, not the run's length; a copy sent at once
    (a reward member that restarted) still counts once; read at the end, the ids give the exact
    figures, a copy that came after the window included."""
    clock = [0.0]

    async def main() -> tuple[list[int], int, int, dict]:
        observer = Observer(memory_bus, reward_group=memory_bus.config.group("reward", ""))
        observer.obs.seen_ids = RecentIds(keep_s=60.0, at_least=200, clock=lambda: clock[0])
        await observer.start()
        sizes, first = [], None
        try:
            for v in range(120):
                batch = [trajectory(f"{v}-{i}", group_id=f"g{v}", policy_version=v) for i in range(64)]
                first = first or batch[0]
                scored = [rewarded_from(t) for t in batch] + ([rewarded_from(batch[0])] if v % 10 == 9 else [])
                await produce(memory_bus, batch)
                await produce(memory_bus, scored, topic="rewarded")
                for _ in range(50):
                    if (await observer.poll(timeout_ms=20)).rewarded >= 64 * (v + 1):
                        break
                sizes.append(len(observer.obs.seen_ids))
                clock[0] += 10.0
            await produce(memory_bus, [rewarded_from(first)], topic="rewarded")  # a copy 20 minutes late
            for _ in range(50):
                if (await observer.poll(timeout_ms=20)).rewarded > 64 * 120:
                    break
            live = observer.obs.rewarded
            await observer.read_ids()
            return sizes, live, observer.obs.rewarded, observer.obs.records()
        finally:
            await observer.stop()

    sizes, live, exact, records = asyncio.run(main())
    assert max(sizes) <= 64 * 8, sizes[-10:]  # 60 s of records (and the version being read), not 7,680 ids
    assert sizes[-1] >= 200
    assert live == 64 * 120 + 1  # the twelve copies at once counted once; the late one past the window
    assert exact == 64 * 120  # the summary's count is by every id, read at the end
    assert (records["rollouts"], records["rewarded"], records["unscored"]) == (64 * 120, 64 * 120, 0), records


def test_a_long_distillation_run_keeps_a_bounded_window_of_distilled_ids(memory_bus: Bus):
    """The teacher's side of the window above: the supervisor kept every distilled id it ever read.
    60 versions of 32 records annotated, 10 s apart on the observer's clock: the ids kept stay
    within the window; a copy at once counts once, a copy past the window once more while the run
    goes; read at the end, the ids give the exact ``distilled`` and ``undistilled``."""
    clock = [0.0]

    def annotated(r):
        return Distilled.annotate(r, logprobs=np.zeros(1, np.float32), ids=None, topk=0, teacher={})

    async def main() -> tuple[list[int], int, dict]:
        observer = Observer(memory_bus, reward_group=memory_bus.config.group("reward", ""), teacher_input="rewarded")
        observer.obs.distilled_seen = RecentIds(keep_s=60.0, at_least=100, clock=lambda: clock[0])
        await observer.start()
        sizes: list[int] = []
        try:
            for v in range(60):
                rewarded = [rewarded_from(trajectory(f"{v}-{i}", group_id=f"g{v}", policy_version=v)) for i in range(32)]
                distilled = [annotated(r) for r in rewarded[:31]]  # the last one of each version undistilled
                await produce(memory_bus, [trajectory(f"{v}-{i}") for i in range(32)])
                await produce(memory_bus, rewarded, topic="rewarded")
                await produce(memory_bus, distilled + distilled[:1], topic="distilled")
                for _ in range(50):
                    if (await observer.poll(timeout_ms=20)).distilled >= 31 * (v + 1):
                        break
                sizes.append(len(observer.obs.distilled_seen))
                clock[0] += 10.0
            await produce(memory_bus, [annotated(rewarded_from(trajectory("0-0")))], topic="distilled")  # 10 min late
            for _ in range(50):
                if (await observer.poll(timeout_ms=20)).distilled > 31 * 60:
                    break
            live = observer.obs.distilled
            await observer.read_ids()
            return sizes, live, observer.obs.records()
        finally:
            await observer.stop()

    sizes, live, records = asyncio.run(main())
    assert max(sizes) <= 31 * 8 and sizes[-1] >= 100, sizes[-10:]  # 60 s of records, not 1,860 ids
    assert live == 31 * 60 + 1
    assert (records["rewarded"], records["distilled"], records["undistilled"]) == (32 * 60, 31 * 60, 60), records
