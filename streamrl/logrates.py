"""Rate-limited logs of the Kafka client libraries.

With the broker gone, aiokafka (or librdkafka through confluent-kafka) logs the same connection
error several times a second per client; a run with a dozen clients printed tens of thousands of
lines. ``limit_client_logs`` lets the first of each kind through, then one per ``interval_s``
saying how many were held back. streamrl's own messages are not limited: they already report
once per state change or interval.
"""

from __future__ import annotations

import logging
import time

#: loggers of the Kafka clients (aiokafka, kafka-python, confluent-kafka's librdkafka bridge)
CLIENT_LOGGERS = ("aiokafka", "kafka", "confluent_kafka", "rdkafka")


class RateLimit(logging.Filter):
    """At most one record per (logger, message template) per ``interval_s``; the next one that
    passes says how many were suppressed meanwhile."""

    def __init__(self, interval_s: float = 30.0, prefixes: tuple[str, ...] = CLIENT_LOGGERS):
        super().__init__()
        self.interval_s, self.prefixes = interval_s, prefixes
        self._seen: dict[tuple[str, str], list[float]] = {}  # key -> [last passed at, suppressed]

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(self.prefixes):
            return True
        key = (record.name, str(record.msg))
        now = time.monotonic()
        seen = self._seen.get(key)
        if seen is not None and now - seen[0] < self.interval_s:
            seen[1] += 1
            return False
        if seen is not None and seen[1]:
            record.msg = f"{record.msg} ({int(seen[1])} more like this in the last {self.interval_s:.0f} s)"
        self._seen[key] = [now, 0]
        return True


def limit_client_logs(interval_s: float = 30.0) -> None:
    """Install the limit on every handler of the root logger (call after ``basicConfig``)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RateLimit) for f in handler.filters):
            handler.addFilter(RateLimit(interval_s))
