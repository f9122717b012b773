"""The bare Kafka producers ``streamrl bench bus`` measures the bus against, with nothing of
streamrl's (no record encoding, no size check, no metrics, no futures):

- ``bare_producer``: the client the bus uses (librdkafka through confluent-kafka), with the
  bus's own producer settings;
- ``aiokafka_producer``: the other Python client, with the same servers, acks, compression,
  linger and batch size (``pip install streamrl[bench]``; kept out of the core dependencies);
- ``aio_producer``: confluent-kafka's own asyncio producer, with the bus's settings.
"""

from __future__ import annotations

from typing import Any

from streamrl.config import BusConfig
from streamrl.records import DeadLetter


def _settings(config: BusConfig) -> dict[str, Any]:
    from streamrl.bus.kafka import producer_settings

    return producer_settings(config, DeadLetter.size_limit(config.max_record_bytes) + 64 * 1024)


def bare_producer(config: BusConfig, **extra: Any) -> Any:
    """A ``confluent_kafka.Producer`` with the bus's settings (and ``extra`` librdkafka ones):
    ``produce(topic, value, key, on_delivery=...)``, ``poll``, ``flush``."""
    import confluent_kafka

    return confluent_kafka.Producer(dict(_settings(config), **extra))


def aiokafka_producer(config: BusConfig) -> Any:
    """An ``AIOKafkaProducer``: ``start()``, ``send(full_topic_name, value, key=...)`` (a future
    of the ack), ``stop()``."""
    try:
        from aiokafka import AIOKafkaProducer
    except ImportError as exc:
        raise ImportError("the aiokafka baseline needs the bench extra: pip install 'streamrl[bench]'") from exc
    return AIOKafkaProducer(bootstrap_servers=config.bootstrap_servers, acks="all",
                            compression_type=None if config.compression == "none" else config.compression,
                            linger_ms=config.linger_ms, max_batch_size=config.max_batch_bytes,
                            max_request_size=2 * config.max_record_bytes + 128 * 1024)


def aio_producer(config: BusConfig) -> Any:
    """confluent-kafka's own asyncio producer (``confluent_kafka.aio.AIOProducer``, 2.12 and
    later; None before) with the bus's settings: ``await produce(topic, value, key)`` (a future
    of the ack), ``flush()``, ``close()``. Build it inside the running loop."""
    try:
        from confluent_kafka.aio import AIOProducer
    except ImportError:
        return None
    settings = _settings(config)
    settings.pop("logger", None)
    return AIOProducer(settings)
