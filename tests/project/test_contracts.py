"""``docs/contracts.md`` against the code: the record tables against ``topics/*.json`` (every
field, its JSON type, whether it is required), the topic table against the specs, the verbs
against the CLI, and the bring-your-own-producer example published with a bare Kafka client
and scored on the real broker."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import orjson
from aiokafka import AIOKafkaProducer

from streamrl.cli import VERBS
from streamrl.pipeline_config import PipelineConfig
from streamrl.records import Rewarded
from streamrl.reward.stage import RewardStage
from streamrl.topics import load_specs
from tests.helpers import read_topic

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "contracts.md").read_text()


def section(title: str) -> str:
    """The text under the heading ``title`` (any level), up to the next heading of that level or above."""
    m = re.search(rf"^(#+) {re.escape(title)}\n", DOC, re.M)
    assert m, f"no section {title!r} in docs/contracts.md"
    end = re.compile(rf"^#{{1,{len(m.group(1))}}} ", re.M).search(DOC, m.end())
    return DOC[m.end():end.start() if end else len(DOC)]


def table(text: str) -> list[list[str]]:
    """The rows of the first table in ``text``, past its header and rule."""
    lines = text[text.index("\n|") + 1:].splitlines()
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in lines[:next((i for i, line in enumerate(lines) if not line.startswith("|")), len(lines))]]
    return rows[2:]


def json_type(prop: dict) -> str:
    """A schema property's type as the page writes it."""
    if "const" in prop:
        return json.dumps(prop["const"])
    if "anyOf" in prop:
        return " or ".join(json_type(p) for p in prop["anyOf"])
    kind = prop["type"]
    return " or ".join(kind) if isinstance(kind, list) else kind


def test_every_documented_record_field_matches_its_schema():
    for name, spec in load_specs().items():
        documented = {row[0].strip("`"): (row[1], row[2] == "yes") for row in table(section(f"`streamrl.{name}`"))}
        schema = spec.schema
        actual = {field: (json_type(prop), field in schema.get("required", []))
                  for field, prop in schema["properties"].items()}
        differ = sorted(k for k in documented.keys() | actual.keys() if documented.get(k) != actual.get(k))
        assert documented == actual, f"docs/contracts.md and topics/{name}.json disagree on {differ}"


def test_the_topic_table_and_the_verbs_match():
    specs = load_specs()
    rows = {row[0].strip("`"): row for row in table(section("Topics"))}
    assert rows.keys() == {f"streamrl.{name}" for name in specs}
    for name, spec in specs.items():
        assert int(rows[f"streamrl.{name}"][4]) == spec.partitions, name
    assert set(re.findall(r"`(\w+)`", section("CLI verbs"))) == set(VERBS)


def test_the_bring_your_own_producer_record_is_scored(bus_config):
    """The page's record, published with a bare Kafka client (not streamrl's bus), comes out of
    a reward member on ``rewarded``, scored."""
    block = re.search(r"```json\n(.*?)```", section("Bring your own producer"), re.S).group(1)
    record = json.loads(block)
    cfg = PipelineConfig()
    cfg.bus = bus_config
    stage = RewardStage(cfg)

    async def main() -> list:
        producer = AIOKafkaProducer(bootstrap_servers=bus_config.bootstrap_servers)
        await producer.start()
        try:
            await producer.send_and_wait(f"{bus_config.topic_prefix}.rollouts", orjson.dumps(record),
                                         key=record["group_id"].encode())
        finally:
            await producer.stop()
        stop = asyncio.Event()
        run = asyncio.create_task(stage.run(stop))
        try:
            return await read_topic(stage.bus, "rewarded", 1, timeout_s=60)
        finally:
            stop.set()
            await run

    out = asyncio.run(main())
    assert len(out) == 1
    scored = Rewarded.decode(out[0].value)
    assert scored.id == record["id"] and scored.reward == 1.0 and scored.scorer["name"] == "gsm8k"
    assert out[0].key == record["group_id"].encode()


def test_the_layout_table_matches_the_tree():
    """Every module and package directly under ``streamrl/`` has a row in the layout table of
    ``docs/development/layout.md`` (in its first column), and every ``streamrl/...`` path the
    table names exists."""
    root = Path(__file__).resolve().parents[2]
    text = (root / "docs" / "development" / "layout.md").read_text()
    table = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    first_column = {tok.rstrip("/") for line in rows for tok in re.findall(r"`([^`]+)`", line.split("|")[1])}
    named = {tok.rstrip("/") for line in rows for tok in re.findall(r"`(streamrl/[\w/.]+)`", line)}
    pkg = root / "streamrl"
    tree = {f"streamrl/{p.name}" for p in pkg.iterdir()
            if (p.suffix == ".py" and p.name != "__init__.py") or (p.is_dir() and (p / "__init__.py").exists())}
    assert not sorted(tree - first_column), f"no layout row for: {sorted(tree - first_column)}"
    assert not [n for n in named if not (root / n).exists()], [n for n in named if not (root / n).exists()]
