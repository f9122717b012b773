"""Shared fixtures. The broker is real: the embedded Tansu by default, Apache Kafka in a
container with STREAMRL_TEST_KAFKA=testcontainers (needs a Docker engine), or an existing
cluster with STREAMRL_TEST_BOOTSTRAP=HOST:PORT."""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest

from streamrl.bus import Bus
from streamrl.config import BusConfig
from streamrl.topics import ensure_topics


@pytest.fixture(scope="session")
def bootstrap() -> str:
    given = os.environ.get("STREAMRL_TEST_BOOTSTRAP")
    if given:
        yield given
        return
    if os.environ.get("STREAMRL_TEST_KAFKA") == "testcontainers":
        from testcontainers.kafka import KafkaContainer

        with KafkaContainer("apache/kafka:3.9.0").with_kraft() as kafka:
            yield kafka.get_bootstrap_server()
        return
    from streamrl.broker import EmbeddedBroker

    with EmbeddedBroker() as broker:
        yield broker.bootstrap


@pytest.fixture
def bus_config(bootstrap: str) -> BusConfig:
    """A bus with a fresh topic prefix per test, its topics created: tests never see each
    other's records or consumer groups."""
    cfg = BusConfig(bootstrap_servers=bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:10]}",
                    commit_interval_s=0.2)
    asyncio.run(ensure_topics(Bus(cfg)))
    return cfg


@pytest.fixture
def bus(bus_config: BusConfig) -> Bus:
    return Bus(bus_config)
