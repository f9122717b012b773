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

What is remembered, and for how long (``Window``): the finished ids and the closed groups are
kept by the learner version in which they finished, and forgotten once they are both
``keep_versions`` versions and ``keep_seconds`` seconds of the learner's running time old (the
two below), so the window holds at most about ``max(keep_versions, versions made in
keep_seconds) * records_per_version`` ids, whatever the run's length (``dedup_window``, a count,
caps it besides). Why that is enough for "never trained twice":

- A copy of a trajectory that another stage delivered again (a reward or teacher member that
  restarted, a rebalance) carries the original's ``policy_version`` ``p``. The original finished
  at some learner version ``f >= p`` (no record comes from a version not yet made), and the
  copy can only train while ``version - p <= max_staleness``, so at a version ``<= f +
  max_staleness``. With ``keep_versions >= max_staleness + 1`` the id is still known whenever a
  copy could still be fresh; later the copy is stale and dropped as such, never trained. This
  holds across restarts: the window is in the checkpoint, with the versions it is kept by.
- A copy a rollout worker generated again (it restarted before committing its prompt) carries a
  new ``policy_version``, so staleness does not cover it: it comes from a redelivery of the
  prompt, which happens within a stage's restart and its group's rebalance (the session
  timeout, seconds), so ``keep_seconds`` of the learner's own running time (a stopped run's
  pause is not counted) covers it, with a wide margin, and keeps a late redelivery of the same
  copy counted as a duplicate (not a dead letter the staleness gate would count once more).
- Records the learner reads again after its own restart (from the checkpoint's offsets) were
  finished in the versions just before the checkpoint: inside both bounds.
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


class Window:
    """Ids (or group ids) finished, each with a value and the learner version it finished in,
    oldest first; ``forget`` drops the front while it is old by both rules (module doc), and
    at most ``size`` are kept (the oldest fall out first)."""

    def __init__(self, size: int):
        self.size = size
        self.data: OrderedDict[str, tuple[Any, int]] = OrderedDict()

    def put(self, key: str, value: Any = None, version: int = 0) -> None:
        self.data[key] = (value, version)
        self.data.move_to_end(key)
        while len(self.data) > self.size:
            self.data.popitem(last=False)

    def get(self, key: str, default: Any = None) -> Any:
        entry = self.data.get(key)
        return default if entry is None else entry[0]

    def forget(self, before: int) -> int:
        """Drop the entries finished in versions before ``before`` (they are the front: versions
        only grow); how many were dropped."""
        n = 0
        while self.data:
            key, (_, version) = next(iter(self.data.items()))
            if version >= before:
                break
            self.data.popitem(last=False)
            n += 1
        return n

    def __contains__(self, key: str) -> bool:
        return key in self.data

    def __len__(self) -> int:
        return len(self.data)


class Assembler:
    def __init__(self, *, max_staleness: int, group_timeout_s: float,
                 allow_partial_groups: bool, dedup_window: int, filter_flat: bool = False,
                 filter_bound: int = 0, keep_versions: int = 0, keep_seconds: float = 120.0):
        """``keep_versions`` (0: ``max_staleness + 2``, one over the least that is safe) and
        ``keep_seconds``: how long finished ids and closed groups are remembered (module doc);
        ``dedup_window``: at most that many of each, whatever the two say."""
        self.filter_flat, self.filter_bound = filter_flat, filter_bound
        self.filtered = 0  # groups filtered since the last ``new_version``
        self.max_staleness = max_staleness
        self.group_timeout_s = group_timeout_s
        self.allow_partial_groups = allow_partial_groups
        self.keep_versions = max(keep_versions or max_staleness + 2, max_staleness + 1)
        self.keep_seconds = keep_seconds
        self.finished = Window(dedup_window)  # id trained or dropped -> the copies of it seen
        self.closed = Window(dedup_window)  # group_id -> reason for its late members
        self.version = 0  # the learner's version (what ``finished`` entries are kept by)
        self.clock = 0.0  # the learner's running seconds, all its starts together
        self._clock_at: float | None = None  # (the monotonic time ``clock`` was last read at)
        self.version_clock: dict[int, float] = {}  # a version kept by -> ``clock`` when it began
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
        self.version = max(self.version, version)
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
                self.closed.put(item.group_id, STALE, self.version)
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

    def new_version(self, version: int | None = None, now: float | None = None) -> int:
        """A version was published: the filter's bound counts afresh; with ``version`` (the one
        made) and ``now`` (monotonic seconds), what finished long enough ago is forgotten
        (module doc). How many ids were forgotten."""
        self.filtered = 0
        if version is None or now is None:
            return 0
        self.version = max(self.version, version)
        clock = self.tick(now)
        self.version_clock.setdefault(self.version, clock)
        # the oldest version still kept: within keep_versions, or ended (the next one begun)
        # within keep_seconds
        keep = self.version - self.keep_versions + 1
        while keep > 0 and clock - self.version_clock.get(keep, float("-inf")) < self.keep_seconds:
            keep -= 1
        for v in [v for v in self.version_clock if v < keep]:
            del self.version_clock[v]
        self.closed.forget(keep)
        return self.finished.forget(keep)

    def tick(self, now: float) -> float:
        """The learner's running seconds at monotonic ``now`` (across restarts: the
        checkpoint's ``clock`` goes on from where it was)."""
        if self._clock_at is not None:
            self.clock += max(0.0, now - self._clock_at)
        self._clock_at = now
        return self.clock

    def close(self, gid: str, reason: str) -> None:
        """Group ``gid`` is closed with ``reason`` though no member of it was seen (its members
        were lost upstream): a late one is dropped."""
        if gid not in self.closed:
            self.closed.put(gid, reason, self.version)

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
        self.version = max(self.version, version)
        drops = self.purge_stale(version)
        if len(self.ready) < n_groups:
            return None, drops
        groups = []
        for _ in range(n_groups):
            gid = self.ready.popleft()
            group = self.open.pop(gid)
            self.closed.put(gid, GROUP_TIMEOUT if group.group_size < group.items[0].group_size
                            else GROUP_OVERFLOW, self.version)
            for item in group.items:
                self._finish(item)
            groups.append(group)
        return groups, drops

    def _close(self, gid: str, reason: str, detail: str) -> list[Drop]:
        group = self.open.pop(gid, None)
        self.closed.put(gid, reason, self.version)
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
        self.finished.put(item.id, self._pending.pop(item.id, [item.copy]), self.version)

    # -- state --------------------------------------------------------------------------------
    @property
    def waiting_records(self) -> int:
        return len(self._pending)

    def state_dict(self) -> dict[str, Any]:
        """What survives a restart: finished ids (with their copies) and closed groups, each with
        the version it finished in, and the running clock the window is kept by. Records waiting
        in open groups are *not* finished: they come back from Kafka after a restart."""
        return {"finished": [[rid, copies, v] for rid, (copies, v) in self.finished.data.items()],
                "closed": [[gid, reason, v] for gid, (reason, v) in self.closed.data.items()],
                "clock": self.clock, "version_clock": [[v, c] for v, c in sorted(self.version_clock.items())]}

    def load_state_dict(self, state: dict[str, Any], version: int = 0) -> None:
        """``version``: the checkpoint's, what entries of a checkpoint from before versions were
        kept finished in (they are kept a whole window from there)."""
        self.version = max(self.version, version)
        for entry in state.get("finished", []):
            if isinstance(entry, str):  # a bare id: a checkpoint from before copies were kept
                rid, copies, v = entry, [None], version
            else:
                rid, copies, v = (*entry, version)[:3]
            self.finished.put(rid, list(copies), v)
        for entry in state.get("closed", []):
            gid, reason, v = (*entry, version)[:3]
            self.closed.put(gid, reason, v)
        self.clock = float(state.get("clock", 0.0))
        self.version_clock = {int(v): float(c) for v, c in state.get("version_clock", [])}
