"""The group hook: adjust a group's rewards once all its samples are scored.

All ``group_size`` trajectories of one prompt share a key (``group_id``), so they land on one
partition and one member of the consumer group sees them all. Each scored record waits here,
unpublished and uncommitted, until its group is complete; then the hook runs once over the
group and every member is published with its adjusted reward (the scorer's own is kept in
``reward_info["group"]["raw_reward"]``). Members that were dead-lettered count towards
completion, so one bad record does not stall its group.

A group that does not complete within ``timeout_s`` of its first member (a member lost
upstream, or ``max_in_flight`` smaller than the group) is published unadjusted and marked
``reward_info["group"]["status"] = "incomplete"``; a member arriving after that is published
the same way at once. A hook that raises dead-letters the whole group (reason
``group_hook_error``): a silently unadjusted reward would be the worse failure.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from streamrl import metrics
from streamrl.errors import Failure
from streamrl.records import Rewarded, Trajectory
from streamrl.reward.config import GroupHookConfig
from streamrl.reward.hooks import HOOKS
from streamrl.scorers.base import split_result
from streamrl.scorers.loader import load_function

log = logging.getLogger(__name__)

_RECENT_GROUPS = 100_000  # finished group ids remembered, to publish stragglers at once


@dataclass
class _Group:
    size: int
    deadline: float
    done: asyncio.Future
    members: dict[str, Rewarded] = field(default_factory=dict)  # id -> scored, in order
    failed: set[str] = field(default_factory=set)  # ids dead-lettered

    @property
    def complete(self) -> bool:
        return len(self.members) + len(self.failed - self.members.keys()) >= self.size


class GroupCollector:
    """Holds each scored record until its group is complete, then runs the hook: ``fn``, or the
    one ``cfg.function`` names (a built-in of ``hooks.HOOKS`` or ``file.py:name``)."""

    def __init__(self, cfg: GroupHookConfig, fn: Any = None):
        self.cfg = cfg
        self.name = cfg.function
        self.fn = fn or HOOKS.get(cfg.function) or load_function(cfg.function)
        self.groups: dict[str, _Group] = {}
        self.finished: OrderedDict[str, None] = OrderedDict()

    def applies(self, traj: Trajectory) -> bool:
        return not self.cfg.data_sources or traj.data_source in self.cfg.data_sources

    def _group(self, traj: Trajectory) -> _Group:
        g = self.groups.get(traj.group_id)
        if g is None:
            g = _Group(size=traj.group_size, deadline=time.monotonic() + self.cfg.timeout_s,
                       done=asyncio.get_running_loop().create_future())
            self.groups[traj.group_id] = g
            metrics.REWARD_GROUPS_PENDING.set(len(self.groups))
        return g

    async def settle(self, rewarded: Rewarded) -> Rewarded:
        """Wait for ``rewarded``'s group and return it as it is to be published."""
        gid = rewarded.group_id
        if gid in self.finished and gid not in self.groups:
            metrics.REWARD_GROUPS.labels("late").inc()
            return self._mark(rewarded, "late", None)
        g = self._group(rewarded)
        g.members.setdefault(rewarded.id, rewarded)  # a redelivered duplicate waits for the same
        if g.complete and not g.done.done():
            await self._run_hook(gid, g)
        try:
            results = await asyncio.wait_for(asyncio.shield(g.done),
                                             max(0.0, g.deadline - time.monotonic()))
        except asyncio.TimeoutError:
            self._expire(gid, g)
            results = g.done.result()
        if isinstance(results, Failure):
            raise Failure(results.reason, results.detail)
        return results.get(rewarded.id) or self._mark(rewarded, "incomplete", g)

    async def failed(self, traj: Trajectory) -> None:
        """``traj`` was dead-lettered: it will not come; complete its group without it."""
        if not self.applies(traj) or traj.group_id in self.finished:
            return
        g = self._group(traj)
        g.failed.add(traj.id)
        if g.complete and not g.done.done():
            await self._run_hook(traj.group_id, g)

    async def _run_hook(self, gid: str, g: _Group) -> None:
        members = list(g.members.values())
        if not members:  # every member was dead-lettered: nothing to adjust
            self._finish(gid, g, {})
            return
        plain = [{"id": m.id, "reward": m.reward, "reward_info": m.reward_info,
                  "response": m.response, "ground_truth": m.ground_truth,
                  "data_source": m.data_source, "extra_info": m.extra_info} for m in members]
        try:
            out = self.fn(plain, **self.cfg.kwargs)
            if inspect.isawaitable(out):
                out = await out
            out = list(out)
            if len(out) != len(members):
                raise ValueError(f"returned {len(out)} rewards for {len(members)} members")
            results: dict[str, Rewarded] = {}
            for m, r in zip(members, out):
                score, extras = split_result(r, f"group hook {self.name}")
                if not math.isfinite(np.float32(score)):
                    raise ValueError(f"non-finite reward {score} for {m.id}")
                results[m.id] = self._mark(m, "applied", g, score, extras)
            outcome: Any = results
            metrics.REWARD_GROUPS.labels("applied").inc()
        except Exception as exc:  # noqa: BLE001 - a user hook's bug dead-letters the group
            log.exception("group hook %s failed on group %s", self.name, gid)
            outcome = Failure("group_hook_error", f"{self.name}: {type(exc).__name__}: {exc}")
            metrics.REWARD_GROUPS.labels("hook_error").inc()
        self._finish(gid, g, outcome)

    def _expire(self, gid: str, g: _Group) -> None:
        if g.done.done():
            return
        log.warning("group %s incomplete after %.0f s (%d of %d scored, %d failed): publishing "
                    "unadjusted", gid, self.cfg.timeout_s, len(g.members), g.size, len(g.failed))
        metrics.REWARD_GROUPS.labels("incomplete").inc()
        self._finish(gid, g, {i: self._mark(m, "incomplete", g) for i, m in g.members.items()})

    def _finish(self, gid: str, g: _Group, outcome: Any) -> None:
        g.done.set_result(outcome)
        if self.groups.get(gid) is g:
            del self.groups[gid]
        self.finished[gid] = None
        while len(self.finished) > _RECENT_GROUPS:
            self.finished.popitem(last=False)
        metrics.REWARD_GROUPS_PENDING.set(len(self.groups))

    def _mark(self, m: Rewarded, status: str, g: _Group | None, score: float | None = None,
              extras: dict[str, Any] | None = None) -> Rewarded:
        info = dict(m.reward_info)
        info["group"] = {"hook": self.name, "status": status, "raw_reward": m.reward,
                         "size": m.group_size, "scored": len(g.members) if g else None,
                         "failed": len(g.failed) if g else None, **(extras or {})}
        reward = m.reward if score is None else float(np.float32(score))
        return dataclasses.replace(m, reward=reward, reward_info=info)


def post_process_hook(method: Any) -> Any:
    """A reward class's ``post_process_scores(scores, ...)`` as a group hook: it gets the group's
    scores in order, plus whichever of ``data_sources``, ``solution_strs``, ``ground_truths``,
    ``extra_infos`` its signature names, and returns the adjusted scores (or result dicts)."""
    params = inspect.signature(method).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    def hook(members: list[dict[str, Any]], **_: Any) -> Any:
        columns = {"data_sources": [m["data_source"] for m in members],
                   "solution_strs": [m["response"] for m in members],
                   "ground_truths": [m["ground_truth"] for m in members],
                   "extra_infos": [m["extra_info"] for m in members]}
        kwargs = {k: v for k, v in columns.items() if takes_all or k in params}
        return method([m["reward"] for m in members], **kwargs)

    return hook
