"""On-policy distillation under ``streamrl run`` on the real broker: a student (the tiny policy)
and a teacher (the tiny architecture from another seed), with task rewards; the teacher stage
is SIGKILLed once mid-run and restarted, and still every rewarded record reaches the learner's
input annotated (nothing lost), a record redelivered after the kill carries the same
annotation, and the learner trains each record once (it de-duplicates by ``id``)."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from streamrl.bus import Bus
from streamrl.config import BusConfig
from streamrl.records import DeadLetter, Distilled, PolicyVersion, Rewarded
from tests.helpers import gsm8k_run_config, kill_stage, read_topic_sync, run_summary, start_run, wait_for_sync

pytestmark = pytest.mark.e2e

SMALL = ["feed.limit=400", "feed.group_size=4", "learner.groups_per_mini_batch=8",
         "rollout.trajectories_per_version=32", "rollout.max_new_tokens=6", "run.reward_members=1",
         "learner.group_timeout_s=5", "learner.allow_partial_groups=true", "run.restart.backoff_s=0.5",
         "run.timeout_s=300", "distillation.enabled=true", "teacher.seed=1", "teacher.batch_size=8"]


@pytest.mark.timeout(400)
def test_a_teacher_killed_mid_run_loses_nothing_and_the_learner_trains_each_record_once(tmp_path, bootstrap):
    prefix = f"distil{uuid.uuid4().hex[:6]}"
    cfg = BusConfig(bootstrap_servers=bootstrap, topic_prefix=prefix)
    proc = start_run(*gsm8k_run_config(), "--bootstrap-servers", bootstrap, f"run.out_dir={tmp_path}",
                     f"bus.topic_prefix={prefix}", f"learner.consumer_group={prefix}-learner",
                     f"reward.group={prefix}-reward", f"teacher.group={prefix}-teacher", "learner.versions=6", *SMALL,
                     env={"PYTHONUNBUFFERED": "1"})

    def distilled() -> int:
        try:
            return len(read_topic_sync(Bus(cfg), "distilled"))
        except LookupError:  # the run has not created the topics yet
            return 0

    def kill_the_teacher() -> None:
        wait_for_sync(lambda: proc.poll() is None and distilled() >= 16, 150, "the teacher's first records",
                      interval=1.0)
        kill_stage(proc, "teacher")

    summary, _, err = run_summary(proc, 330, kill_the_teacher)
    assert summary["ended"] == "done" and summary["versions"] == 6, summary
    assert summary["restarts"] >= 1 and "distilled" in err and "teacher lag" in err
    rewarded = {r.id for r in (Rewarded.decode(m.value) for m in read_topic_sync(Bus(cfg), "rewarded"))}
    annotated = [Distilled.decode(m.value) for m in read_topic_sync(Bus(cfg), "distilled")]
    dead = {d.record_id for d in (DeadLetter.decode(m.value, 2**26) for m in read_topic_sync(Bus(cfg), "deadletter"))
            if d.stage == "teacher"}
    ids = {d.id for d in annotated}
    assert rewarded and not rewarded - ids - dead, f"{len(rewarded - ids - dead)} rewarded records never annotated"
    assert ids <= rewarded
    first: dict[str, np.ndarray] = {}
    for d in annotated:  # a record redelivered after the kill is annotated again, identically
        lp = d.array("teacher_logprobs")
        assert len(lp) == len(d.array("response_ids")) and np.isfinite(lp).all()
        if d.id in first:
            np.testing.assert_allclose(lp, first[d.id], rtol=1e-5, atol=1e-6)
        first.setdefault(d.id, lp)
    trained = max(PolicyVersion.decode(m.value).trained_records for m in read_topic_sync(Bus(cfg), "policy"))
    assert 0 < trained <= len(ids)  # each id at most once, whatever the topic holds twice
