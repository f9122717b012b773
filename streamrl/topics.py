"""The topics: their specs in ``topics/*.json`` (one file per topic), the JSON Schema validators
built from them, and creating / describing them on a broker.

A spec names the topic *without* its prefix (``rollouts``); the full name is
``<prefix>.<name>`` with the prefix from ``BusConfig.topic_prefix`` (default ``streamrl``).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import fastjsonschema

from streamrl.packaged import packaged_dir

TOPIC_NAMES = ("prompts", "rollouts", "rewarded", "policy", "deadletter")


def topics_dir() -> Path:
    """The topic files: packaged with streamrl, or the checkout's ``topics/`` (``streamrl.packaged``)."""
    return packaged_dir("topics")


@dataclass(frozen=True)
class TopicSpec:
    name: str
    partitions: int
    replication_factor: int = 1
    config: dict[str, str] = field(default_factory=dict)
    schema: dict[str, Any] = field(default_factory=dict)
    description: str = ""
    key: str = ""

    def full_name(self, prefix: str) -> str:
        return f"{prefix}.{self.name}" if prefix else self.name


@functools.cache
def load_specs(directory: str | None = None) -> dict[str, TopicSpec]:
    root = Path(directory) if directory else topics_dir()
    specs = {}
    for path in sorted(root.glob("*.json")):
        doc = json.loads(path.read_text())
        spec = TopicSpec(**doc)
        if spec.name != path.stem:
            raise ValueError(f"{path}: name {spec.name!r} does not match the file name")
        specs[spec.name] = spec
    missing = set(TOPIC_NAMES) - specs.keys()
    if missing:
        raise FileNotFoundError(f"no topic spec for {sorted(missing)} in {root}")
    return specs


@functools.cache
def validator_for(name: str) -> Callable[[Any], Any]:
    """The JSON Schema (draft-07) validator of topic ``name``'s records: a function that raises
    ``fastjsonschema.JsonSchemaValueException`` naming the field.

    fastjsonschema compiles the schema (our own file, never anything read from a topic) to
    Python once; it validates a 32 KB trajectory in a few microseconds where jsonschema's
    interpreter took ~250 us, which the bus's hot path cannot afford (``streamrl bench bus``)."""
    return fastjsonschema.compile(load_specs()[name].schema)


@dataclass
class TopicState:
    """What the broker has for one spec, and how it differs."""

    topic: str
    exists: bool
    partitions: int | None = None
    spec_partitions: int = 0
    drift: list[str] = field(default_factory=list)
    created: bool = False


async def ensure_topics(bus, create: bool = True) -> list[TopicState]:
    """Create missing topics (when ``create``) and report drift on existing ones. Never deletes or
    alters: a topic with fewer partitions than its spec is reported, not recreated."""
    from aiokafka.admin import NewTopic
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    specs = load_specs()
    by_topic = {bus.config.topic(s.name): s for s in specs.values()}
    admin = bus.admin_client()
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        states: list[TopicState] = []
        to_create = []
        for name, spec in by_topic.items():
            state = TopicState(topic=name, exists=name in existing, spec_partitions=spec.partitions)
            states.append(state)
            if not state.exists and create:
                rf = bus.config.replication_factor or spec.replication_factor
                to_create.append(NewTopic(name, spec.partitions, rf, topic_configs=dict(spec.config)))
                state.created = True
        if to_create:
            resp = await admin.create_topics(to_create)
            for topic, code, *msg in resp.topic_errors:
                if code not in (0, 36):  # 36: TOPIC_ALREADY_EXISTS (a race with another creator)
                    raise RuntimeError(f"creating topic {topic} failed: error {code} {msg}")
        names = [s.topic for s in states if s.exists or s.created]
        for desc in await admin.describe_topics(names):
            state = next(s for s in states if s.topic == desc["topic"])
            state.exists = True
            state.partitions = len(desc["partitions"])
            if state.partitions < state.spec_partitions:
                state.drift.append(f"partitions {state.partitions} < spec {state.spec_partitions}")
            elif state.partitions > state.spec_partitions:
                state.drift.append(f"partitions {state.partitions} > spec {state.spec_partitions}")
        resources = [ConfigResource(ConfigResourceType.TOPIC, s.topic) for s in states if s.exists]
        for resp in await admin.describe_configs(resources):
            for _code, _msg, _type, topic, entries in resp.resources:
                state = next(s for s in states if s.topic == topic)
                actual = {e[0]: e[1] for e in entries}
                spec = by_topic[topic]
                for key, want in spec.config.items():
                    if key in actual and str(actual[key]) != str(want):
                        state.drift.append(f"{key}={actual[key]} (spec {want})")
        return states
    finally:
        await admin.close()
