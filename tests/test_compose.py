"""No Docker engine runs here, so the compose file is checked by reading it: every streamrl
service runs a real CLI verb whose flags parse and whose config files exist, and Prometheus
scrapes each stage on the port the stage is told to serve."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from streamrl.cli import OVERRIDE, build_parser
from streamrl.commands.common import load

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "docker" / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
STREAMRL = {name: svc for name, svc in SERVICES.items() if svc.get("image") == "streamrl:latest"}


def test_the_stack_has_every_part():
    assert {"kafka", "topics", "rollout", "reward", "learner", "prometheus", "alertmanager",
            "grafana"} <= SERVICES.keys()
    assert SERVICES["kafka"]["image"].startswith("apache/kafka")
    assert SERVICES["kafka"]["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft
    # reward scales with --scale reward=N: nothing in it may pin one container
    assert "container_name" not in SERVICES["reward"] and "ports" not in SERVICES["reward"]


@pytest.mark.parametrize("name", sorted(STREAMRL))
def test_each_service_command_is_a_real_verb_that_parses(name, monkeypatch):
    argv = STREAMRL[name]["command"]
    args, extra = build_parser().parse_known_args(argv)
    assert all(OVERRIDE.match(a) for a in extra), f"{name}: unknown arguments {extra}"
    args.overrides = [*getattr(args, "overrides", []), *extra]
    config = getattr(args, "config", None)
    if config:
        assert (ROOT / config).exists(), f"{name}: {config} does not exist"
    monkeypatch.chdir(ROOT)  # the image's working directory is the repository root
    cfg = load(args)  # the whole config, overrides included, checks against the schema
    assert cfg.bus.bootstrap_servers == "kafka:9092"


def test_prometheus_scrapes_each_stage_on_its_metrics_port():
    prom = yaml.safe_load((ROOT / "configs" / "prometheus" / "prometheus.yml").read_text())
    targets = {}
    for job in prom["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            for host in sd["names"]:
                targets[host] = sd["port"]
        for sc in job.get("static_configs", []):
            for t in sc["targets"]:
                host, port = t.rsplit(":", 1)
                targets[host] = int(port)
    for stage in ("rollout", "reward", "learner"):
        ports = [a.split("=", 1)[1] for a in SERVICES[stage]["command"] if a.startswith("metrics.port=")]
        assert ports and targets.get(stage) == int(ports[0]), stage
    for rule_file in prom.get("rule_files", []):
        assert (ROOT / "configs" / "prometheus" / rule_file).exists()
    am = prom["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"][0]
    assert am.split(":")[0] in SERVICES


def test_mounted_configs_exist():
    for name, svc in SERVICES.items():
        for volume in svc.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                path = (ROOT / "docker" / source).resolve()
                if "shared" not in source:  # ../shared sits beside the checkout, not in it
                    assert path.exists(), f"{name}: {source}"
