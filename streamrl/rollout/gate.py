"""The staleness gate: a rollout worker never runs more than ``max_staleness`` versions ahead
of what the learner has consumed.

The learner turns ``trajectories_per_version`` trajectories into one version. With the learner
at version ``v``, trajectories up to ``(v + max_staleness + 1) * trajectories_per_version`` may
exist; the count is the rollouts topic's end offsets summed over partitions (every worker's
output, read from the broker, so any number of workers share one budget), minus
``gate_baseline`` for a topic that already held records, plus what this worker is generating
right now. While the count is at the limit the worker holds the prompt it took and polls; the
time shows in ``streamrl_rollout_gate_paused_seconds_total``. A new version on the policy topic
releases it at once.

The end offsets come from ``Reader.end_offsets``, exact on Kafka and on the embedded broker
(whose ListOffsets answer is off by the size of the last batch). This worker's trajectories
count as reserved until the broker acknowledges them, so the count never dips between the end
of a generation and the end offset moving.

The bound is approximate by the groups other workers are generating at the same moment, and a
stage that drops trajectories for good (dead letters before the learner) uses up budget: with
``max_staleness=0`` the learner must then make its versions from fewer records than it asks for.
"""

from __future__ import annotations

import asyncio
import logging
import time

from streamrl import metrics
from streamrl.bus import Bus, Reader
from streamrl.rollout.weights import PolicyFollower

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
        self._reader = Reader(bus, ["rollouts"], "rollout") if self.enabled else None

    async def start(self) -> "StalenessGate":
        if self._reader is not None:
            try:
                await self._reader.start()
            except LookupError as exc:
                raise RuntimeError(f"staleness gate: {exc} (streamrl topics create)") from None
        return self

    async def stop(self) -> None:
        self.stopping.set()
        if self._reader is not None:
            await self._reader.stop()

    def limit(self) -> int:
        return (self.follower.version + self.max_staleness + 1) * self.per_version

    async def produced(self) -> int:
        ends = await self._reader.end_offsets()
        return sum(ends.values()) - self.baseline

    async def acquire(self, n: int) -> float:
        """Wait until ``n`` more trajectories may be generated and reserve them; returns the
        seconds held. Raises ``CancelledError`` if the worker stops meanwhile (the prompt is
        then not committed and goes to another worker)."""
        if not self.enabled:
            return 0.0
        started = last = time.monotonic()
        while True:
            if self.stopping.is_set():
                raise asyncio.CancelledError("worker stopping")
            count = await self.produced() + self.reserved
            if count < self.limit():
                break
            if not self.held:
                log.info("staleness gate: %d trajectories, limit %d at learner version %d: holding",
                         count, self.limit(), self.follower.version)
            self.held = True
            metrics.ROLLOUT_GATE_HELD.set(1)
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
        self.reserved += n
        return time.monotonic() - started

    def release(self, n: int) -> None:
        if self.enabled:
            self.reserved -= n
