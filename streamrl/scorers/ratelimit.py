"""Request and token rate limits (RPM / TPM) that hold for the whole consumer group.

A hosted judge API limits the *account*, not one process. The reward group has many members, so
each member takes a slice of the group's budget: ``limit * share``, where ``share`` is the
fraction of the source topic's partitions this member owns. The stage calls ``set_share`` on
every assign / revoke, so after a rebalance the slices still add up to the configured limit
(Kafka spreads records by partition, so a member's load follows its partitions too).

Each limit is a token bucket refilled continuously at ``rate * share`` per second with a burst of
``burst_s`` seconds' worth; a short burst keeps the group under the limit over any window, not
just on average per minute.
"""

from __future__ import annotations

import asyncio
import time

from streamrl import metrics


class TokenBucket:
    """An asyncio token bucket. Waiters are served first come, first served (the lock is FIFO).

    ``rate`` is per second; ``0`` means unlimited. ``debit`` may take the level below zero (a
    request that used more tokens than estimated): later waiters then wait the debt off.
    """

    def __init__(self, rate: float, burst_s: float = 1.0):
        self._burst_s = burst_s
        self.rate = 0.0
        self.capacity = 0.0
        self.level = 0.0
        self._stamp = time.monotonic()
        self._lock = asyncio.Lock()
        self.set_rate(rate)
        self.level = self.capacity

    def set_rate(self, rate: float) -> None:
        self._refill()
        self.rate = max(0.0, rate)
        self.capacity = max(1.0, self.rate * self._burst_s)
        self.level = min(self.level, self.capacity)

    def _refill(self) -> None:
        now = time.monotonic()
        self.level = min(self.capacity, self.level + (now - self._stamp) * self.rate)
        self._stamp = now

    def debit(self, amount: float) -> None:
        self._refill()
        self.level -= amount

    async def acquire(self, amount: float = 1.0) -> float:
        """Wait until ``amount`` is available and take it; returns the seconds waited. An amount
        above the burst is capped at the burst (it could never be granted otherwise)."""
        started = time.monotonic()
        async with self._lock:
            while True:
                self._refill()
                need = min(amount, self.capacity)
                if self.level >= need:
                    self.level -= need
                    return time.monotonic() - started
                # rate 0 (this member owns no partitions right now): re-check after a while, a
                # later set_share may open the tap.
                wait = (need - self.level) / self.rate if self.rate > 0 else 0.5
                await asyncio.sleep(min(wait, 0.5))


class RateLimiter:
    """The group-wide RPM / TPM limits as seen by one member. ``rpm`` / ``tpm`` of 0: no limit.

    Tokens are not known before the answer, so ``acquire`` takes an estimate and ``settle``
    corrects the bucket with the usage the server reports."""

    def __init__(self, rpm: float = 0.0, tpm: float = 0.0, *, share: float = 1.0,
                 burst_s: float = 1.0, name: str = "judge"):
        self.rpm, self.tpm, self.name = rpm, tpm, name
        self.share = share
        self._requests = TokenBucket(rpm * share / 60.0, burst_s) if rpm > 0 else None
        self._tokens = TokenBucket(tpm * share / 60.0, burst_s) if tpm > 0 else None

    def set_share(self, fraction: float) -> None:
        """This member's fraction of the group's partitions (0..1)."""
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"share must be within [0, 1], got {fraction}")
        self.share = fraction
        if self._requests:
            self._requests.set_rate(self.rpm * fraction / 60.0)
        if self._tokens:
            self._tokens.set_rate(self.tpm * fraction / 60.0)

    async def acquire(self, tokens_estimate: int = 0) -> float:
        """Wait for one request slot and ``tokens_estimate`` tokens; returns the seconds waited."""
        waited = 0.0
        if self._requests:
            w = await self._requests.acquire(1)
            metrics.RATELIMIT_WAIT.labels(self.name, "requests").inc(w)
            waited += w
        if self._tokens and tokens_estimate > 0:
            w = await self._tokens.acquire(tokens_estimate)
            metrics.RATELIMIT_WAIT.labels(self.name, "tokens").inc(w)
            waited += w
        return waited

    def settle(self, tokens_estimate: int, tokens_used: int | None) -> None:
        """Correct the token bucket once the server has said how many tokens a request used."""
        if self._tokens and tokens_used is not None:
            self._tokens.debit(tokens_used - min(tokens_estimate, self._tokens.capacity))
