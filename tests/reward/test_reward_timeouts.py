"""A scorer that runs past its timeout fails its record alone. ``streamrl reward`` runs as its own
process (so the member's own SIGTERM handling is installed, as in production), on the real
broker, with a user function that sleeps far past its timeout on some records: in worker
processes and in threads, those records are dead-lettered as ``timeout``, the rest are rewarded,
and the member keeps running (a worker killed at its timeout used to stop the whole member)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.helpers import ROOT, Collector, produce, trajectory

SLEEPY = '''
import time

def sleepy(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "sleep":
        time.sleep(60)
    return float(solution_str == ground_truth)
'''


@pytest.mark.parametrize("executor", ["process", "thread"])
def test_a_scorer_past_its_timeout_fails_its_record_and_the_member_goes_on(bus, tmp_path, executor):
    user = tmp_path / "sleepy.py"
    user.write_text(textwrap.dedent(SLEEPY))
    records = [trajectory(i, data_source="sleepy", response="sleep" if i % 4 == 0 else "x", ground_truth="x")
               for i in range(16)]
    member = subprocess.Popen(
        [sys.executable, "-m", "streamrl", "reward", "--bootstrap-servers", bus.config.bootstrap_servers,
         "--group", f"reward-{bus.config.topic_prefix}", f"bus.topic_prefix={bus.config.topic_prefix}",
         "bus.commit_interval_s=0.2", "reward.max_in_flight=8", "reward.max_attempts=2",
         "reward.retry_backoff_s=0.01", "reward.process_workers=2",
         "reward.scorers.sleepy.type=function", f"reward.scorers.sleepy.path={user}:sleepy",
         f"reward.scorers.sleepy.executor={executor}", "reward.scorers.sleepy.timeout_s=1.0"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        async def main():
            async with Collector(bus) as out:
                await produce(bus, records)
                done = await out.wait(lambda: len({r.id for r in out.rewarded} | {d.record_id for d in out.dead})
                                      >= len(records), 60)
                return done, list(out.rewarded), list(out.dead)

        done, rewarded, dead = asyncio.run(main())
        alive = member.poll() is None
    finally:
        if member.poll() is None:
            member.send_signal(signal.SIGTERM)
        try:
            output = member.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            member.kill()
            output = member.communicate()[0]
    assert done, output[-3000:]
    assert alive, f"the member stopped:\n{output[-3000:]}"
    sleepers = {t.id for t in records if t.response == "sleep"}
    assert {d.record_id for d in dead} == sleepers
    assert all(d.reason == "timeout" and "after 2 attempts" in d.detail for d in dead)
    assert {r.id for r in rewarded} == {t.id for t in records} - sleepers
    assert all(r.reward == 1.0 for r in rewarded)
    assert member.returncode == 0  # our SIGTERM: a clean stop
