"""Issue 48's objective parts in the learner (the maths is checked against verl in
``test_learner_parity_extra.py``): the learning-rate schedule over versions and across a
resume, ..."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest

from streamrl.learner import checkpoint, schedule
from streamrl.learner.config import VERL_KEYS, LearnerConfig
from streamrl.learner.stage import Learner
from streamrl.records import PolicyVersion
from tests import verl_parity_extra_data
from tests.helpers import learner_cfg, publish, read_topic, wait_for
from tests.test_learner_stage import group

DATA = json.loads(verl_parity_extra_data.DATA)


@pytest.mark.parametrize("sched", DATA["schedules"], ids=lambda s: "{lr_scheduler_type}-{lr_warmup_steps}-"
                         "{lr_warmup_steps_ratio}-{min_lr_ratio}-{num_cycles}-{versions}".format(**s))
def test_the_lr_at_each_version_equals_verls_scheduler(sched):
    """verl's scheduler steps once per training step, the first update at step 0: the update
    towards version v + 1 uses verl's rate after v steps."""
    keys = ("lr_scheduler_type", "lr_warmup_steps", "lr_warmup_steps_ratio", "min_lr_ratio", "num_cycles",
            "versions", "lr")
    cfg = LearnerConfig(**{k: sched[k] for k in keys}).validate()
    ours = [schedule.lr_at(cfg, v) for v in range(sched["versions"] + 1)]
    assert ours == pytest.approx(sched["lrs"], rel=1e-12, abs=1e-15)


def test_verls_optim_keys_map_and_a_schedule_that_needs_a_total_asks_for_versions():
    prefix = "actor_rollout_ref.actor.optim."
    for key in ("lr_scheduler_type", "lr_warmup_steps", "lr_warmup_steps_ratio", "min_lr_ratio", "num_cycles"):
        assert VERL_KEYS[prefix + key] == key
    assert VERL_KEYS[prefix + "warmup_style"] == "lr_scheduler_type"
    from streamrl.errors import ConfigError

    with pytest.raises(ConfigError, match="learner.versions"):
        LearnerConfig(lr_scheduler_type="cosine").validate()
    with pytest.raises(ConfigError, match="lr_scheduler_type"):
        LearnerConfig(lr_scheduler_type="linear").validate()
    LearnerConfig(lr_warmup_steps=3).validate()  # a constant warm-up needs no total


def test_the_schedule_runs_by_version_and_carries_across_a_resume(memory_bus, tmp_path):
    """Cosine with a warm-up over 4 versions: versions 1-2 in a first life, 3-4 after a restart
    from its checkpoint; each version's announced lr is verl's at that step."""
    bus = memory_bus
    cfg = learner_cfg(tmp_path, groups_per_mini_batch=1, versions=4, lr_scheduler_type="cosine",
                      lr_warmup_steps=1, min_lr_ratio=0.1)

    async def life(groups, until, version):
        learner = Learner(bus, cfg)
        task = asyncio.create_task(learner.run())
        await publish(bus, [r for g in groups for r in group(g, version=version)])
        await wait_for(lambda: learner.version >= until and learner.last_checkpoint
                       and checkpoint.load_state(learner.last_checkpoint).version >= until, what=f"v{until}")
        task.cancel()  # the first life is killed; the second ends at learner.versions
        with pytest.raises(asyncio.CancelledError) if until < cfg.versions else contextlib.nullcontext():
            await task

    asyncio.run(life(["s1", "s2"], 2, 0))
    asyncio.run(life(["s3", "s4"], 4, 2))
    announced = {p.version: p.metrics["lr"] for p in map(PolicyVersion.decode,
                                                        (m.value for m in asyncio.run(read_topic(bus, "policy"))))
                 if p.version}  # (version 0: the initial weights, announced at start)
    assert sorted(announced) == [1, 2, 3, 4]
    want = [schedule.lr_at(cfg, v) for v in range(4)]
    assert [announced[v + 1] for v in range(4)] == pytest.approx(want, rel=1e-6)
    assert want[0] == 0.0 and want[1] == cfg.lr and want[3] < want[2] < cfg.lr
