"""The Grafana dashboard (configs/grafana/dashboard.json) and the Prometheus rules name only
metrics that streamrl really exports: every metric in a query, after expanding the recording
rules it reads, is declared in ``streamrl.metrics`` (walked through prometheus_client's
registry, counters and histograms mapped to the series names they expose)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client import REGISTRY

import streamrl.metrics  # noqa: F401 - declares every streamrl metric in the default registry

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "configs" / "grafana" / "dashboard.json"
RULE_FILES = [ROOT / "configs" / "prometheus" / "rules.yml", ROOT / "configs" / "prometheus" / "alerts.yml"]
STAGES = ("rollout", "reward", "learner")

# Series each metric type exposes (prometheus_client drops `_total` / `_info` from the family name).
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "unknown": ("",),
}
# Series Prometheus itself adds to every scrape.
_SCRAPE_SERIES = {"up", "scrape_duration_seconds", "scrape_samples_scraped",
                  "scrape_samples_post_metric_relabeling", "scrape_series_added"}

_PROMQL_WORDS = {
    "and", "or", "unless", "by", "without", "on", "ignoring", "group_left", "group_right",
    "offset", "bool", "sum", "min", "max", "avg", "count", "stddev", "stdvar", "topk", "bottomk",
    "quantile", "count_values", "group", "inf", "nan", "atan2",
}


def exported_series() -> set[str]:
    """Every series name the processes can expose: streamrl's metrics and the default
    process/platform collectors, each metric family mapped to its series."""
    names: set[str] = set()
    for family in REGISTRY.collect():
        names.update(family.name + suffix for suffix in _SUFFIXES[family.type])
    return names | _SCRAPE_SERIES


def metric_names(expr: str) -> set[str]:
    """The metric (or recording-rule) names a PromQL expression reads. Strips strings,
    label matchers, ranges, grouping clauses and Grafana's variables; a name followed by ``(``
    is a function; the remaining identifiers are metrics."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)
    expr = re.sub(r"\$\{?\w+\}?", "1m", expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", expr)
    names = set()
    for m in re.finditer(r"(?<![\w:.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", expr):
        name, call = m.group(1), m.group(2)
        if call or name.lower() in _PROMQL_WORDS:
            continue
        names.add(name)
    return names


def recording_rules() -> dict[str, str]:
    rules = {}
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                if "record" in rule:
                    rules[rule["record"]] = rule["expr"]
    return rules


def expand(names: set[str], rules: dict[str, str]) -> set[str]:
    """Replace recording-rule names by the metrics their expressions read, recursively."""
    out: set[str] = set()
    todo = list(names)
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in rules:
            todo.extend(metric_names(rules[name]))
        else:
            out.add(name)
    return out


def dashboard_panels(dashboard: dict) -> list[dict]:
    panels = []
    for panel in dashboard["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))  # panels of a collapsed row
    return panels


def dashboard_exprs(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard_panels(dashboard) for t in p.get("targets", []) if t.get("expr")]


def test_metric_name_extraction_sees_metrics_and_nothing_else():
    expr = ('sum by (job, le) (rate(streamrl_bus_handle_seconds_bucket{stage="reward",job=~"$job"}[5m]))'
            ' / on (job) group_left (instance) streamrl:consumer_lag_records:sum > 0.5 * up offset 1m')
    assert metric_names(expr) == {"streamrl_bus_handle_seconds_bucket",
                                  "streamrl:consumer_lag_records:sum", "up"}
    assert metric_names('histogram_quantile(0.9, x_bucket) and on (a) y == bool 1') == {"x_bucket", "y"}


def test_exported_series_map_counter_and_histogram_suffixes():
    series = exported_series()
    assert "streamrl_bus_consumed_records_total" in series
    assert "streamrl_bus_handle_seconds_bucket" in series
    assert "streamrl_consumer_lag_records" in series
    assert "streamrl_build_info" in series
    assert "streamrl_bus_consumed_records" not in series


def test_dashboard_loads_with_a_row_per_stage_and_the_learner_row():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["title"] and dashboard["uid"]
    rows = [p["title"].lower() for p in dashboard["panels"] if p["type"] == "row"]
    for stage in STAGES:
        assert any(r.startswith(stage) for r in rows), f"no row for {stage}: {rows}"
    assert any("training" in r for r in rows), rows
    titles = " ".join(p.get("title", "").lower() for p in dashboard_panels(dashboard))
    for needed in ("throughput", "latency", "lag", "errors", "reward", "staleness", "step time"):
        assert needed in titles, f"no panel about {needed}"
    ids = [p["id"] for p in dashboard_panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    for panel in dashboard_panels(dashboard):
        if panel["type"] != "row":
            assert panel.get("targets"), f"panel {panel['title']!r} has no query"
            assert panel["datasource"]["uid"] == "${datasource}"


def test_every_dashboard_query_names_exported_metrics_through_the_recording_rules():
    dashboard = json.loads(DASHBOARD.read_text())
    rules = recording_rules()
    exported = exported_series()
    used_rules = set()
    for expr in dashboard_exprs(dashboard):
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        used_rules |= names & rules.keys()
        missing = expand(names, rules) - exported
        assert not missing, f"{expr!r} reads {sorted(missing)}, which streamrl does not export"
    assert len(used_rules) >= 20, "the dashboard should read the recording rules"


def test_every_rule_reads_exported_metrics():
    rules = recording_rules()
    exported = exported_series()
    for path in RULE_FILES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                missing = expand(metric_names(rule["expr"]), rules) - exported
                name = rule.get("record") or rule.get("alert")
                assert not missing, f"{path.name}: {name} reads {sorted(missing)}, not exported"


def test_every_dashboard_query_parses_in_a_real_prometheus(tmp_path):
    from tests.helpers import PrometheusServer

    dashboard = json.loads(DASHBOARD.read_text())
    with PrometheusServer(tmp_path, {}, RULE_FILES) as prom:
        for expr in dashboard_exprs(dashboard):
            prom.query(expr)  # raises on a parse error (HTTP 400)
