"""The bare aiokafka producer, as ``streamrl bench bus`` measures the bus against it: the same
servers, acks, compression, linger and batch size as ``Producer``, and nothing of streamrl's
(no record encoding, no size check, no metrics)."""

from __future__ import annotations

from aiokafka import AIOKafkaProducer

from streamrl.config import BusConfig


def bare_producer(config: BusConfig) -> AIOKafkaProducer:
    """``start()``, ``send(full_topic_name, value, key=...)`` (a future of the ack), ``stop()``."""
    return AIOKafkaProducer(bootstrap_servers=config.bootstrap_servers, acks="all",
                            compression_type=config.compression, linger_ms=config.linger_ms,
                            max_batch_size=config.max_batch_bytes,
                            max_request_size=config.max_record_bytes)
