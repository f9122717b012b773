"""The learning check: a tiny policy learns to answer with digits, driven through the topics
(on the in-memory bus: what is tested is the learning, not Kafka). The test plays the rollout side by the contract: it loads each version the learner
announces on ``policy`` from its ``weights_uri``, samples groups with their behaviour
log-probs, scores them, and publishes them to ``rewarded``."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import torch

from streamrl.learner.stage import Learner
from streamrl.learner.versions import read_latest_policy
from streamrl.policy import load_policy
from streamrl.records import Rewarded
from tests.helpers import learner_cfg, publish, wait_for

GROUPS, GROUP_SIZE, NEW_TOKENS, VERSIONS = 4, 8, 8, 12


def sample_groups(model, tok, version: int, round_: int) -> tuple[list[Rewarded], float]:
    prompt_ids = tok("digits:", add_special_tokens=False).input_ids
    digits = set(tok("0123456789", add_special_tokens=False).input_ids)
    n = GROUPS * GROUP_SIZE
    started = time.time()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids] * n), attention_mask=torch.ones(n, len(prompt_ids), dtype=torch.long),
                             do_sample=True, top_k=0, top_p=1.0, temperature=1.0,
                             max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                             return_dict_in_generate=True, output_logits=True)
    logp = torch.log_softmax(torch.stack(out.logits, 1).float(), -1)  # [n, T, V]
    records, rewards = [], []
    for i in range(n):
        resp = out.sequences[i, len(prompt_ids):].tolist()
        lp = logp[i, torch.arange(len(resp)), torch.tensor(resp)].numpy()
        reward = sum(t in digits for t in resp) / len(resp)
        rewards.append(reward)
        records.append(Rewarded(
            id=f"r{round_}-{i}", group_id=f"r{round_}-g{i // GROUP_SIZE}", group_size=GROUP_SIZE,
            policy_version=version, data_source="digits", prompt="digits:", response=tok.decode(resp),
            prompt_ids=prompt_ids, response_ids=resp, response_logprobs=lp,
            timings={"generation_started_at": started}, reward=reward, reward_info={},
            scorer={"name": "digits"}))
    return records, float(np.mean(rewards))


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
            await wait_for(lambda: learner.version == round_, what=f"version {round_}")
            latest = await read_latest_policy(bus)
            while latest is None or latest.version < round_:
                await asyncio.sleep(0.05)
                latest = await read_latest_policy(bus)
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
