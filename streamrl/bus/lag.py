"""Each consuming stage's lag, as the stage exports it: ``ConsumerLag``, a ``Checkpoint``'s
``on_commit`` (the runtime makes one per checkpoint through ``Bus.commit_observer``), so every
stage's lag gauges (``streamrl_consumer_lag_records``, ``streamrl_consumer_oldest_unconsumed_age_seconds``,
declared in ``streamrl.metrics``) follow its commits without the stage knowing who reads them."""

from __future__ import annotations

import time

from streamrl import metrics
from streamrl.bus import Consumer, TopicPartition


class ConsumerLag:
    """A consuming stage's lag, exported after each commit (a ``Checkpoint``'s ``on_commit``):
    per partition, log end minus committed position, from the high watermarks the fetcher
    already knows (no extra request), and the age of the oldest record taken but not finished.
    Series of partitions no longer held (revoked in a rebalance) are removed, so a group's
    summed lag does not count a partition twice."""

    def __init__(self) -> None:
        self._exported: set[tuple[str, ...]] = set()

    def __call__(self, consumer: Consumer, positions: dict[TopicPartition, int],
                 oldest: dict[TopicPartition, float]) -> None:
        now = time.time()
        exported = set()
        for tp, pos in positions.items():
            labels = (consumer.stage, consumer.group or "", tp.topic, str(tp.partition))
            end = consumer.highwater(tp)
            if end is not None:
                metrics.CONSUMER_LAG.labels(*labels).set(max(0, end - pos))
            taken_at = oldest.get(tp)
            metrics.CONSUMER_OLDEST_AGE.labels(*labels).set(max(0.0, now - taken_at) if taken_at is not None else 0.0)
            exported.add(labels)
        for labels in self._exported - exported:
            for gauge in (metrics.CONSUMER_LAG, metrics.CONSUMER_OLDEST_AGE):
                try:
                    gauge.remove(*labels)
                except KeyError:
                    pass
        self._exported = exported

