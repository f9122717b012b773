"""The topics: their specs in ``topics/*.json`` (one file per topic), the JSON Schema validators
built from them, and creating / describing them on a broker.

A spec names the topic *without* its prefix (``rollouts``); the full name is
``<prefix>.<name>`` with the prefix from ``BusConfig.topic_prefix`` (default ``streamrl``).
A ``Topic`` handle pairs a topic with the record type it carries; the handles are declared once,
beside the record types (``streamrl.records``: ``PROMPTS``, ``ROLLOUTS``, ``REWARDED``,
``POLICY``, ``DEADLETTER``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Generic, TypeVar

import fastjsonschema

from streamrl.packaged import packaged_dir

TOPIC_NAMES = ("prompts", "rollouts", "rewarded", "policy", "deadletter", "eval", "distilled")

R = TypeVar("R")


@dataclass(frozen=True)
class Topic(Generic[R]):
    """A topic (short name, as in its spec file) and the record type it carries: a producer
    finds a record's topic by its type (``Producer.send(record)``), a consumer decodes what it
    reads with ``decode``."""

    name: str
    record: type[R]

    @property
    def spec(self) -> "TopicSpec":
        return load_specs()[self.name]

    def decode(self, data: bytes | None, max_bytes: int | None = None) -> R:
        """A message's bytes as this topic's record, or ``RecordError`` saying why not."""
        decode = self.record.decode  # type: ignore[attr-defined]
        return decode(data) if max_bytes is None else decode(data, max_bytes)

    def __str__(self) -> str:
        return self.name


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


def sized_specs(topics: Any) -> dict[str, TopicSpec]:
    """Every spec with the partitions of ``topics`` (a ``config.TopicsConfig``:
    ``topics.<name>.partitions``, 0 keeping the spec's); a ``ConfigError`` names a bad count."""
    return {name: dataclasses.replace(spec, partitions=topics.partitions(name, spec.partitions))
            for name, spec in load_specs().items()}


@dataclass
class TopicState:
    """What the broker has for one spec, and how it differs."""

    topic: str
    exists: bool
    partitions: int | None = None
    spec_partitions: int = 0
    drift: list[str] = field(default_factory=list)
    created: bool = False


async def ensure_topics(bus, create: bool = True, specs: dict[str, TopicSpec] | None = None) -> list[TopicState]:
    """Create missing topics (when ``create``) and report drift on existing ones. Never deletes or
    alters: a topic with fewer partitions than its spec is reported, not recreated, and one with
    more is not shrunk. ``specs``: short topic name -> spec (default: every spec in ``topics/``;
    ``sized_specs`` gives them the config's partitions)."""
    by_topic = {bus.topic(name): spec for name, spec in (load_specs() if specs is None else specs).items()}
    async with bus.admin() as admin:
        existing = await admin.list_topics()
        states = [TopicState(topic=name, exists=name in existing, spec_partitions=spec.partitions)
                  for name, spec in by_topic.items()]
        missing = [s for s in states if not s.exists] if create else []
        await admin.create_topics({s.topic: by_topic[s.topic] for s in missing})
        for state in missing:
            state.created = True
        counts = await admin.partition_counts([s.topic for s in states if s.exists or s.created])
        for state in states:
            if state.topic not in counts:
                continue
            state.exists = True
            state.partitions = counts[state.topic]
            if state.partitions < state.spec_partitions:
                state.drift.append(f"partitions {state.partitions} < spec {state.spec_partitions}")
            elif state.partitions > state.spec_partitions:
                state.drift.append(f"partitions {state.partitions} > spec {state.spec_partitions}")
        configs = await admin.topic_configs([s.topic for s in states if s.exists])
        for state in states:
            actual = configs.get(state.topic, {})
            for key, want in by_topic[state.topic].config.items():
                if key in actual and str(actual[key]) != str(want):
                    state.drift.append(f"{key}={actual[key]} (spec {want})")
        return states
