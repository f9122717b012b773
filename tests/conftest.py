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


def pytest_configure(config: pytest.Config) -> None:
    """Ray keeps every session's directory (logs, sockets, spilled objects) under its temp dir
    after shutdown; the suite's Ray clusters, in this process and in the ``streamrl run``
    subprocesses that inherit the variable, put theirs in one directory of this run, removed at
    the end. A short path: Ray's socket paths must fit 107 bytes."""
    if "RAY_TMPDIR" not in os.environ:
        import tempfile

        os.environ["RAY_TMPDIR"] = config._streamrl_ray_tmp = tempfile.mkdtemp(prefix="streamrl-ray-", dir="/tmp")


def pytest_unconfigure(config: pytest.Config) -> None:
    path = getattr(config, "_streamrl_ray_tmp", None)
    if path:
        import shutil

        shutil.rmtree(path, ignore_errors=True)
        os.environ.pop("RAY_TMPDIR", None)


#: pytest-timeout's limit for an end-to-end run that sets none (pyproject's 300 s is every other
#: test's): a run's own deadlines end it first; this only ends a hang. On a CI machine 1.6x slower
#: than usual, two runs passed 300 s beside three others (on one as slow here: the DAPO run 235 s,
#: the killed learner rank's over 300 s).
E2E_TIMEOUT_S = 600


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(items):
    """The tests that start a local Ray cluster are marked ``ray``: ``make test`` runs them
    alone first (beside end-to-end runs on 2 cores their stages starved), then the rest under
    pytest-xdist (``-n 4 --dist loadgroup``). Run together, they share one worker (two Ray heads on
    one 2-core machine starve each other's placements), and so do the tests that build the wheel
    from this checkout. (``tests/project/test_xdist_groups.py`` checks that the groups hold, pytest
    9.2 silently broke them, and that ``-m ray`` selects exactly the Ray tests.)

    The longest work goes first: a worker takes the next test in collection order when it is
    free, so a pipeline run collected last would start when the others are done and alone make
    the suite's tail (longest-first is the usual cure). The two groups (each one long unit on one
    worker), then the end-to-end runs and the slow tests, then the rest in file order."""
    for item in items:
        if item.fspath.basename.startswith("test_ray_"):
            item.add_marker(pytest.mark.ray)  # `make test` runs these alone: `-m ray`, then `-m "not ray"`
            item.add_marker(pytest.mark.xdist_group("ray"))
        elif "wheel" in item.name:  # they build the wheel in the same checkout (its build/ folder)
            item.add_marker(pytest.mark.xdist_group("wheel"))
        if item.get_closest_marker("e2e") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(E2E_TIMEOUT_S))

    def rank(item) -> int:
        group = item.get_closest_marker("xdist_group")
        if group is not None:
            return 0 if group.args[0] == "ray" else 1
        if item.get_closest_marker("e2e") is not None:
            return 2
        return 3 if item.get_closest_marker("slow") is not None else 4

    items.sort(key=rank)  # stable: file order within each rank


@pytest.fixture
def memory_bus() -> Bus:
    """A bus on a fresh in-process broker (``streamrl.testing.memory_bus``) with every topic:
    for stage logic that a test feeds while the stage runs (``run_stage`` when it does not)."""
    from streamrl.testing import memory_bus as fresh

    return fresh(commit_interval_s=0.2)
