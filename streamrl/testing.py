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
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, Iterable

from streamrl.bus import Bus
from streamrl.bus.memory import SCHEME
from streamrl.config import BusConfig, load_section
from streamrl.errors import Failure
from streamrl.records import Rewarded, Trajectory
from streamrl.reward.config import RewardConfig
from streamrl.reward.scoring import Scoring
from streamrl.topics import load_specs

__all__ = ["memory_bus", "score", "score_async", "trajectory"]


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
