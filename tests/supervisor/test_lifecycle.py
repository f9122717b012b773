"""A run's life on the real broker, with real processes (issue 31): it ends when its data ends,
with every record accounted for; Ctrl-C or a SIGKILL of everything, then ``--resume``, continues
it without feeding a finished prompt again, also on a broker that outlives both sessions; a fresh run
refuses another run's topics; the
embedded broker dying ends the run quickly and quietly; a rollout worker refusing weights is
named on the status line."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from streamrl import resume
from streamrl.bus import Bus
from streamrl.config import BusConfig
from streamrl.records import DeadLetter, PolicyVersion, Prompt, Rewarded, Trajectory
from tests.helpers import ROOT, alive, descendants, gsm8k_run_config, last_json_line, read_topic_sync

pytestmark = pytest.mark.e2e

#: 16 prompts of 4 samples, 2 groups a version: about 8 versions of data, far fewer than asked
TINY = ["run.reward_members=1", "feed.limit=16", "feed.group_size=4", "learner.groups_per_mini_batch=2",
        "rollout.trajectories_per_version=8", "rollout.max_new_tokens=6", "learner.versions=100",
        "run.restart.backoff_s=0.5", "run.timeout_s=400"]


class Run:
    """``streamrl run`` in its own process group, its stderr lines collected with their times."""

    def __init__(self, out: Path, *args: str):
        self.out = out
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "streamrl", "run", *gsm8k_run_config(), f"run.out_dir={out}", *TINY, *args],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.lines: list[tuple[float, str]] = []
        self.seen: set[int] = set()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, pattern: str, timeout_s: float = 240) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.seen |= descendants(self.proc.pid)
            for _, line in list(self.lines):
                found = re.search(pattern, line)
                if found:
                    return found
            if self.proc.poll() is not None:
                break
            time.sleep(0.3)
        raise AssertionError(f"no {pattern!r} in the run's output:\n" + self.err[-3000:])

    def finish(self, timeout_s: float = 400) -> dict:
        self.proc.wait(timeout_s)
        out = self.proc.stdout.read()
        self._reader.join(10)
        assert out.strip(), f"no summary (rc {self.proc.returncode}):\n{self.err[-4000:]}"
        return last_json_line(out)

    @property
    def err(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def wait_for_version(self, at_least: int, timeout_s: float = 240) -> None:
        """Until the run's learner has checkpointed version ``at_least`` (the status line comes
        only every few seconds: a small run can end between two)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            self.seen |= descendants(self.proc.pid)
            for ckpts in self.out.glob("*/checkpoints"):
                good = resume.latest_good(ckpts)
                if good and good[1].version >= at_least:
                    return
            time.sleep(0.1)
        raise AssertionError(f"version {at_least} not reached:\n" + self.err[-3000:])

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def state_of(run_dir: Path) -> resume.LearnerState:
    good = resume.latest_good(run_dir / "checkpoints")
    assert good is not None, f"no readable checkpoint in {run_dir}"
    return good[1]


def published(run_dir: Path) -> int:
    """Prompts the feed published in its last session (its log says)."""
    counts = re.findall(r"feed: published (\d+) prompts", (run_dir / "logs" / "feed.log").read_text())
    return int(counts[-1])


def accounted(summary: dict, redelivered: bool = False) -> None:
    """Every trajectory rewarded or dead-lettered; with no redelivery (a resumed run on a broker
    that kept its topics redelivers what was uncommitted) also every rewarded record trained or
    dropped: the learner ended when its data did."""
    r = summary["records"]
    assert r["rollouts"] == r["rewarded"] + r["dead_at_reward"] + r["unscored"], r
    assert r["unscored"] == 0, r
    if not redelivered:
        assert r["untrained"] == 0 and r["rewarded"] == r["trained"] + r["dead_at_learner"], r


def test_a_run_ends_when_its_data_ends_and_a_refused_version_is_named(tmp_path):
    # the worker may load weights only from a directory the learner never writes: it keeps
    # version 0 and says so; the data still ends the run (stale records are dead-lettered)
    # 48 prompts, not TINY's 16: a loaded machine must not reach the end of the data before
    # the status line's next diagnosis
    run = Run(tmp_path, "rollout.weights_prefixes=[/nonexistent/weights]", "run.stall_warn_s=5", "feed.limit=48")
    try:
        first = run.wait_for(r"^version [1-9]")
        named = run.wait_for(r"ERROR rollout-0 refuses policy version \d+: its weights_uri is not under "
                             r"rollout.weights_prefixes")
        summary = run.finish()
    finally:
        run.kill()
    assert run.proc.returncode == 0, run.err[-3000:]
    assert summary["ended"] == "data_exhausted" and 1 <= summary["versions"] < 100, summary
    at = {line: t for t, line in run.lines}
    first_at = min(t for t, line in run.lines if re.search(r"^version [1-9]", line))
    named_at = min(t for t, line in run.lines if "refuses policy version" in line)
    assert first and named and named_at - first_at <= 5 + 6, (named_at - first_at, at)  # stall_warn_s + a poll
    assert summary["records"]["prompts"] == 48 and summary["records"]["rollouts"] == 192
    accounted(summary)
    state = state_of(Path(summary["out"]))
    assert state.ended == "data_exhausted" and resume.finished_count(state) == 48 and not state.done_groups
    assert not [pid for pid in run.seen if alive(pid)]


#: twice the data: a run to interrupt must not end between two looks
LONGER = ["feed.limit=32"]


def test_resume_after_a_sigkill_of_everything_finishes_the_data(tmp_path):
    """A SIGKILL of every process of the run (the embedded broker too) leaves none behind; the
    same command with --resume finishes the data from the checkpoint, feeding no finished
    prompt again. (Ctrl-C and --resume: tests/project/test_docs.py runs getting started's commands.)"""
    run = Run(tmp_path, *LONGER)
    try:
        run.wait_for_version(2)
        seen = run.seen | descendants(run.proc.pid)
        os.killpg(run.proc.pid, signal.SIGKILL)
        run.proc.wait(30)
    finally:
        run.kill()
    time.sleep(1.0)
    assert len(seen) >= 5  # broker, learner, reward, rollout, feed
    assert not [pid for pid in seen if alive(pid)], "a process outlived the SIGKILL of the run"
    out = next(tmp_path.glob("*/checkpoints")).parent
    first = state_of(out)
    assert 2 <= first.version and resume.finished_count(first)

    run = Run(tmp_path, *LONGER, "--resume", str(out))
    try:
        run.wait_for(rf"resuming {re.escape(str(out))} from version {first.version}")
        summary = run.finish()
    finally:
        run.kill()
    assert run.proc.returncode == 0 and summary["ended"] == "data_exhausted", run.err[-3000:]
    assert published(out) == 32 - resume.finished_count(first)  # no finished prompt fed again
    last = state_of(out)
    assert last.version > first.version and summary["versions"] == last.version
    # every prompt group finished exactly once across the two sessions; nothing trained twice
    # (by their positions in the feed's order: none is left by id)
    assert resume.finished_count(last) == len(resume.finished_positions(last)) == 32
    assert resume.finished_positions(first) <= resume.finished_positions(last)
    accounted(summary)
    # the killed session is in the summary as far as it was observed (saved as its figures moved)
    assert [earlier["prompts"] > 0 for earlier in summary["earlier_sessions"]] == [True]


#: a run to stop at version 3 and resume to its last, version 8: the default's two reward
#: members (two members stopping together once left the embedded broker's group leaderless)
OUTLIVED = ["run.reward_members=2", "feed.limit=64", "learner.versions=8"]


def resumed_to_its_end(where: Path, args: list[str], out: Path, cfg: BusConfig):
    """``--resume`` the run in ``out`` to its end: ``(summary, rollouts, rewarded ids counted,
    the rollouts' dead-lettered ids)`` read from the broker that outlived both sessions."""
    run = Run(where, *args, "--resume", str(out))
    try:
        summary = run.finish()
    finally:
        run.kill()
    assert run.proc.returncode == 0 and summary["ended"] == "done", run.err[-3000:]
    bus = Bus(cfg)
    rollouts = [Trajectory.decode(m.value) for m in read_topic_sync(bus, "rollouts")]
    rewarded = Counter(Rewarded.decode(m.value).id for m in read_topic_sync(bus, "rewarded"))
    dead = {d.record_id for d in (DeadLetter.decode(m.value) for m in read_topic_sync(bus, "deadletter"))
            if d.source_topic == bus.topic("rollouts")}
    return summary, rollouts, rewarded, dead


# each way to stop once, each staleness once: the pairs that differ (Ctrl-C with staleness 1 and
# SIGKILL with 0 passed as long as these two did)
@pytest.mark.parametrize("stop, staleness", [("ctrl-c", 0), ("sigkill", 1)])
def test_a_run_stopped_at_version_3_resumes_to_its_end_on_a_broker_that_outlives_it(tmp_path, stop, staleness):
    """Issue 43: the broker is a process of its own that outlives both sessions, as a Kafka
    cluster does. The first session stops at version 3 (Ctrl-C, or SIGKILL of all its
    processes); a fresh run on its topics is refused in one line; ``--resume`` reaches the last
    version: the policy's versions never go back, no prompt is published twice for its epoch and
    no group finished twice, every rollout of both sessions is rewarded or dead-lettered (at
    least once; a redelivery is rare), and the rollout worker generates with the resumed
    version's weights, not its startup ones."""
    from streamrl.broker import EmbeddedBroker

    with EmbeddedBroker() as broker:
        cfg = BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix="outlived")
        args = ["--bootstrap-servers", broker.bootstrap, "bus.topic_prefix=outlived", *OUTLIVED,
                f"rollout.max_staleness={staleness}", f"learner.max_staleness={staleness}"]
        run = Run(tmp_path, *args)
        try:
            run.wait_for_version(3)
            if stop == "ctrl-c":
                run.proc.send_signal(signal.SIGINT)
                assert run.finish(120)["ended"] == "interrupted", run.err[-3000:]
            else:
                os.killpg(run.proc.pid, signal.SIGKILL)
                run.proc.wait(30)
        finally:
            run.kill()
        out = next(tmp_path.glob("*/checkpoints")).parent
        resumed = state_of(out).version

        # another run on the same topics: refused at once, in one line, saying what to do
        started = time.monotonic()
        fresh = subprocess.run([sys.executable, "-m", "streamrl", "run", *gsm8k_run_config(), *TINY, *args,
                                f"run.out_dir={tmp_path / 'other'}", "run.resume=never"],
                               cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert fresh.returncode == 2 and time.monotonic() - started < 60, fresh.stderr[-2000:]
        assert "hold another run's records" in fresh.stderr and "--resume" in fresh.stderr
        assert "bus.topic_prefix" in fresh.stderr

        resumed_at = time.time()
        summary, rollouts, rewarded, dead = resumed_to_its_end(tmp_path, args, out, cfg)
        bus = Bus(cfg)
        versions = [PolicyVersion.decode(m.value).version for m in read_topic_sync(bus, "policy")]
        prompts = Counter((p.group_id, p.epoch) for p in (Prompt.decode(m.value) for m in read_topic_sync(bus, "prompts")))
    assert max(prompts.values()) == 1, prompts.most_common(3)  # no prompt published twice for its epoch
    assert 3 <= resumed < 8 and summary["versions"] == 8, (resumed, summary["versions"])
    assert versions == sorted(set(versions)) and versions[-1] == 8, versions
    done = state_of(out)
    assert len(done.done_groups) == len(set(done.done_groups)) and resume.finished_count(done) <= 64, \
        "a prompt group finished twice"
    assert {t.id for t in rollouts} == set(rewarded) | dead, "a rollout neither rewarded nor dead-lettered"
    # at least once: after a SIGKILL what was scored and not committed is scored again, and after
    # a Ctrl-C a record in flight when a joining member takes its partition may be (rarely)
    if stop == "ctrl-c":
        assert sum(rewarded.values()) - len(rewarded) <= len(rewarded) // 10, rewarded.most_common(3)
    later = [t.policy_version for t in rollouts if t.created_at > resumed_at]
    assert later and min(later) >= resumed - staleness, (resumed, sorted(set(later)))
    accounted(summary, redelivered=True)


def fill(disk: Path) -> Path:
    """Write zeros into ``disk`` until it refuses (ENOSPC), as another program filling the
    device would; the file is returned to be deleted ("free space")."""
    filler = disk / "filler"
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(bytes(1 << 20))
                f.flush()
        except OSError:
            pass
    return filler


@pytest.mark.e2e
def test_a_disk_filled_mid_run_stops_it_naming_the_path_and_resume_after_freeing_loses_nothing(tmp_path):
    """Issue 68: the run's directory on a device of its own (a 96 MB tmpfs) that something else
    fills after version 2, on a broker that outlives the run. The run stops by itself with the
    reason (``StorageFull``: the path and "No space left"), never hangs or restarts into the same
    wall; the latest checkpoint stays readable; after the filler is deleted ``--resume`` trains to
    the last version with every prompt group finished once and every rollout rewarded or
    dead-lettered."""
    from streamrl.broker import EmbeddedBroker

    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96m", "tmpfs", str(disk)], capture_output=True, text=True)
    if mounted.returncode != 0:  # CI runs as root, as this machine does; a user without mount cannot fill a device
        pytest.skip(f"mounting a tmpfs needs root: {mounted.stderr.strip()}")
    try:
        with EmbeddedBroker() as broker:
            cfg = BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix="fulldisk")
            args = ["--bootstrap-servers", broker.bootstrap, "bus.topic_prefix=fulldisk", *OUTLIVED]
            run = Run(disk, *args)
            try:
                run.wait_for_version(2)
                filler = fill(disk)
                stopped = run.finish(240)
            finally:
                run.kill()
            out = next(disk.glob("*/checkpoints")).parent
            # whichever stage's write meets the full device first names it: the learner's checkpoint,
            # the archive, or the supervisor's own observation; exit 2, the run's directory kept
            assert run.proc.returncode == 2 and stopped["ended"].startswith("failed"), (stopped, run.err[-3000:])
            assert "--resume" in json.dumps(stopped), stopped
            reason = " ".join(str(v) for v in stopped.values()) + run.err
            assert "No space left" in reason and str(disk) in reason, run.err[-3000:]
            at_stop = state_of(out).version
            assert at_stop >= 2

            filler.unlink()
            summary, rollouts, rewarded, dead = resumed_to_its_end(disk, args, out, cfg)
        done = state_of(out)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
    print(f"disk filled after version {at_stop}: the run ended {stopped['ended']!r}; resumed to {summary['versions']}")
    assert summary["versions"] == 8
    assert len(done.done_groups) == len(set(done.done_groups)) and resume.finished_count(done) <= 64, \
        "a prompt group finished twice"
    assert {t.id for t in rollouts} == set(rewarded) | dead, "a rollout neither rewarded nor dead-lettered"
    accounted(summary, redelivered=True)


def test_the_embedded_broker_killed_mid_run_ends_it_quickly_and_quietly(tmp_path):
    # data for far more versions than are seen before the kill: TINY's 16 prompts can all be
    # trained between two status lines, and a run that has ended is not killed "mid-run"
    run = Run(tmp_path, "feed.limit=400")
    try:
        broker = int(run.wait_for(r"embedded broker: \S+ \(pid (\d+)\)").group(1))
        run.wait_for(r"^version [1-9]")
        seen = run.seen | descendants(run.proc.pid)
        n_before = len(run.lines)
        killed_at = time.monotonic()
        os.kill(broker, signal.SIGKILL)
        summary = run.finish(90)
        took = time.monotonic() - killed_at
    finally:
        run.kill()
    assert run.proc.returncode not in (0, None) and took < 60, (run.proc.returncode, took)
    after = [line for _, line in run.lines[n_before:]]
    print(f"embedded broker SIGKILLed: the run exited {run.proc.returncode} after {took:.1f} s, "
          f"{len(after)} lines after the kill")
    assert len(after) < 200, "\n".join(after[:50])
    assert summary["ended"] == "failed:broker" and "embedded broker" in summary["failure"]["error"], summary
    assert any("the embedded broker" in line and "killed by signal 9" in line for line in after)
    time.sleep(1.0)
    assert not [pid for pid in seen if alive(pid)], "a stage outlived the run"
    assert resume.latest_good(Path(summary["out"]) / "checkpoints") is not None  # still readable


def test_stage_verbs_started_separately_end_with_their_data(tmp_path, bootstrap):
    """No `streamrl run` around them: the learner ends by itself when the feed's data is
    finished (it reads the feed's section of the same config), rc 0."""
    prefix = f"verbs{uuid.uuid4().hex[:6]}"
    cfg = BusConfig(bootstrap_servers=bootstrap, topic_prefix=prefix)
    config, dataset = gsm8k_run_config()
    common = ["--config", config, dataset, "--bootstrap-servers", bootstrap, f"bus.topic_prefix={prefix}",
              f"learner.checkpoint_dir={tmp_path}/checkpoints", f"learner.weights_dir={tmp_path}/weights",
              *[o for o in TINY if not o.startswith("run.")], "feed.limit=8"]

    def start(verb: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "streamrl", verb, *common], cwd=ROOT,
                                stdout=open(tmp_path / f"{verb}.log", "w"), stderr=subprocess.STDOUT)

    procs = {verb: start(verb) for verb in ("learner", "reward", "rollout", "feed")}
    try:
        assert procs["learner"].wait(300) == 0, (tmp_path / "learner.log").read_text()[-3000:]
        assert procs["feed"].wait(30) == 0
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs.values():
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
    state = state_of(tmp_path)
    assert state.ended == "data_exhausted" and resume.finished_count(state) == 8
    versions = [PolicyVersion.decode(m.value).version for m in read_topic_sync(Bus(cfg), "policy")]
    assert versions[-1] == state.version >= 1


def test_a_stage_verb_whose_broker_goes_away_fails_naming_it_after_the_timeout():
    """An external broker that stops answering: the stage reports it once per interval (not per
    request) and, after bus.unavailable_timeout_s, stops with that reason, rc 1."""
    from streamrl.broker import EmbeddedBroker

    broker = EmbeddedBroker()
    broker.start()
    proc = subprocess.Popen([sys.executable, "-m", "streamrl", "reward", "--bootstrap-servers", broker.bootstrap,
                             f"bus.topic_prefix=gone{uuid.uuid4().hex[:6]}", "bus.unavailable_timeout_s=5"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in proc.stdout:
            if line.startswith("reward: group"):
                break
        else:
            raise AssertionError("the reward stage did not start")
        time.sleep(8)  # in its group (a broker gone while joining is the transport's error, exit 2)
        killed_at = time.monotonic()
        broker.proc.kill()
        out, _ = proc.communicate(timeout=90)
        took = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
        broker.stop()
    assert proc.returncode == 1 and took < 60, (proc.returncode, took, out[-3000:])
    assert re.search(r"reward: Kafka at 127\.0\.0\.1:\d+ unreachable for \d+ s \(bus.unavailable_timeout_s\)", out), out[-3000:]
    assert len(out.splitlines()) < 200, out[-3000:]
