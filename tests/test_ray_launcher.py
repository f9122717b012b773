"""`streamrl run --launcher ray` places stages as Ray actors; here a local Ray with CPU workers
runs real reward-stage processes, and the autoscaler grows the reward group when lag grows and
shrinks it when the lag is gone."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import ray

from streamrl.bus import Bus
from streamrl.ray_launcher import RayLauncher
from streamrl.records import Rewarded
from streamrl.launching import LagAutoscaler
from streamrl.observing import Observer, resize_reward_group
from tests.helpers import read_topic
from tests.test_records import make_trajectory

SLOW_SCORER = '''
import asyncio
async def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    await asyncio.sleep(0.05)  # a slow remote scorer: each member does ~40 records/s
    return 1.0
'''


def test_ray_launcher_runs_the_reward_group_and_autoscales_it(bus_config, tmp_path: Path):
    (tmp_path / "slow.py").write_text(SLOW_SCORER)
    config = tmp_path / "reward.yaml"
    config.write_text(
        "reward:\n"
        "  max_in_flight: 2\n"
        "  scorers:\n"
        f"    slow: {{type: function, path: '{tmp_path / 'slow.py'}:compute_score', data_sources: [slow]}}\n")
    argv = ["reward", "--bootstrap-servers", bus_config.bootstrap_servers, "--config", str(config),
            f"bus.topic_prefix={bus_config.topic_prefix}", "bus.commit_interval_s=0.2", "metrics.port=0"]
    bus = Bus(bus_config)
    n = 600
    launcher = RayLauncher(tmp_path / "logs", num_cpus=4)
    scaler = LagAutoscaler(min_members=1, max_members=2, scale_up_lag=50, scale_down_lag=0,
                           window_s=2.0, cooldown_s=4.0)
    sizes: list[int] = []
    counter = iter(range(100))

    def start_reward() -> None:
        launcher.start(f"reward-{next(counter)}", argv, "reward")

    async def main() -> list:
        async with bus.producer("test") as p:
            await asyncio.gather(*[await p.send("rollouts", make_trajectory(id=f"t{i}", group_id=f"g{i}", data_source="slow"))
                                   for i in range(n)])
        observer = Observer(bus, reward_group="streamrl-reward")
        await observer.start()
        start_reward()
        deadline = time.monotonic() + 150
        try:
            while time.monotonic() < deadline:
                await observer.poll(timeout_ms=500)
                await resize_reward_group(observer, launcher, scaler, start_reward, time.monotonic(),
                                          show=lambda line: None)
                live = [x for x in launcher.names() if x.startswith("reward-") and launcher.returncode(x) is None]
                sizes.append(len(live))
                if max(sizes) == 2 and sizes[-1] == 1 and await observer.reward_lag() == 0:
                    break
        finally:
            await observer.stop()
        return await read_topic(bus, "rewarded", n, timeout_s=30)

    try:
        out = asyncio.run(main())
    finally:
        launcher.stop_all()
        ray.shutdown()
    assert max(sizes) == 2, "the autoscaler never added a member while lag grew"
    assert sizes[-1] == 1, "the autoscaler did not remove the member once the lag was gone"
    assert {Rewarded.decode(m.value).id for m in out} == {f"t{i}" for i in range(n)}  # nothing lost
