"""The staleness gate: a rollout worker never runs more than ``max_staleness`` versions ahead
of what the learner has consumed, and no lost record costs a slot for good.

The learner turns ``trajectories_per_version`` trajectories into one version. The gate counts
the work that is still *outstanding*: trajectories produced (the rollouts topic's end offsets
summed over partitions, every worker's output, minus ``gate_baseline`` for a topic that already
held records; plus what this worker is generating right now) minus what is finished with: the
records the learner has trained (``trained_records`` of its latest ``streamrl.policy`` record)
and every trajectory dead-lettered on the way: by the reward stage (dead letters whose source
is the rollouts topic) or by the learner (stale, incomplete groups, bad values, and second
copies of a trajectory a restarted worker generated again, ``regenerated``: source rewarded),
counted from ``streamrl.deadletter`` as they happen. The worker
generates a group while outstanding work plus the group stays within ``(max_staleness + 1) *
trajectories_per_version``; at the limit it holds the prompt it took and polls
(``streamrl_rollout_gate_paused_seconds_total``). A new version on the policy topic releases it
at once. The worker's prompts in flight are admitted one at a time (count, then reserve, under
one lock): checked side by side they all saw the same count and passed together, up to
``max_in_flight - 1`` groups past the limit, and those groups reached the learner a version too
old and were dropped as stale (~0.6 % of the on-policy default run, 2-7 % at staleness 1). For
the same reason the count reads this worker's reservations before it asks the end offsets.

Without losses this is the bound ``(v + max_staleness + 1) * trajectories_per_version`` on
everything produced; with losses (a scorer failing on some records, stale records the learner
drops) the freed slots come back, so the run never freezes at the bound. The end offsets come
from ``Reader.end_offsets``, exact on Kafka and on the embedded broker. This worker's
trajectories count as reserved until the broker acknowledges them, so the count never dips
between the end of a generation and the end offset moving.
"""

from __future__ import annotations

import asyncio
import logging
import time

from streamrl import metrics
from streamrl.bus import Bus, Reader
from streamrl.records import DeadLetter, RecordError
from streamrl.rollout.follower import PolicyFollower

log = logging.getLogger(__name__)


class StalenessGate:
    def __init__(self, bus: Bus, follower: PolicyFollower, *, max_staleness: int, per_version: int,
                 baseline: int = 0, poll_s: float = 0.5):
        self.bus, self.follower = bus, follower
        self.max_staleness, self.per_version = max_staleness, per_version
        self.baseline, self.poll_s = baseline, poll_s
        self.enabled = per_version > 0
        self.reserved = 0  # trajectories this worker is generating now
        self.held = False
        self.stopping = asyncio.Event()
        self._admit = asyncio.Lock()  # count-then-reserve is one step (module doc)
        self._reader = Reader(bus, ["rollouts"], "rollout") if self.enabled else None
        self._dead = Reader(bus, ["deadletter"], "rollout") if self.enabled else None
        self.dead_rollouts = 0  # trajectories dead-lettered downstream (reward, learner), seen so far

    async def start(self) -> "StalenessGate":
        for reader in (self._reader, self._dead):
            if reader is not None:
                try:
                    await reader.start()
                except LookupError as exc:
                    raise RuntimeError(f"staleness gate: {exc} (streamrl topics create)") from None
        return self

    async def stop(self) -> None:
        self.stopping.set()
        for reader in (self._reader, self._dead):
            if reader is not None:
                await reader.stop()

    def limit(self) -> int:
        return (self.max_staleness + 1) * self.per_version

    async def outstanding(self) -> int:
        """Trajectories produced or being generated that nobody has finished with yet."""
        # this worker's reservations *before* the end offsets: one delivered while they are asked
        # leaves ``reserved`` and may miss the offsets; counted twice, never missed (the count
        # errs high, a moment's hold)
        reserved = self.reserved
        ends = await self._reader.end_offsets()
        downstream = {self.bus.topic("rollouts"), self.bus.topic("rewarded")}
        for msg in await self._dead.fetch(timeout_ms=0):
            try:
                letter = DeadLetter.decode(msg.value, 2**26)
                # (a rollout worker's own ``stale`` letters never reached rollouts: not counted)
                if letter.source_topic in downstream and letter.stage != "rollout":
                    self.dead_rollouts += 1
            except RecordError:
                continue
        latest = self.follower.latest
        trained = latest.trained_records if latest is not None else 0
        return sum(ends.values()) - self.baseline + reserved - trained - self.dead_rollouts

    async def acquire(self, n: int) -> float:
        """Wait until ``n`` more trajectories may be generated and reserve them; returns the
        seconds held. Raises ``CancelledError`` if the worker stops meanwhile (the prompt is
        then not committed and goes to another worker)."""
        if not self.enabled:
            return 0.0
        started = time.monotonic()
        async with self._admit:
            await self._wait_for_room(n)
            self.reserved += n
        return time.monotonic() - started

    async def _wait_for_room(self, n: int) -> None:
        last = time.monotonic()
        while True:
            if self.stopping.is_set():
                raise asyncio.CancelledError("worker stopping")
            count = await self.outstanding()
            if count + n <= self.limit() or count <= 0:  # a group larger than the limit goes alone
                break
            if not self.held:
                log.info("staleness gate: %d trajectories outstanding, limit %d at learner version %d: "
                         "holding", count, self.limit(), self.follower.version)
            self.held = True
            metrics.ROLLOUT_GATE_HELD.set(1)
            metrics.waiting("rollout", "staleness_gate")
            self.follower.updated.clear()
            try:
                await asyncio.wait_for(self.follower.updated.wait(), self.poll_s)
            except asyncio.TimeoutError:
                pass
            now = time.monotonic()
            metrics.ROLLOUT_GATE_PAUSED.inc(now - last)
            last = now
        if self.held:
            log.info("staleness gate: released at learner version %d", self.follower.version)
        self.held = False
        metrics.ROLLOUT_GATE_HELD.set(0)
        metrics.waiting("rollout", None)

    def release(self, n: int) -> None:
        if self.enabled:
            self.reserved -= n
