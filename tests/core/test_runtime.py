"""The runtime (``streamrl.runtime``) on the real embedded broker: a stage is built on the
runtime's bus and checked before anything connects, the runtime creates the topics, serves the
metrics and turns SIGTERM into a graceful stop; no broker is a user error (exit 2)."""

from __future__ import annotations

import asyncio
import os
import signal
import urllib.request
import uuid
from typing import ClassVar

import pytest

from streamrl import cli
from streamrl.config import BusConfig
from streamrl.errors import ConfigError, StreamrlError
from streamrl.pipeline_config import PipelineConfig
from streamrl.runtime import Runtime
from streamrl.topics import TOPIC_NAMES


class Probe:
    """A stage that records what the runtime gave it and waits for the stop."""

    name: ClassVar[str] = "probe"
    bad = False

    def __init__(self, bus):
        self.bus = bus

    @classmethod
    def from_config(cls, cfg: PipelineConfig, bus) -> "Probe":
        return cls(bus)

    def validate(self) -> None:
        if self.bad:
            raise ConfigError("config field 'probe.x': bad")

    def describe(self) -> str:
        return f"on {self.bus.topic('rollouts')}"

    async def run(self, stop: asyncio.Event) -> None:
        Probe.last = self
        await asyncio.wait_for(stop.wait(), 30)


def _config(bootstrap: str) -> PipelineConfig:
    return PipelineConfig(bus=BusConfig(bootstrap_servers=bootstrap, topic_prefix=f"rt{uuid.uuid4().hex[:8]}"))


def test_a_stage_runs_on_the_runtimes_bus_with_topics_and_metrics_and_stops_on_sigterm(bootstrap, capsys):
    cfg = _config(bootstrap)
    runtime = Runtime(cfg, "probe")
    seen = {}

    async def main(rt: Runtime) -> int:
        serving = asyncio.create_task(rt.serve(Probe))
        while rt.state != "running":
            await asyncio.sleep(0.05)
        seen["states"] = await rt.topics(create=False)
        url = f"http://127.0.0.1:{rt.metrics_port}/metrics"
        seen["metrics"] = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
        os.kill(os.getpid(), signal.SIGTERM)  # the runtime's handler: a graceful stop
        return await serving

    assert runtime.run(main) == 0
    assert Probe.last.bus is runtime.bus and runtime.state == "stopped"
    assert all(s.exists and not s.drift for s in seen["states"]) and len(seen["states"]) == len(TOPIC_NAMES)
    assert "streamrl_" in seen["metrics"]
    out = capsys.readouterr().out
    assert f"probe: on {cfg.bus.topic_prefix}.rollouts" in out and "probe: stopped, on" in out


def test_a_bad_stage_config_fails_before_anything_connects(bootstrap):
    cfg = _config(bootstrap)

    class Bad(Probe):
        bad = True

    with pytest.raises(ConfigError, match="probe.x"):
        Runtime(cfg, "probe").run(lambda rt: rt.serve(Bad))
    states = asyncio.run(Runtime(cfg).topics(create=False))
    assert not any(s.exists for s in states)  # no topic was created for it


def test_no_broker_is_one_line_and_exit_2(monkeypatch, capsys):
    with pytest.raises(StreamrlError, match="no broker"):
        Runtime(PipelineConfig())
    monkeypatch.delenv("STREAMRL_BOOTSTRAP_SERVERS", raising=False)
    assert cli.main(["reward"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("streamrl reward: no broker") and len(err.splitlines()) == 1
