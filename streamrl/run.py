"""``streamrl run``: the whole pipeline at once, each stage its own process.

Three pieces, all small:

- A ``Launcher`` starts the stages (``python -m streamrl VERB ...``, the same commands the compose
  file uses): as child processes here (``LocalLauncher``) or as Ray actors with resources
  (``streamrl.ray_launcher``). It stops every one of them on the way out, whatever the way out is
  (the learner finished, Ctrl-C, an error). ``LagAutoscaler`` sizes the reward group by lag.
- ``Observer`` reads the topics themselves (no consumer group, no commits) to tell what the
  pipeline is doing: records per stage, rewards by policy version, dead letters, versions. It
  depends on no stage's internals: it sees what a user of the topics would see.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from streamrl.broker import stop_process
from streamrl.bus import Bus, TopicPartition
from streamrl.records import DeadLetter, PolicyVersion, RecordError, Rewarded
from streamrl.topics import load_specs


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def stage_command(argv: list[str]) -> list[str]:
    """How every launcher runs a stage: the same CLI as a user, compose and Ray."""
    return [sys.executable, "-m", "streamrl", *argv]


class Launcher:
    """Starts and stops named stage processes. ``LocalLauncher`` runs them as children here;
    ``streamrl.ray_launcher.RayLauncher`` places them as Ray actors with resources."""

    def start(self, name: str, argv: list[str], stage: str) -> None:
        raise NotImplementedError

    def returncode(self, name: str) -> int | None:
        """None while running."""
        raise NotImplementedError

    def stop(self, name: str, timeout_s: float = 20.0) -> None:
        raise NotImplementedError

    def names(self) -> list[str]:
        raise NotImplementedError

    def log_tail(self, name: str, lines: int = 20) -> str:
        raise NotImplementedError

    def failed(self) -> str | None:
        """A stage that exited with an error (the run cannot go on without it)."""
        return next((n for n in self.names() if self.returncode(n) not in (None, 0)), None)

    def stop_all(self, timeout_s: float = 20.0) -> None:
        raise NotImplementedError


class LocalLauncher(Launcher):
    """Child processes, output in ``<log_dir>/<name>.log``. Children get SIGTERM if this process
    dies (``PR_SET_PDEATHSIG``), so no stage outlives the run."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, argv: list[str], stage: str) -> None:
        with open(self.log_dir / f"{name}.log", "wb") as out:
            self.procs[name] = subprocess.Popen(
                stage_command(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=dict(os.environ, PYTHONUNBUFFERED="1"), preexec_fn=_die_with_parent)

    def returncode(self, name: str) -> int | None:
        return self.procs[name].poll()

    def names(self) -> list[str]:
        return list(self.procs)

    def stop(self, name: str, timeout_s: float = 20.0) -> None:
        stop_process(self.procs[name], timeout_s)

    def stop_all(self, timeout_s: float = 20.0) -> None:
        for proc in self.procs.values():  # all at once, then wait
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            stop_process(proc, timeout_s)

    def log_tail(self, name: str, lines: int = 20) -> str:
        text = (self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])


@dataclass
class LagAutoscaler:
    """Sizes the reward group by its consumer lag: one member more when the lag stayed above
    ``scale_up_lag`` for ``window_s``, one fewer when it stayed at or below ``scale_down_lag``;
    at most one change per ``cooldown_s`` (a rebalance needs a few seconds to settle)."""

    min_members: int
    max_members: int
    scale_up_lag: int = 200
    scale_down_lag: int = 0
    window_s: float = 5.0
    cooldown_s: float = 15.0
    _high_since: float | None = field(default=None, init=False)
    _low_since: float | None = field(default=None, init=False)
    _last_change: float = field(default=-1e18, init=False)

    def decide(self, lag: int, members: int, now: float) -> int:
        """+1, -1 or 0 members."""
        if lag > self.scale_up_lag:
            self._high_since = now if self._high_since is None else self._high_since
        else:
            self._high_since = None
        if lag <= self.scale_down_lag:
            self._low_since = now if self._low_since is None else self._low_since
        else:
            self._low_since = None
        if now - self._last_change < self.cooldown_s:
            return 0
        step = 0
        if self._high_since is not None and now - self._high_since >= self.window_s and members < self.max_members:
            step = 1
        elif self._low_since is not None and now - self._low_since >= self.window_s and members > self.min_members:
            step = -1
        if step:
            self._last_change, self._high_since, self._low_since = now, None, None
        return step


@dataclass
class VersionStats:
    """Rewarded records generated by one policy version."""

    records: int = 0
    reward_sum: float = 0.0
    first_scored: float = float("inf")
    last_scored: float = 0.0

    @property
    def mean(self) -> float:
        return self.reward_sum / self.records if self.records else float("nan")


@dataclass
class Observation:
    """What the topics say about the run so far (records counted once by ``id``)."""

    prompts: int = 0
    rollouts: int = 0
    rewarded: int = 0
    trained: int = 0
    deadletters: Counter = field(default_factory=Counter)
    versions: dict[int, float] = field(default_factory=dict)  # version -> announced at (unix s)
    by_version: dict[int, VersionStats] = field(default_factory=lambda: defaultdict(VersionStats))
    seen_ids: set[str] = field(default_factory=set)
    started: float = field(default_factory=time.time)

    @property
    def latest_version(self) -> int:
        return max(self.versions, default=0)


class Observer:
    """Follows ``rewarded``, ``policy`` and ``deadletter`` from the beginning, and the end
    offsets of ``prompts`` and ``rollouts``, as a plain reader."""

    def __init__(self, bus: Bus, reward_group: str = ""):
        self.bus = bus
        self.reward_group = reward_group
        self.obs = Observation()
        self._consumer = bus.consumer(["rewarded", "policy", "deadletter"], None, "run")
        specs = load_specs()
        self._counted = {name: [TopicPartition(bus.topic(name), p) for p in range(specs[name].partitions)]
                         for name in ("prompts", "rollouts")}
        self._rollout_ends: dict[TopicPartition, int] = {}  # from the last poll

    async def start(self) -> None:
        await self._consumer.start()

    async def stop(self) -> None:
        await self._consumer.stop()

    async def poll(self, timeout_ms: int = 500) -> Observation:
        obs = self.obs
        for msg in await self._consumer.getmany(timeout_ms=timeout_ms):
            topic = msg.topic.rsplit(".", 1)[-1]
            try:
                if topic == "rewarded":
                    rec = Rewarded.decode(msg.value)
                    if rec.id in obs.seen_ids:
                        continue  # at-least-once: a redelivered record counts once
                    obs.seen_ids.add(rec.id)
                    obs.rewarded += 1
                    stats = obs.by_version[rec.policy_version]
                    stats.records += 1
                    stats.reward_sum += rec.reward
                    stats.first_scored = min(stats.first_scored, rec.scored_at)
                    stats.last_scored = max(stats.last_scored, rec.scored_at)
                elif topic == "policy":
                    pv = PolicyVersion.decode(msg.value)
                    obs.versions[pv.version] = pv.created_at
                    obs.trained = max(obs.trained, pv.trained_records)
                elif topic == "deadletter":
                    obs.deadletters[DeadLetter.decode(msg.value).reason] += 1
            except RecordError as exc:
                obs.deadletters[f"unreadable {topic}: {exc.reason}"] += 1
        obs.prompts, obs.rollouts = await self._end_offsets()
        return obs

    async def _end_offsets(self) -> tuple[int, int]:
        ends = [await self._consumer.end_offsets(tps) for tps in self._counted.values()]
        self._rollout_ends = ends[1]
        return sum(ends[0].values()), sum(ends[1].values())

    async def reward_lag(self) -> int:
        """The reward group's consumer lag on ``rollouts``: end offsets minus committed."""
        ends = self._rollout_ends
        admin = self.bus.admin_client()
        await admin.start()
        try:  # partitions named: the embedded broker mis-encodes the "all partitions" answer
            committed = await admin.list_consumer_group_offsets(self.reward_group, partitions=list(ends))
        finally:
            await admin.close()
        return sum(end - (committed[tp].offset if tp in committed and committed[tp].offset >= 0 else 0)
                   for tp, end in ends.items())


def status_line(obs: Observation, target_versions: int) -> str:
    last = obs.by_version.get(max(obs.by_version, default=-1))
    reward = f"{last.mean:.3f}" if last and last.records else "-"
    lag = obs.rollouts - obs.rewarded
    dlq = sum(obs.deadletters.values())
    newest = max((v for v, s in obs.by_version.items() if s.records), default=0)
    return (f"version {obs.latest_version}/{target_versions} | prompts {obs.prompts} | "
            f"rollouts {obs.rollouts} | rewarded {obs.rewarded} (lag {lag}) | trained {obs.trained} | "
            f"reward(last gen) {reward} | rollouts behind by {obs.latest_version - newest} | "
            f"dead letters {dlq} | {time.time() - obs.started:.0f}s")


def summarise(obs: Observation, plot_path: Path) -> dict[str, Any]:
    """The run's summary; ``reward_first`` / ``reward_last`` are mean rewards of the records
    generated by the first and last policy versions that produced any."""
    versions = sorted(v for v, s in obs.by_version.items() if s.records)
    plot(obs, plot_path)
    return {
        "versions": obs.latest_version,
        "reward_first": round(obs.by_version[versions[0]].mean, 4) if versions else None,
        "reward_last": round(obs.by_version[versions[-1]].mean, 4) if versions else None,
        "reward_by_version": {str(v): round(obs.by_version[v].mean, 4) for v in versions},
        "records": {"prompts": obs.prompts, "rollouts": obs.rollouts, "rewarded": obs.rewarded,
                    "trained": obs.trained},
        "deadletters": sum(obs.deadletters.values()),
        "deadletter_reasons": dict(obs.deadletters),
        "seconds": round(time.time() - obs.started, 1),
        "plot": str(plot_path),
    }


def plot(obs: Observation, path: Path) -> None:
    """Mean reward and rewarded records per second, by the policy version that generated them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    versions = sorted(v for v, s in obs.by_version.items() if s.records)
    means = [obs.by_version[v].mean for v in versions]
    rates = []
    for v in versions:
        s = obs.by_version[v]
        span = max(s.last_scored - s.first_scored, 1e-3)
        rates.append(s.records / span if s.records > 1 else 0.0)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot(versions, means, marker="o")
    ax1.set(xlabel="policy version (generated by)", ylabel="mean reward", title="Reward by version")
    ax1.grid(alpha=0.3)
    ax2.bar(versions, rates)
    ax2.set(xlabel="policy version (generated by)", ylabel="rewarded records / s", title="Throughput by version")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


async def observe_until(observer: Observer, launcher: Launcher, target_versions: int,
                        stop: asyncio.Event, show, interval_s: float,
                        scaler: LagAutoscaler | None = None, start_reward=None) -> str:
    """Poll and show status until the learner exits (done), a stage fails, or ``stop``; resize
    the reward group on the way when ``scaler`` is given. Returns why it ended: ``done``,
    ``interrupted`` or ``failed:<stage>``."""
    last_shown = 0.0
    while True:
        obs = await observer.poll()
        now = time.monotonic()
        if scaler is not None:
            await resize_reward_group(observer, launcher, scaler, start_reward, now, show)
        if now - last_shown >= interval_s:
            show(status_line(obs, target_versions))
            last_shown = now
        if stop.is_set():
            return "interrupted"
        if launcher.returncode("learner") == 0:
            await asyncio.sleep(1.0)  # the last version's records arrive on the topics
            await observer.poll()
            return "done"
        failed = launcher.failed()
        if failed is not None:
            return f"failed:{failed}"


async def resize_reward_group(observer: Observer, launcher: Launcher, scaler: LagAutoscaler,
                              start_reward, now: float, show) -> None:
    """One autoscaling step: members are the running ``reward-N`` stages."""
    members = sorted((n for n in launcher.names() if n.startswith("reward-") and launcher.returncode(n) is None),
                     key=lambda n: int(n.split("-")[1]))
    lag = await observer.reward_lag()
    step = scaler.decide(lag, len(members), now)
    if step > 0:
        start_reward()
        show(f"autoscale: reward lag {lag}: {len(members)} -> {len(members) + 1} members")
    elif step < 0:
        show(f"autoscale: reward lag {lag}: {len(members)} -> {len(members) - 1} members")
        await asyncio.to_thread(launcher.stop, members[-1])
