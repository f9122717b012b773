"""The Prometheus rules and the Alertmanager config, checked by the tools that will run them:
``promtool check`` / ``promtool test rules`` (Debian's ``prometheus`` package) and ``amtool``
(Debian's ``prometheus-alertmanager``). A missing tool fails the test, naming the package."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "configs" / "prometheus"
ALERTMANAGER = ROOT / "configs" / "alertmanager" / "alertmanager.yml"
PACKAGES = {"promtool": "prometheus", "amtool": "prometheus-alertmanager"}
# What the issue asks to be alerted on, each mapped to the alert that covers it.
REQUIRED = {
    "reward lag growing": "StreamrlRewardLagGrowing",
    "a stage stalled": "StreamrlStageStalled",
    "judge error ratio high": "StreamrlJudgeErrorRatioHigh",
    "dead-letter rate high": "StreamrlDeadLetterRateHigh",
    "learner starved": "StreamrlLearnerStarved",
    "staleness near the bound": "StreamrlStalenessNearBound",
    "rollout held by the gate": "StreamrlRolloutHeldByGate",
    "broker unreachable": "StreamrlBrokerUnreachable",
    "rollout stage gone": "StreamrlRolloutGone",
    "reward stage gone": "StreamrlRewardGone",
    "learner stage gone": "StreamrlLearnerGone",
}


def tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` is not on PATH: install Debian's {PACKAGES[name]} package "
                    f"(apt-get install -y {PACKAGES[name]}); `make test` does (.ci/test-tools)")
    return path


def run(*args: str | Path, stdout_only: bool = False) -> str:
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(map(str, args))} failed:\n{out}"
    return proc.stdout if stdout_only else out


def alerts() -> list[dict]:
    doc = yaml.safe_load((PROM / "alerts.yml").read_text())
    return [r for g in doc["groups"] for r in g["rules"] if "alert" in r]


def test_promtool_checks_the_rule_files():
    out = run(tool("promtool"), "check", "rules", PROM / "rules.yml", PROM / "alerts.yml")
    assert out.count("SUCCESS") == 2, out


def test_promtool_checks_the_prometheus_config_and_the_rules_it_loads():
    out = run(tool("promtool"), "check", "config", PROM / "prometheus.yml")
    assert "rules.yml" in out and "alerts.yml" in out, out
    config = yaml.safe_load((PROM / "prometheus.yml").read_text())
    ports = {job["job_name"]: job["dns_sd_configs"][0]["port"] for job in config["scrape_configs"]
             if "dns_sd_configs" in job}
    assert ports == {"rollout": 9101, "reward": 9102, "learner": 9103, "archive": 9104, "sandbox": 8080}
    assert config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["alertmanager:9093"]


def test_promtool_unit_tests_of_every_alert_pass():
    out = run(tool("promtool"), "test", "rules", PROM / "alerts_test.yml")
    assert "SUCCESS" in out, out


def test_every_alert_has_a_severity_a_summary_a_runbook_and_both_test_cases():
    cases = yaml.safe_load((PROM / "alerts_test.yml").read_text())["tests"]
    fires, silent = set(), set()
    for case in cases:
        for check in case.get("alert_rule_test", []):
            (fires if check.get("exp_alerts") else silent).add(check["alertname"])
    names = [a["alert"] for a in alerts()]
    assert len(names) == len(set(names)), "an alert name repeats"
    assert set(REQUIRED.values()) <= set(names)
    for rule in alerts():
        name = rule["alert"]
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert rule["annotations"].get("summary"), f"{name} has no summary"
        assert rule["annotations"].get("runbook"), f"{name} has no runbook"
        assert name in fires, f"{name}: no test case where it fires"
        assert name in silent, f"{name}: no test case where it stays silent"


def test_alertmanager_routes_by_severity():
    am = tool("amtool")
    run(am, "check-config", ALERTMANAGER)

    def receiver(*labels: str) -> str:
        out = run(am, "config", "routes", "test", f"--config.file={ALERTMANAGER}", *labels,
                  stdout_only=True)
        return out.strip()

    for rule in alerts():
        severity = rule["labels"]["severity"]
        expected = {"critical": "pager", "warning": "team"}[severity]
        assert receiver(f"alertname={rule['alert']}", f"severity={severity}") == expected, rule["alert"]
    assert receiver("alertname=SomethingElse") == "team"  # unlabelled alerts are not lost
