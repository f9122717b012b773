"""End to end: a real Prometheus (Debian's ``prometheus`` binary) scrapes a real ``streamrl
reward`` process whose LLM judge is down, evaluates the shipped recording rules and alerts, and
reports the judge alert firing through its own HTTP API.

The only liberty taken with the shipped rules: a test copy of ``alerts.yml`` with every ``for:``
cut to seconds, so the test does not wait five minutes. Thresholds and expressions are the real
ones. Scrapes and rule evaluations run every second.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from streamrl.net import free_port
from streamrl.bus import Bus
from streamrl.config import BusConfig
from tests.helpers import ROOT, PrometheusServer, stop, trajectory

pytestmark = pytest.mark.e2e

RULES = ROOT / "configs" / "prometheus"
JUDGE_ALERT = "StreamrlJudgeErrorRatioHigh"


def fast_alerts_copy(workdir: Path) -> Path:
    """``alerts.yml`` with every ``for:`` cut to 2 s; everything else as shipped."""
    doc = yaml.safe_load((RULES / "alerts.yml").read_text())
    for group in doc["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = "2s"
    path = workdir / "alerts.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.fixture
def dead_judge_url():
    """A URL whose port is bound but never listened on: every connection is refused, and no
    other process can take the port while the test runs."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}/v1"


def _start_reward(tmp_path: Path, bus_config: BusConfig, metrics_port: int,
                  judge_url: str | None = None) -> subprocess.Popen:
    """``streamrl reward`` as a child process, its log in ``tmp_path/reward.log``; with
    ``judge_url``, records of data source ``e2e_judged`` are scored by a judge there."""
    reward: dict = {
        "group": "e2e-reward",
        "unavailable_backoff_max_s": 1.0,
        "drain_timeout_s": 1.0,  # held records are redelivered, not waited for
    }
    if judge_url:
        reward["scorers"] = {"judge": {
            "type": "judge", "data_sources": ["e2e_judged"],
            "judge": {"urls": [judge_url], "model": "judge", "timeout_s": 2.0, "max_retries": 1,
                      "backoff_s": 0.05, "backoff_max_s": 0.1, "health_interval_s": 1.0},
        }}
    config = {"metrics": {"host": "127.0.0.1", "port": metrics_port}, "reward": reward}
    path = tmp_path / "reward.yaml"
    path.write_text(yaml.safe_dump(config))
    log = open(tmp_path / "reward.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamrl", "reward", "--config", str(path),
         "--bootstrap-servers", bus_config.bootstrap_servers,
         f"bus.topic_prefix={bus_config.topic_prefix}", "bus.commit_interval_s=0.5"],
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    log.close()
    return proc


def _publish(bus: Bus, n: int) -> None:
    async def main():
        async with bus.producer("test") as producer:
            acks = [await producer.send(trajectory(full=True,
                id=f"judged-{i}", group_id=f"g{i}", group_size=1, data_source="e2e_judged"))
                for i in range(n)]
            await asyncio.gather(*acks)
    asyncio.run(main())


def _firing(prom: PrometheusServer, name: str) -> list[dict]:
    return [a for a in prom.api("alerts")["alerts"]
            if a["labels"]["alertname"] == name and a["state"] == "firing"]


def test_judge_down_fires_the_judge_alert_through_a_real_prometheus(tmp_path, bus, bus_config,
                                                                     dead_judge_url):
    metrics_port = free_port()
    reward = _start_reward(tmp_path, bus_config, metrics_port, judge_url=dead_judge_url)
    try:
        rules = [RULES / "rules.yml", fast_alerts_copy(tmp_path)]
        with PrometheusServer(tmp_path, {"reward": [f"127.0.0.1:{metrics_port}"]}, rules) as prom:
            # Scraped before any record exists, so the judge's counters are seen from the start.
            prom.wait_for("the reward service scraped",
                          lambda: reward.poll() is None and prom.query('up{job="reward"} == 1')
                          and prom.query('streamrl_build_info{job="reward"}'), 60)
            assert reward.poll() is None, (tmp_path / "reward.log").read_text()[-3000:]
            _publish(bus, 4)

            alerts = prom.wait_for(f"{JUDGE_ALERT} firing", lambda: _firing(prom, JUDGE_ALERT), 90)
            assert alerts[0]["labels"]["router"] == "judge"
            assert alerts[0]["labels"]["url"].startswith(dead_judge_url.removesuffix("/v1"))
            assert alerts[0]["labels"]["severity"] == "warning"
            assert "fail" in alerts[0]["annotations"]["summary"]
            assert alerts[0]["annotations"]["runbook"]

            # The outage is visible the other ways the rules promise: the records are held,
            # taken and waiting (their age grows), and nothing reached `rewarded` as a 0.
            prom.wait_for("records held by the reward stage",
                          lambda: prom.query('sum(streamrl_reward_held_records{job="reward"}) > 0'), 30)
            prom.wait_for("the oldest unconsumed record ageing",
                          lambda: prom.query('streamrl:consumer_oldest_unconsumed_age_seconds:max'
                                             '{job="reward",stage="reward"} > 2'), 30)
            prom.wait_for("the four held records counted as the group's lag", lambda: prom.query(
                'sum(streamrl:consumer_lag_records:sum{job="reward",stage="reward",group="e2e-reward"})'
                ' == 4'), 30)
            produced = prom.query('sum(streamrl_bus_produced_records_total{job="reward",'
                                  'topic=~".*rewarded"}) > 0')
            assert produced == [], f"records were scored although the judge is down: {produced}"
            assert reward.poll() is None, (tmp_path / "reward.log").read_text()[-3000:]
    finally:
        stop(reward)
    assert reward.returncode == 0, (tmp_path / "reward.log").read_text()[-3000:]


def test_a_lost_broker_fires_the_broker_alert_through_a_real_prometheus(tmp_path):
    """A reward member on a broker of its own; the broker is stopped under it. The member's
    background metadata probe notices while it is idle (nothing to send or commit)."""
    from streamrl.broker import EmbeddedBroker
    from streamrl.topics import ensure_topics

    broker = EmbeddedBroker()
    broker.start()
    reward = None
    try:
        bus_config = BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix="lost")
        asyncio.run(ensure_topics(Bus(bus_config)))
        metrics_port = free_port()
        reward = _start_reward(tmp_path, bus_config, metrics_port)
        rules = [RULES / "rules.yml", fast_alerts_copy(tmp_path)]
        with PrometheusServer(tmp_path, {"reward": [f"127.0.0.1:{metrics_port}"]}, rules) as prom:
            reachable = 'streamrl_bus_broker_reachable{job="reward",stage="reward",client="consumer"}'
            prom.wait_for("the broker reachable", lambda: reward.poll() is None
                          and prom.query(f"{reachable} == 1"), 60)
            assert not _firing(prom, "StreamrlBrokerUnreachable")
            broker.stop()
            prom.wait_for("the broker unreachable", lambda: prom.query(f"{reachable} == 0"), 60)
            alerts = prom.wait_for("StreamrlBrokerUnreachable firing",
                                   lambda: _firing(prom, "StreamrlBrokerUnreachable"), 30)
            assert alerts[0]["labels"]["severity"] == "critical"
            assert alerts[0]["labels"]["stage"] == "reward"
            assert reward.poll() is None, "the member died instead of waiting for the broker"
    finally:
        stop(reward)
        broker.stop()
