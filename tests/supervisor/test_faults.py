"""Faults while ``streamrl run`` runs, on the real broker: stages SIGKILLed in turn are restarted
and the run still reaches every version with nothing lost; a stage SIGSTOPped (hung: it neither
exits nor answers) is killed after ``run.stage_timeout_s`` and restarted, its partitions taken
by its group meanwhile; a scorer that always fails on a third of the records does not freeze the
run (the staleness gate gets those slots back)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from streamrl.bus import Bus
from streamrl.config import BusConfig
from streamrl.records import DeadLetter, PolicyVersion, Rewarded, Trajectory
from tests.helpers import (ROOT, alive, freeze_stage, gsm8k_run_config, kill_stage, read_topic_sync, run_summary,
                           start_run, status_gaps, wait_for_version)

pytestmark = pytest.mark.e2e

#: a small, quick pipeline: 8 groups of 4 per version, one reward member at the start
SMALL = ["feed.limit=400", "feed.group_size=4", "learner.groups_per_mini_batch=8",
         "rollout.trajectories_per_version=32", "rollout.max_new_tokens=6", "run.reward_members=2",
         "learner.group_timeout_s=5", "learner.allow_partial_groups=true", "run.restart.backoff_s=0.5",
         "run.timeout_s=400"]


def run(tmp_path: Path, bootstrap: str, prefix: str, *overrides: str) -> subprocess.Popen:
    return start_run(*gsm8k_run_config(), "--bootstrap-servers", bootstrap, f"run.out_dir={tmp_path}",
                     f"bus.topic_prefix={prefix}", f"learner.consumer_group={prefix}-learner",
                     f"reward.group={prefix}-reward", *SMALL, *overrides, env={"PYTHONUNBUFFERED": "1"})


def drain_reward(bootstrap: str, prefix: str, cfg: BusConfig, timeout_s: float = 120) -> None:
    """One more reward member until the group has scored everything: what the run left
    unscored at its end (uncommitted, so nothing lost) is scored now."""
    member = subprocess.Popen(
        [sys.executable, "-m", "streamrl", "reward", "--bootstrap-servers", bootstrap,
         f"bus.topic_prefix={prefix}", f"reward.group={prefix}-reward"], cwd=ROOT,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            rollouts = {Trajectory.decode(m.value).id for m in read_topic_sync(Bus(cfg), "rollouts")}
            done = {Rewarded.decode(m.value).id for m in read_topic_sync(Bus(cfg), "rewarded")}
            done |= {DeadLetter.decode(m.value, 2**26).record_id for m in read_topic_sync(Bus(cfg), "deadletter")}
            if rollouts <= done:
                return
            time.sleep(2)
    finally:
        member.send_signal(signal.SIGTERM)
        member.wait(60)


def test_chaos_stages_killed_in_turn_are_restarted_and_nothing_is_lost(tmp_path, bootstrap):
    prefix = f"chaos{uuid.uuid4().hex[:6]}"
    cfg = BusConfig(bootstrap_servers=bootstrap, topic_prefix=prefix)
    proc = run(tmp_path, bootstrap, prefix, "learner.versions=20")
    killed = []

    def kill_in_turn() -> None:
        # each kill once the stage has run a while (and its predecessor's restart is up)
        for verb, after_s in (("reward", 12), ("rollout", 8), ("learner", 8)):
            deadline = time.monotonic() + after_s
            while time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.5)
            assert proc.poll() is None, f"the run ended before the {verb} kill: make it longer"
            kill_stage(proc, verb)
            killed.append(verb)

    summary, _, err = run_summary(proc, 400, kill_in_turn)
    assert summary["ended"] == "done" and summary["versions"] == 20, summary
    assert summary["restarts"] >= 3 and killed == ["reward", "rollout", "learner"]
    assert "restarted" in err
    # policy versions never go back
    versions = [PolicyVersion.decode(m.value).version for m in read_topic_sync(Bus(cfg), "policy")]
    assert all(b >= a for a, b in zip(versions, versions[1:])), versions
    assert versions[-1] == 20
    # every trajectory ends rewarded or dead-lettered: nothing was lost by the kills
    drain_reward(bootstrap, prefix, cfg)
    rollouts = {Trajectory.decode(m.value).id for m in read_topic_sync(Bus(cfg), "rollouts")}
    rewarded = {Rewarded.decode(m.value).id for m in read_topic_sync(Bus(cfg), "rewarded")}
    dead = {DeadLetter.decode(m.value, 2**26).record_id for m in read_topic_sync(Bus(cfg), "deadletter")}
    assert rollouts and not rollouts - rewarded - dead


@pytest.mark.timeout(600)  # a run of 10 versions with a restart, beside the suite's others on 2 cores
def test_a_stage_sigstopped_past_the_timeout_is_killed_and_restarted_and_nothing_is_lost(tmp_path, bootstrap):
    prefix = f"frozen{uuid.uuid4().hex[:6]}"
    cfg = BusConfig(bootstrap_servers=bootstrap, topic_prefix=prefix)
    timeout_s = 8
    proc = run(tmp_path, bootstrap, prefix, "learner.versions=10", f"run.stage_timeout_s={timeout_s}")
    frozen: list[int] = []

    def freeze() -> None:
        wait_for_version(tmp_path, 2, proc)
        frozen.append(freeze_stage(proc, "reward"))
        frozen.append(time.monotonic())

    try:
        summary, out, err = run_summary(proc, 400, freeze)
    finally:
        for pid in frozen[:1]:  # never left stopped, whatever failed
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert summary["ended"] == "done" and summary["versions"] == 10, summary
    assert not alive(frozen[0]), "the frozen stage was not killed"
    # one set of events for the restart: the silence and the restart, each once
    silent = [line for line in err.splitlines() if line.startswith("reward-") and "did not answer for" in line]
    assert len(silent) == 1 and silent[0].endswith("(run.stage_timeout_s), killed; restarting in 0.5 s"), err[-3000:]
    member = silent[0].split(":")[0]
    assert err.count(f"{member}: restarted (1 so far)") == 1 and summary["restarts"] == 1, err[-3000:]
    # the status line kept its pace while the stage was frozen (every 5 s, off a terminal; the
    # last one comes after the stages stopped)
    gaps = status_gaps(err)[:-1]
    assert gaps and max(gaps) <= timeout_s, gaps
    assert out.strip().splitlines() == [json.dumps(summary)]  # stdout: the summary alone
    # nothing lost: every trajectory rewarded or dead-lettered (what the run left uncommitted is
    # scored now); nothing trained twice: the learner trained each id at most once
    drain_reward(bootstrap, prefix, cfg)
    rollouts = {Trajectory.decode(m.value).id for m in read_topic_sync(Bus(cfg), "rollouts")}
    rewarded = [Rewarded.decode(m.value).id for m in read_topic_sync(Bus(cfg), "rewarded")]
    dead = {DeadLetter.decode(m.value, 2**26).record_id for m in read_topic_sync(Bus(cfg), "deadletter")}
    assert rollouts and not rollouts - set(rewarded) - dead
    assert 0 < summary["records"]["trained"] <= len(set(rewarded))
    r = summary["records"]
    assert r["rollouts"] == r["rewarded"] + r["dead_at_reward"] + r["unscored"], r


FLAKY_SCORER = '''
import zlib

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Fails on a third of the records, for good (deterministic in the response text)."""
    if zlib.crc32(solution_str.encode()) % 3 == 0:
        raise ValueError("this scorer cannot score that")
    return 1.0 if ground_truth in solution_str else 0.0
'''


def test_a_scorer_failing_on_a_third_of_the_records_does_not_freeze_the_run(tmp_path, bootstrap):
    prefix = f"loss{uuid.uuid4().hex[:6]}"
    cfg = BusConfig(bootstrap_servers=bootstrap, topic_prefix=prefix)
    scorer = tmp_path / "flaky.py"
    scorer.write_text(textwrap.dedent(FLAKY_SCORER))
    # groups of 2 with a member lost a third of the time: fewer than half the groups complete, and
    # the learner (no partial groups) drops the others at their timeout. The old gate counted
    # every trajectory ever produced against (version + 2) * 16 and froze at version 0 here.
    proc = run(tmp_path, bootstrap, prefix, "learner.versions=4", "reward.max_attempts=1",
               "feed.group_size=2", "rollout.trajectories_per_version=16", "learner.allow_partial_groups=false",
               "learner.group_timeout_s=3",
               "reward.scorers.gsm8k.data_sources=[]", "reward.scorers.flaky.type=function",
               f"reward.scorers.flaky.path={scorer}:compute_score", "reward.scorers.flaky.data_sources=[gsm8k]")
    summary, _, err = run_summary(proc, 400)
    assert summary["ended"] == "done" and summary["versions"] == 4, summary
    dead = [DeadLetter.decode(m.value, 2**26) for m in read_topic_sync(Bus(cfg), "deadletter")]
    failed = [d for d in dead if d.reason == "scorer_error"]
    dropped = [d for d in dead if d.stage == "learner"]
    rollouts = read_topic_sync(Bus(cfg), "rollouts")
    assert len(rollouts) > (4 + 2) * 16  # past the old gate's bound at the last version
    assert len(failed) >= len(rollouts) // 5 and dropped, (len(failed), len(dropped), len(rollouts))
    assert all(d.original_value_b64 for d in failed)  # the original bytes, for a replay
