"""The learning check: a tiny policy learns to answer with digits, driven through the topics
(on the in-memory bus: what is tested is the learning, not Kafka). The test plays the rollout side by
the contract: it loads each version the learner
announces on ``policy`` from its ``weights_uri``, samples groups with their behaviour
log-probs, scores them, and publishes them to ``rewarded``."""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from streamrl.learner.stage import Learner
from streamrl.policy import load_policy
from tests.helpers import GROUP_SIZE, GROUPS, announced, learner_cfg, publish, sample_groups

VERSIONS = 12


def test_mean_reward_rises_through_the_topics(memory_bus, tmp_path):
    bus = memory_bus
    cfg = learner_cfg(tmp_path, lr=1e-2, max_staleness=0, groups_per_mini_batch=GROUPS,
                      versions=VERSIONS, micro_batch_size=GROUPS * GROUP_SIZE)
    torch.manual_seed(0)

    async def go() -> list[float]:
        learner = Learner(bus, cfg)
        task = asyncio.create_task(learner.run())
        means = []
        for round_ in range(VERSIONS):
            latest = await announced(bus, learner, round_)
            model, tok = load_policy(latest.weights_uri)
            records, mean = sample_groups(model, tok, latest.version, round_)
            means.append(mean)
            await publish(bus, records)
        await asyncio.wait_for(task, 60)
        return means

    means = asyncio.run(go())
    print("mean reward per version:", [round(m, 3) for m in means])
    first, last = np.mean(means[:2]), np.mean(means[-3:])
    assert first < 0.2 and last > first + 0.3, means
