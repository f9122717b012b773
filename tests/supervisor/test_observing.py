"""What the run's status line says when nothing moves, read from a real broker: records that
exist on ``rollouts`` but that the reward group has not consumed are named by group and
partition (issue 43: "48 rollouts not scored yet" said the symptom, not where)."""

from __future__ import annotations

import asyncio

from streamrl.bus import Bus, TopicPartition
from streamrl.supervisor.launcher import LocalLauncher
from streamrl.supervisor.observer import Observer
from streamrl.supervisor.watch import diagnose
from tests.helpers import produce, trajectory


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
