"""Sizing the reward group by its consumer lag (``run.autoscale``, ``--autoscale MIN:MAX``):
``LagAutoscaler`` decides, ``resize_reward_group`` starts or stops one ``reward-N`` stage."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

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


@dataclass
class Autoscale:
    """What the run's watch needs to resize the reward group: the decision, and how a member starts."""

    scaler: LagAutoscaler
    start_member: Callable[[], None]

    async def step(self, observer: Observer, launcher: Launcher, now: float, show: Callable[[str], None]) -> None:
        await resize_reward_group(observer, launcher, self.scaler, self.start_member, now, show)
