"""Consumer groups that share the work (issue 36): the main job spreads its trajectories over
every partition of ``rollouts`` (a version's groups go round them, each group whole), so every
reward member scores its share; and ``topics.<name>.partitions`` sizes the topics for a group
larger than the specs' 8 partitions."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from streamrl import metrics
from streamrl.bus import Bus, Message, StageLoop, TopicPartition
from streamrl.cli import main as cli
from streamrl.config import BusConfig, ConfigError
from streamrl.pipeline_config import PipelineConfig, load_config
from streamrl.records import ROLLOUTS, Trajectory
from streamrl.reward.stage import RewardStage, same_partition
from streamrl.rollout.worker import prompt_position
from streamrl.runtime import Runtime
from streamrl.testing import memory_bus
from tests.helpers import last_json_line, rewarded_from, trajectory


def _position(partition: int, offset: int) -> Message:
    return Message("streamrl.prompts", partition, offset, 0, b"g", b"{}")


def test_a_prompts_partition_read_in_order_goes_round_every_rollouts_partition():
    """Consecutive prompts of one partition (a worker draining it) cover every partition of
    rollouts in turn, and a prompt read again goes where it went."""
    for partition in range(8):
        placed = [prompt_position(_position(partition, offset)) % 8 for offset in range(16)]
        assert sorted(placed) == sorted(list(range(8)) * 2)
    assert prompt_position(_position(3, 41)) == prompt_position(_position(3, 41))
    assert same_partition(_position(5, 999)) % 8 == 5


def test_a_stage_places_its_outputs_by_spread_and_counts_the_records_it_committed():
    bus = memory_bus(commit_interval_s=0.05)
    n = 32
    stage = f"spread{uuid.uuid4().hex[:6]}"

    async def handle(record: Trajectory, msg: Message):
        return [rewarded_from(record)]

    async def main() -> list:
        async with bus.producer("test") as producer:  # group i on rollouts partition i % 8
            await asyncio.gather(*[await producer.send(trajectory(i), spread=i) for i in range(n)])
        loop = StageLoop(bus, stage=stage, source=ROLLOUTS, group=f"{stage}-group", handle=handle,
                         spread=same_partition)
        task = asyncio.create_task(loop.run())
        while loop.finished < n:
            await asyncio.sleep(0.02)
        loop.stop()
        await task
        return [m for p in range(8) for m in bus.broker.log(TopicPartition(bus.topic("rewarded"), p))]

    out = asyncio.run(main())
    # each output on its input's partition: trajectory g-i was on i % 8
    assert sorted((m.partition, m.key) for m in out) == sorted((i % 8, f"g-{i}".encode()) for i in range(n))
    committed = metrics.BUS_COMMITTED_RECORDS.labels(stage, bus.topic("rollouts"))._value.get()
    assert committed == n



@pytest.mark.e2e
def test_the_main_job_spreads_rollouts_over_every_partition_and_the_reward_members_share_them(bootstrap, tmp_path,
                                                                                              capsys):
    """The main job (``streamrl run``, the embedded default's config) for 12 versions with two
    reward members, as ``bench scale --pipeline`` runs it, then its topics read by partition."""
    rc = cli(["bench", "scale", "--pipeline", "--bootstrap-servers", bootstrap, "--members", "2",
              "--versions", "12", "--out", str(tmp_path),
              "run.warm_start_steps=0"])  # what the policy learns does not matter here
    assert rc == 0
    (row,) = last_json_line(capsys.readouterr().out)["pipeline"]
    assert row["versions"] == 12 and row["records"] >= 12 * 256
    partitions = len(row["per_partition"])
    # every partition of rollouts holds about an even share (main put every trajectory on one of 8)
    assert all(0.5 <= share <= 1.5 for share in row["vs_even"]), row["per_partition"]
    # every version's trajectories span at least half of the partitions
    assert all(span >= partitions / 2 for span in row["version_span"].values()), row["version_span"]
    # a group stays whole on both topics (group-level reward hooks need it)
    assert row["split_groups"] == 0 and row["rewarded_split_groups"] == 0
    assert all(n > 0 for n in row["rewarded_per_partition"]), row["rewarded_per_partition"]
    # each reward member scored 35-65 % of the records, as its commits counted them
    members = row["per_member"]
    assert set(members) == {"reward-0", "reward-1"}
    scored = sum(members.values())
    assert scored >= 0.9 * row["records"]  # the counts the run read last, when the group had committed all
    assert all(0.35 <= n / scored <= 0.65 for n in members.values()), members
    assert _positive(row["seconds_per_version"])
    # the run's status line showed them too
    (log,) = tmp_path.glob("scale-pipeline/*/run.log")
    assert "per member: " in log.read_text() and "reward " in log.read_text().split("per member: ")[-1]


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and x > 0


def _config(bootstrap: str) -> PipelineConfig:
    cfg = PipelineConfig()
    cfg.bus = BusConfig(bootstrap_servers=bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:10]}",
                        commit_interval_s=0.2, session_timeout_ms=4000)
    cfg.reward.group = f"{cfg.bus.topic_prefix}-reward"
    cfg.reward.max_in_flight = 4
    return cfg


def test_a_negative_partition_count_fails_naming_its_field(bootstrap):
    with pytest.raises(ConfigError, match=r"topics\.rollouts\.partitions"):
        load_config("local.yaml", ["topics.rollouts.partitions=-1"])
    cfg = _config(bootstrap)  # set in code, not loaded: the topics are not created either
    cfg.topics.rollouts.partitions = -1
    with pytest.raises(ConfigError, match=r"topics\.rollouts\.partitions"):
        asyncio.run(Runtime(cfg).topics())


def test_sixteen_rollouts_partitions_give_each_of_ten_reward_members_records(bootstrap):
    """``topics.rollouts.partitions=16``: created with 16, and a group of 10 reward members
    (in one process, on the real broker, scoring with the gsm8k rule) all get records."""
    cfg = _config(bootstrap)
    cfg.topics.rollouts.partitions = 16
    states = {s.topic: s for s in asyncio.run(Runtime(cfg).topics())}
    assert states[cfg.bus.topic("rollouts")].partitions == 16 and not states[cfg.bus.topic("rollouts")].drift
    assert states[cfg.bus.topic("prompts")].partitions == 8  # the spec's, unless configured
    n = 160

    async def main() -> list[int]:
        bus = Bus(cfg.bus)
        stop = asyncio.Event()
        members = [RewardStage(cfg, bus) for _ in range(10)]
        tasks = [asyncio.create_task(m.run(stop)) for m in members]
        try:
            # the group settled: every member holds partitions, 16 in all, for a second
            settled_since = None
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                held = [len(m.loop.consumer.assignment()) if m.loop else 0 for m in members]
                if all(held) and sum(held) == 16:
                    settled_since = settled_since or time.monotonic()
                    if time.monotonic() - settled_since >= 1.0:
                        break
                else:
                    settled_since = None
                assert not any(t.done() for t in tasks), [t.exception() for t in tasks if t.done()]
                await asyncio.sleep(0.2)
            assert settled_since is not None, f"the group did not settle: {held}"
            async with bus.producer("test") as producer:  # group i on partition i % 16, as the worker spreads
                await asyncio.gather(*[await producer.send(trajectory(i), spread=i) for i in range(n)])
            deadline = time.monotonic() + 60
            while sum(m.loop.finished for m in members) < n and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            return [m.loop.finished for m in members]
        finally:
            stop.set()
            await asyncio.gather(*tasks, return_exceptions=True)

    finished = asyncio.run(main())
    assert sum(finished) >= n, finished
    assert all(count > 0 for count in finished), finished
