"""Sizing consumer groups by their consumer lag: the reward group (``run.autoscale``,
``--autoscale MIN:MAX``) and each teacher's group (``run.teacher_autoscale``, each on its own
lag). ``LagAutoscaler`` decides, ``resize_group`` starts or stops one ``<group>-N`` stage."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from streamrl.supervisor.launcher import Launcher
from streamrl.supervisor.observer import Observer


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
class GroupAutoscale:
    """One consumer group sized by its own lag: members are the running ``<group>-N`` stages."""

    group: str  # reward, teacher (the only teacher), teacher-<name>
    scaler: LagAutoscaler
    start_member: Callable[[], None]
    lag: Callable[[], Awaitable[int]]

    def members(self, launcher: Launcher) -> list[str]:
        return sorted((n for n in launcher.names() if n.rpartition("-")[0] == self.group
                       and n.rpartition("-")[2].isdigit() and launcher.returncode(n) is None),
                      key=lambda n: int(n.rpartition("-")[2]))


async def resize_group(group: GroupAutoscale, launcher: Launcher, now: float, show) -> None:
    """One autoscaling step of ``group``."""
    members = group.members(launcher)
    lag = await group.lag()
    step = group.scaler.decide(lag, len(members), now)
    if step > 0:
        group.start_member()
        show(f"autoscale: {group.group} lag {lag}: {len(members)} -> {len(members) + 1} members")
    elif step < 0:
        show(f"autoscale: {group.group} lag {lag}: {len(members)} -> {len(members) - 1} members")
        await asyncio.to_thread(launcher.stop, members[-1])


async def resize_reward_group(observer: Observer, launcher: Launcher, scaler: LagAutoscaler,
                              start_reward, now: float, show) -> None:
    """One autoscaling step of the reward group: members are the running ``reward-N`` stages."""
    await resize_group(GroupAutoscale("reward", scaler, start_reward, observer.reward_lag), launcher, now, show)


@dataclass
class Autoscale:
    """What the run's watch needs to resize its groups: each group's decision, how a member
    starts, and its lag."""

    groups: list[GroupAutoscale]

    async def step(self, observer: Observer, launcher: Launcher, now: float, show: Callable[[str], None]) -> None:
        for group in self.groups:
            await resize_group(group, launcher, now, show)
