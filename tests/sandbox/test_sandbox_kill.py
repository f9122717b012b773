"""A reward member and a sandbox member, both SIGKILLed mid-stream on the real broker: the code
records are held while the sandbox is down (never scored 0, never dead-lettered), a new sandbox
and a new reward member finish the stream, and every record is scored once with its right
reward (a record scored again after the member's kill carries the same reward)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from streamrl.net import free_port
from tests.helpers import Collector, binary, produce, stop, trajectory
from tests.sandbox.code_cases import fenced
from tests.sandbox.conftest import start_service

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e

SUM = "n = int(input())\nxs = list(map(int, input().split()))\nprint(sum(xs){})"
TABLE = json.dumps({"inputs": ["2\n1 2\n", "3\n4 5 6\n"], "outputs": ["3\n", "15\n"]})


def member(bus_config, group: str, url: str) -> subprocess.Popen:
    overrides = [f"metrics.port={free_port()}", f"bus.topic_prefix={bus_config.topic_prefix}",
                 "bus.commit_interval_s=0.2", "bus.session_timeout_ms=4000", "reward.max_in_flight=4",
                 "reward.retry_backoff_s=0.2", "reward.unavailable_backoff_max_s=1",
                 f"reward.sandbox_fusion.url={url}/run_code", "reward.sandbox_fusion.max_concurrent=4"]
    return subprocess.Popen([sys.executable, "-m", "streamrl", "reward", "--bootstrap-servers",
                             bus_config.bootstrap_servers, "--group", group, *overrides],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_reward_and_sandbox_members_killed_mid_stream_lose_nothing(bus):
    binary("bwrap")
    n = 24
    records = [trajectory(i, data_source="apps", response=fenced(SUM.format("" if i % 2 else " + 1")),
                          ground_truth=TABLE) for i in range(n)]
    port = free_port()
    group = f"reward-{bus.config.topic_prefix}"
    procs: list[subprocess.Popen] = []
    try:
        sandbox, url = start_service(port=port)
        procs.append(sandbox)
        first = member(bus.config, group, url)
        procs.append(first)

        async def main():
            async with Collector(bus) as out:
                await produce(bus, records)
                assert await out.wait(lambda: len(out.rewarded) >= 4, 90), "nothing scored"
                assert len({r.id for r in out.rewarded}) < n, "the stream finished before the kills"
                sandbox.send_signal(signal.SIGKILL)
                first.send_signal(signal.SIGKILL)
                sandbox.wait()
                first.wait()
                at_kill = len({r.id for r in out.rewarded})
                # a new reward member first: until the new sandbox answers, it holds what it takes
                second = member(bus.config, group, url)
                procs.append(second)
                again, _ = await asyncio.to_thread(start_service, port=port)
                procs.append(again)
                done = await out.wait(lambda: {r.id for r in out.rewarded} >= {t.id for t in records}, 120)
                return done, at_kill, list(out.rewarded), list(out.dead)

        done, at_kill, rewarded, dead = asyncio.run(main())
    finally:
        outputs = []
        for p in procs:
            if p.poll() is None:
                stop(p)
            outputs.append((p.stdout.read() if p.stdout else "")[-1500:])
    assert done, "records lost:\n" + "\n".join(outputs)
    assert dead == []
    assert at_kill < n
    by_id: dict[str, set[float]] = {}
    for r in rewarded:
        by_id.setdefault(r.id, set()).add(r.reward)
    assert all(len(v) == 1 for v in by_id.values()), by_id  # scored again after the kill: the same reward
    assert {i: next(iter(by_id[f"t-{i}"])) for i in range(n)} == {i: float(i % 2) for i in range(n)}
