"""Run the reward stage's logic on in-memory records, without a broker: for your own scorer
tests (and streamrl's). A record takes the same path it takes in a running pipeline: encoded and
decoded against the topic's JSON Schema, then scored by ``reward.scoring.Scoring`` with the
config's table, retries, fallbacks and group hook::

    from streamrl.testing import score, trajectory

    out = score([trajectory(data_source="my_src", response="... 42", ground_truth="42")],
                reward={"scorers": {"mine": {"type": "function", "path": "my_scorer.py:compute_score",
                                             "data_sources": ["my_src"]}}})
    assert out[0].reward == 1.0          # a Rewarded, or a Failure with .reason / .detail

And run a stage, or anything built on the bus, without a broker: ``memory_bus()`` is a ``Bus`` on
a fresh in-process broker (``streamrl.bus.memory``) with every topic created. A stage built from
a config whose ``bus`` is ``memory_bus().config`` shares that broker (same process only)::

    bus = memory_bus()
    cfg = PipelineConfig(); cfg.bus = bus.config
    stage = RewardStage(cfg)   # its StageLoop, Checkpoint and Reader run unchanged

Limits of the in-memory broker: one process; a consumer group has one member, which gets
every partition (no rebalancing); nothing is retained or compacted.

Test a stage's logic end to end with ``run_stage`` (as Bytewax's ``TestingSource`` and
``TestingSink`` do for a dataflow): it sends the input records to their topics (by type), runs
the stage's real ``run(stop)`` on a memory bus in this process, sets ``stop`` when ``until``
holds (the stage drains and commits as it would on a SIGTERM), and returns what the stage
produced, per topic, decoded as records (dead letters included)::

    from streamrl.reward.stage import RewardStage
    from streamrl.testing import run_stage, trajectory

    out = run_stage(RewardStage, [trajectory(id="t0", response="#### 42", ground_truth="42")],
                    until={"rewarded": 1})
    assert [r.reward for r in out["rewarded"]] == [1.0] and out["deadletter"] == []

``stage``: a stage class (built with ``from_config(config, bus)`` on a fresh memory bus;
``config`` a ``PipelineConfig``, defaults otherwise) or a stage built on a memory bus (its
``bus``). ``until``: counts per output topic (at least), a predicate over the outputs, or None
(the stage ends by itself, as a learner with ``versions`` does). Past ``timeout_s`` it fails
saying what it saw. ``out.result`` is what ``run`` returned; ``run_stage_async`` is the same
inside a running event loop (a test that also serves a judge, say).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Union

from streamrl.bus import Bus
from streamrl.bus.memory import SCHEME
from streamrl.config import BusConfig, load_section
from streamrl.errors import Failure
from streamrl.records import DEADLETTER, TOPICS, DeadLetter, Rewarded, Trajectory
from streamrl.reward.config import RewardConfig
from streamrl.reward.scoring import Scoring
from streamrl.topics import load_specs

if TYPE_CHECKING:
    from streamrl.pipeline_config import PipelineConfig
    from streamrl.runtime import Stage

__all__ = ["Outputs", "memory_bus", "run_stage", "run_stage_async", "score", "score_async", "trajectory"]


def memory_bus(**bus: Any) -> Bus:
    """A ``Bus`` on a fresh in-process broker (``memory://<unique name>``) with every topic of
    ``topics/`` created as its spec says; ``bus``: other ``BusConfig`` fields
    (``topic_prefix``, ``commit_interval_s``, ...)."""
    out = Bus(BusConfig(**{**bus, "bootstrap_servers": f"{SCHEME}{uuid.uuid4().hex[:12]}"}))
    assert out.broker is not None
    for name, spec in load_specs().items():
        out.broker.create_topic(out.topic(name), spec.partitions, spec.config)
    return out


def trajectory(**fields: Any) -> Trajectory:
    """A trajectory with test defaults for what a scorer does not look at (``group_id``,
    ``group_size`` 1, ``policy_version`` 0, an empty prompt); ``fields`` set the rest."""
    defaults: dict[str, Any] = {"group_id": "test", "group_size": 1, "policy_version": 0, "prompt": "",
                                "response": "", "data_source": "gsm8k"}
    return Trajectory(**{**defaults, **fields})


def reward_config(reward: RewardConfig | dict[str, Any] | None) -> RewardConfig:
    """A ``RewardConfig`` from one, from the ``reward:`` section of a YAML as a dict, or the
    defaults (the built-in rules)."""
    if isinstance(reward, RewardConfig):
        return reward
    return load_section(RewardConfig, reward or {}, "reward")


async def score_async(records: Iterable[Trajectory | dict[str, Any]],
                      reward: RewardConfig | dict[str, Any] | None = None) -> list[Rewarded | Failure]:
    """Each record's outcome, in order: a ``Rewarded``, or the ``Failure`` that would have sent
    it to the dead-letter topic. All are scored concurrently, as in one reward member."""
    scoring = Scoring(reward_config(reward))

    async def one(record: Trajectory | dict[str, Any]) -> Rewarded | Failure:
        try:
            traj = record if isinstance(record, Trajectory) else trajectory(**record)
            return await scoring.reward(Trajectory.decode(traj.encode()))
        except Failure as exc:
            return exc

    await scoring.start()
    try:
        return list(await asyncio.gather(*(one(r) for r in records)))
    finally:
        await scoring.close()


def score(records: Iterable[Trajectory | dict[str, Any]],
          reward: RewardConfig | dict[str, Any] | None = None) -> list[Rewarded | Failure]:
    """``score_async`` for synchronous tests."""
    return asyncio.run(score_async(records, reward))


class Outputs(dict):
    """What a stage produced while ``run_stage`` ran it: topic short name (``"rewarded"``,
    ``"deadletter"``, ...) -> the records, decoded, in the order they were read (within a
    partition, its log's order); every topic of ``records.TOPICS`` has an entry. ``result``: what
    the stage's ``run`` returned; ``stage``: the stage itself (its counters, its state)."""

    result: Any = None
    stage: Any = None

    def counts(self) -> dict[str, int]:
        return {name: len(records) for name, records in self.items() if records}


Until = Union[Mapping[str, int], Callable[[Outputs], Any], None]


def run_stage(stage: "Stage | type[Stage]", inputs: Iterable[Any] = (), *, config: "PipelineConfig | None" = None,
              until: Until = None, timeout_s: float = 30.0) -> Outputs:
    """Run ``stage`` on ``inputs`` until ``until`` holds (module docstring); ``run_stage_async``
    on a new event loop."""
    return asyncio.run(run_stage_async(stage, inputs, config=config, until=until, timeout_s=timeout_s))


async def run_stage_async(stage: "Stage | type[Stage]", inputs: Iterable[Any] = (), *,
                          config: "PipelineConfig | None" = None, until: Until = None,
                          timeout_s: float = 30.0) -> Outputs:
    """``inputs``: records, each sent to its type's topic and acknowledged before the stage
    starts, in order; a ``(topic, key, value)`` triple sends raw bytes (a poison message, say).
    Outputs are what the topics gained after the inputs were sent."""
    if isinstance(stage, type):
        from streamrl.pipeline_config import PipelineConfig

        bus = memory_bus()
        cfg = dataclasses.replace(config if config is not None else PipelineConfig(), bus=bus.config)
        stage = stage.from_config(cfg, bus)
    bus = stage.bus  # type: ignore[attr-defined]
    broker = bus.broker
    if broker is None:
        raise ValueError(f"run_stage: {type(stage).__name__} is on {bus.config.bootstrap_servers}, not a memory bus "
                         "(build it on streamrl.testing.memory_bus(), or pass its class)")
    async with bus.producer("test") as producer:
        for record in inputs:
            if isinstance(record, tuple):
                topic, key, value = record
                await (await producer.send_bytes(topic, value, key=key))
            else:
                await (await producer.send(record))
    by_name = {bus.topic(t): t for t in TOPICS}
    # each partition's next unread offset: outputs are what the logs gained from here on
    cursors = {name: [len(log) for log in broker.topics[name].logs] for name in by_name if name in broker.topics}
    decoded: dict[str, list[Any]] = {t.name: [] for t in TOPICS}

    def outputs() -> Outputs:
        for name, cursor in cursors.items():
            t = by_name[name]
            limit = DeadLetter.size_limit(bus.largest_record) if t is DEADLETTER else bus.largest_record
            for p, log in enumerate(broker.topics[name].logs):
                decoded[t.name].extend(t.decode(m.value, limit) for m in log[cursor[p]:])
                cursor[p] = len(log)
        return Outputs({name: list(records) for name, records in decoded.items()})

    done = _condition(until)
    stop = asyncio.Event()
    task = asyncio.ensure_future(stage.run(stop))
    deadline = time.monotonic() + timeout_s
    seen = outputs()
    while not task.done() and not (until is not None and done(seen)):
        if time.monotonic() > deadline:
            stop.set()
            await _drain(task, 10.0)
            raise AssertionError(f"run_stage: {until!r} did not hold after {timeout_s} s; "
                                 f"the stage produced {_summary(outputs())}")
        await broker.wait(min(0.05, max(0.0, deadline - time.monotonic())))
        seen = outputs()
    stop.set()
    result = await _drain(task, max(10.0, deadline - time.monotonic()))
    seen = outputs()
    if until is not None and not done(seen):
        raise AssertionError(f"run_stage: the stage ended before {until!r} held; it produced {_summary(seen)}")
    seen.result, seen.stage = result, stage
    return seen


def _condition(until: Until) -> Callable[[Outputs], Any]:
    if until is None or callable(until):
        return until or (lambda out: False)
    wanted = dict(until)
    unknown = set(wanted) - {t.name for t in TOPICS}
    if unknown:
        raise ValueError(f"run_stage: until names {sorted(unknown)}, not topics ({', '.join(t.name for t in TOPICS)})")
    return lambda out: all(len(out[name]) >= n for name, n in wanted.items())


async def _drain(task: "asyncio.Future[Any]", timeout_s: float) -> Any:
    """The stage's result once it has drained; a stage that does not end within ``timeout_s``
    of its stop is a failure."""
    try:
        return await asyncio.wait_for(asyncio.shield(task), timeout_s)
    except asyncio.TimeoutError:
        task.cancel()
        raise AssertionError(f"run_stage: the stage did not stop within {timeout_s:.0f} s of its stop event") from None


def _summary(out: Outputs) -> str:
    """Counts per topic, and each dead letter's reason (what a failing test wants to see)."""
    counts = ", ".join(f"{n} {name}" for name, n in out.counts().items()) or "nothing"
    reasons = sorted({f"{d.reason}: {d.detail[:120]}" for d in out["deadletter"]})
    return counts + (f" (dead letters: {'; '.join(reasons)})" if reasons else "")
