"""From a stream of rewarded records to trainable groups: de-duplication by ``id``, groups by
``group_id``, the staleness bound, and incomplete-group timeouts. Pure logic (no Kafka, no
torch, time passed in), so every rule is tested directly.

The rules:

- A record whose ``id`` was already taken (finished or waiting in a group) is a duplicate:
  skipped, never trained twice. Delivery is at-least-once and the embedded broker can hand a
  partition to two members for a moment, so duplicates are normal. A duplicate that is another
  *copy* of the trajectory (its ``copy``, the trajectory's ``created_at``, differs from every one
  seen for the id: a rollout worker restarted before committing its prompt and generated the
  group again) is not trained either but reported as ``regenerated``: it was produced, and the
  staleness gate, which counts what was produced, must see it finished (the learner
  dead-letters it), or each such copy holds a slot for good and enough of them freeze the run.
- A group is trained only whole (``group_size`` distinct ids), except that a group incomplete
  for ``group_timeout_s`` is either trained as it is (``allow_partial_groups``) or dropped with
  reason ``group_timeout``.
- Staleness: at version ``v`` a record is fresh while ``v - policy_version <= max_staleness``.
  A group is as old as its oldest member (GRPO's advantages need all of it), so one stale
  member makes the whole group stale: dropped with reason ``stale``. It is checked when a
  record arrives and again when a group is taken for an update, so the bound holds for the
  version the update starts from, however long the record waited for a judge or for its group.
- Dynamic sampling (DAPO's ``filter_groups``, with ``filter_flat``): a whole group whose
  members' ``metric`` is all the same carries no gradient (every advantage 0), so it is dropped
  with reason ``filtered`` before it can count towards a mini-batch; the staleness gate counts
  it finished, as every dead letter. At most ``filter_bound`` groups a version are filtered
  (verl's ``max_num_gen_batches``): past it a flat group trains, so a run whose groups are all
  flat for a while still makes versions.
- A group once dropped or trained is *closed*: a late member is dropped with the group's
  reason (``stale``, ``group_timeout``) or ``group_overflow`` (more distinct ids than
  ``group_size``).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

STALE = "stale"
GROUP_TIMEOUT = "group_timeout"
GROUP_OVERFLOW = "group_overflow"
MEMBERS_LOST = "members_lost"
FILTERED = "filtered"


@dataclass
class Item:
    """One record as the assembler sees it; ``payload`` is the caller's (record, message)."""

    id: str
    group_id: str
    group_size: int
    policy_version: int
    payload: Any = None
    copy: float | None = None  # which copy of the id this is (the trajectory's created_at)
    metric: float | None = None  # what dynamic sampling compares within the group


@dataclass
class Drop:
    """An item to send to dead letters with ``reason``."""

    item: Item
    reason: str
    detail: str = ""
    closes_group: bool = False  # the first drop of a group being closed (metrics count groups)


@dataclass
class Group:
    group_id: str
    group_size: int
    first_seen: float
    items: list[Item] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return len(self.items) >= self.group_size

    @property
    def oldest_version(self) -> int:
        return min(i.policy_version for i in self.items)


class _LRU:
    """A bounded insertion-ordered map: the oldest entries fall out first."""

    def __init__(self, size: int):
        self.size, self.data = size, OrderedDict()

    def put(self, key: str, value: Any = None) -> None:
        self.data[key] = value
        self.data.move_to_end(key)
        while len(self.data) > self.size:
            self.data.popitem(last=False)

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    def __contains__(self, key: str) -> bool:
        return key in self.data

    def __len__(self) -> int:
        return len(self.data)


class Assembler:
    def __init__(self, *, max_staleness: int, group_timeout_s: float,
                 allow_partial_groups: bool, dedup_window: int, filter_flat: bool = False,
                 filter_bound: int = 0):
        self.filter_flat, self.filter_bound = filter_flat, filter_bound
        self.filtered = 0  # groups filtered since the last ``new_version``
        self.max_staleness = max_staleness
        self.group_timeout_s = group_timeout_s
        self.allow_partial_groups = allow_partial_groups
        self.finished = _LRU(dedup_window)  # id trained or dropped -> the copies of it seen
        self.closed = _LRU(dedup_window)  # group_id -> reason for its late members
        self.open: dict[str, Group] = {}  # incomplete, or complete and waiting to be taken
        self.ready: deque[str] = deque()  # group ids ready to train, oldest first
        self._pending: dict[str, list[float | None]] = {}  # id waiting in a group -> its copies seen

    # -- taking records -----------------------------------------------------------------------
    def is_fresh(self, policy_version: int, version: int) -> bool:
        return version - policy_version <= self.max_staleness

    def add(self, item: Item, version: int, now: float) -> tuple[str, list[Drop]]:
        """Take one record at learner version ``version``. Returns ``(status, drops)`` with
        status ``accepted``, ``duplicate``, ``regenerated`` (a duplicate that is another copy)
        or ``dropped``; ``drops`` may also hold earlier members of the same group (a stale
        newcomer makes the whole group stale)."""
        copies = self._pending.get(item.id, self.finished.get(item.id))
        if copies is not None:
            if item.copy in copies or None in copies:  # the same copy again, or copies unknown
                return "duplicate", []
            copies.append(item.copy)
            return "regenerated", []
        reason = self.closed.get(item.group_id)
        if reason is not None:
            self._finish(item)
            return "dropped", [Drop(item, reason, f"group {item.group_id} is closed ({reason})")]
        if not self.is_fresh(item.policy_version, version):
            detail = (f"policy_version {item.policy_version} at learner version {version}, "
                      f"max_staleness {self.max_staleness}")
            self._finish(item)
            if item.group_id in self.open:
                drops = [Drop(item, STALE, detail)]
                drops += self._close(item.group_id, STALE, f"a member is stale: {detail}")
            else:
                drops = [Drop(item, STALE, detail, closes_group=True)]
                self.closed.put(item.group_id, STALE)
            return "dropped", drops
        group = self.open.get(item.group_id)
        if group is None:
            group = self.open[item.group_id] = Group(item.group_id, item.group_size, now)
        elif group.complete:
            self._finish(item)
            return "dropped", [Drop(item, GROUP_OVERFLOW,
                                    f"group {item.group_id} already has {group.group_size} members")]
        group.items.append(item)
        self._pending[item.id] = [item.copy]
        if group.complete:
            return "accepted", self._ready(group)
        return "accepted", []

    def _ready(self, group: Group) -> list[Drop]:
        """A whole (or settled partial) group: ready to train, or filtered (module doc)."""
        metrics = {i.metric for i in group.items}
        flat = len(group.items) > 1 and len(metrics) == 1 and None not in metrics
        if self.filter_flat and flat and (not self.filter_bound or self.filtered < self.filter_bound):
            self.filtered += 1
            return self._close(group.group_id, FILTERED,
                               f"every member's metric is {next(iter(metrics))!r}: no variance, no gradient")
        self.ready.append(group.group_id)
        return []

    def new_version(self) -> None:
        """A version was published: the filter's bound counts afresh."""
        self.filtered = 0

    # -- time and versions --------------------------------------------------------------------
    def expire(self, now: float) -> list[Drop]:
        """Incomplete groups older than the timeout: ready as partial groups, or dropped."""
        drops: list[Drop] = []
        for gid, group in list(self.open.items()):
            if group.complete or now - group.first_seen < self.group_timeout_s:
                continue
            if self.allow_partial_groups:
                group.group_size = len(group.items)  # it trains as it is
                drops += self._ready(group)
            else:
                drops += self._close(gid, GROUP_TIMEOUT,
                                     f"{len(group.items)} of {group.group_size} members after "
                                     f"{now - group.first_seen:.1f}s")
        return drops

    def settle(self, gid: str, detail: str) -> list[Drop]:
        """Group ``gid`` gets no more members (the others were dead-lettered upstream): ready as
        a partial group, or dropped with reason ``members_lost``, by the same rule as a timeout,
        without waiting for it."""
        group = self.open.get(gid)
        if group is None or group.complete:
            return []
        if self.allow_partial_groups:
            group.group_size = len(group.items)
            return self._ready(group)
        return self._close(gid, MEMBERS_LOST, detail)

    def purge_stale(self, version: int) -> list[Drop]:
        """Drop every waiting group that version ``version`` makes stale."""
        drops: list[Drop] = []
        for gid, group in list(self.open.items()):
            if not self.is_fresh(group.oldest_version, version):
                drops += self._close(gid, STALE, f"oldest policy_version {group.oldest_version} at "
                                     f"learner version {version}, max_staleness {self.max_staleness}")
        return drops

    def take(self, n_groups: int, version: int) -> tuple[list[Group] | None, list[Drop]]:
        """``n_groups`` ready, fresh groups (oldest first) for an update at ``version``, or
        None while fewer are there. Stale ready groups are dropped on the way."""
        drops = self.purge_stale(version)
        if len(self.ready) < n_groups:
            return None, drops
        groups = []
        for _ in range(n_groups):
            gid = self.ready.popleft()
            group = self.open.pop(gid)
            self.closed.put(gid, GROUP_TIMEOUT if group.group_size < group.items[0].group_size
                            else GROUP_OVERFLOW)
            for item in group.items:
                self._finish(item)
            groups.append(group)
        return groups, drops

    def _close(self, gid: str, reason: str, detail: str) -> list[Drop]:
        group = self.open.pop(gid, None)
        self.closed.put(gid, reason)
        if group is None:
            return []
        if gid in self.ready:
            self.ready.remove(gid)
        drops = []
        for n, item in enumerate(group.items):
            self._finish(item)
            drops.append(Drop(item, reason, detail, closes_group=n == 0))
        return drops

    def _finish(self, item: Item) -> None:
        """``item`` trained or dropped: its id (and the copies of it seen) into the window."""
        self.finished.put(item.id, self._pending.pop(item.id, [item.copy]))

    # -- state --------------------------------------------------------------------------------
    @property
    def waiting_records(self) -> int:
        return len(self._pending)

    def state_dict(self) -> dict[str, Any]:
        """What survives a restart: finished ids (with their copies) and closed groups. Records
        waiting in open groups are *not* finished: they come back from Kafka after a restart."""
        return {"finished": [[rid, copies] for rid, copies in self.finished.data.items()],
                "closed": list(self.closed.data.items())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for entry in state.get("finished", []):
            # a bare id: a checkpoint from before copies were kept (its copies unknown)
            rid, copies = (entry, [None]) if isinstance(entry, str) else entry
            self.finished.put(rid, list(copies))
        for gid, reason in state.get("closed", []):
            self.closed.put(gid, reason)
