"""Topic specs, creating and describing topics on the broker, the embedded broker's CLI, and the
config schema's errors."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from streamrl.broker import BrokerError, EmbeddedBroker, free_port
from streamrl.bus import Bus
from streamrl.config import ConfigError
from streamrl.pipeline_config import PipelineConfig, load_config
from streamrl.records import RECORD_TYPES, TOPICS, topic_of
from streamrl.topics import TOPIC_NAMES, ensure_topics, load_specs
from tests.helpers import read_topic_sync


def test_every_topic_has_a_spec_with_a_schema():
    specs = load_specs()
    assert set(specs) == set(TOPIC_NAMES)
    for spec in specs.values():
        assert spec.partitions >= 1 and spec.schema["type"] == "object"
        assert "max.message.bytes" in spec.config
    assert specs["policy"].config["cleanup.policy"] == "compact"
    # the rewarded schema is the trajectory's plus the reward fields
    rollouts, rewarded = specs["rollouts"].schema, specs["rewarded"].schema
    assert set(rollouts["properties"]) - {"schema"} <= set(rewarded["properties"])
    assert {"reward", "reward_info", "scorer", "scored_at"} <= set(rewarded["required"])
    # every record type names the schema of a topic that exists
    assert {topic_of(cls).name for cls in RECORD_TYPES.values()} == {t.name for t in TOPICS} == set(TOPIC_NAMES)


def test_create_is_idempotent_and_drift_is_reported_without_touching_data(bus_config):
    bus = Bus(bus_config)
    again = asyncio.run(ensure_topics(bus))  # the fixture created them already
    assert all(s.exists and not s.created and not s.drift for s in again)

    # a topic someone made by hand with too few partitions, holding data
    other = Bus(type(bus_config)(bootstrap_servers=bus_config.bootstrap_servers,
                                 topic_prefix=bus_config.topic_prefix + "x"))

    async def make_small_topic():
        async with other.admin() as admin:
            by_hand = replace(load_specs()["rollouts"], partitions=2, replication_factor=1, config={})
            await admin.create_topics({other.topic("rollouts"): by_hand})
        async with other.producer("test") as p:
            await (await p.send_bytes("rollouts", b'{"keep": "me"}', key=b"k"))

    asyncio.run(make_small_topic())
    states = {s.topic: s for s in asyncio.run(ensure_topics(other))}
    small = states[other.topic("rollouts")]
    assert not small.created and small.partitions == 2
    assert any("partitions 2 < spec 8" in d for d in small.drift)
    assert states[other.topic("rewarded")].created
    assert [m.value for m in read_topic_sync(other, "rollouts", 1)] == [b'{"keep": "me"}']


def run_cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "streamrl", *args], capture_output=True, text=True,
                          timeout=60, **kw)


def test_topics_cli_creates_then_describes(bootstrap):
    prefix = f"cli{os.getpid()}"
    created = run_cli("topics", "create", "--bootstrap-servers", bootstrap, f"bus.topic_prefix={prefix}")
    assert created.returncode == 0, created.stderr
    assert created.stdout.count("created") == len(TOPIC_NAMES)
    described = run_cli("topics", "describe", f"bus.topic_prefix={prefix}",
                        env=dict(os.environ, STREAMRL_BOOTSTRAP_SERVERS=bootstrap))
    assert described.returncode == 0, described.stderr
    assert f"{prefix}.rollouts" in described.stdout and "8/8 partitions" in described.stdout


def test_broker_cli_prints_bootstrap_first_and_stops_on_sigterm():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "streamrl", "broker", "--listen", f"127.0.0.1:{port}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stdout.readline().strip()
        assert first == f"bootstrap: 127.0.0.1:{port}"
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass  # clients can connect as soon as the line is printed
        collision = run_cli("broker", "--listen", f"127.0.0.1:{port}")
        assert collision.returncode == 1 and "already in use" in collision.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    time.sleep(0.2)
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1)


def test_missing_broker_binary_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("STREAMRL_TANSU_BIN", "/nonexistent/tansu")
    with pytest.raises(BrokerError, match="STREAMRL_TANSU_BIN"):
        EmbeddedBroker().start()


def test_config_errors_name_the_field(tmp_path):
    cfg = load_config(overrides=["bus.linger_ms=9", "bus.topic_prefix=abc"])
    assert isinstance(cfg, PipelineConfig) and cfg.bus.linger_ms == 9 and cfg.bus.topic("x") == "abc.x"
    with pytest.raises(ConfigError, match="bus.lingr_ms"):
        load_config(overrides=["bus.lingr_ms=9"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("bus:\n  session_timeout_ms: soon\n")
    with pytest.raises(ConfigError, match="bus.session_timeout_ms"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_topics_cli_sizes_the_topics_from_the_config_and_never_shrinks_them(bootstrap):
    prefix = f"cli{os.getpid()}sized"
    created = run_cli("topics", "create", "--bootstrap-servers", bootstrap, f"bus.topic_prefix={prefix}",
                      "topics.rollouts.partitions=16")
    assert created.returncode == 0, created.stderr
    lines = {line.split()[0]: line for line in created.stdout.splitlines() if line.strip()}
    assert "16/16 partitions" in lines[f"{prefix}.rollouts"] and "8/8 partitions" in lines[f"{prefix}.prompts"]
    # the config back at the spec's 8: the 16 stay, reported as drift (exit 1), not shrunk
    described = run_cli("topics", "describe", "--bootstrap-servers", bootstrap, f"bus.topic_prefix={prefix}")
    assert described.returncode == 1
    assert "DRIFT: partitions 16 > spec 8" in described.stdout
