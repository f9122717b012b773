"""``streamrl.testing``: the reward stage's own scoring path on in-memory records, and
``run_stage`` (a stage's real loop on the in-memory bus), no broker."""

from __future__ import annotations

import sys
import textwrap

import pytest

from streamrl.errors import Failure
from streamrl.loading import load_object
from streamrl.records import Rewarded
from streamrl.testing import run_stage, score, trajectory


def test_builtin_rules_user_function_and_failures_without_a_broker(tmp_path):
    user = tmp_path / "my_scorer.py"
    user.write_text(textwrap.dedent("""
        def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
            if solution_str == "boom":
                raise RuntimeError("scorer bug")
            return {"score": float(solution_str == ground_truth), "checked": True}
    """))
    reward = {"max_attempts": 2, "retry_backoff_s": 0.01, "scorers": {
        "mine": {"type": "function", "path": f"{user}:compute_score", "executor": "inline",
                 "data_sources": ["my_src"]}}}
    out = score([
        trajectory(data_source="gsm8k", response="so the answer is #### 42", ground_truth="42"),
        trajectory(data_source="gsm8k", response="#### 41", ground_truth="42"),
        {"data_source": "my_src", "response": "yes", "ground_truth": "yes"},
        trajectory(data_source="my_src", response="boom", ground_truth="x"),
        trajectory(data_source="nobody", response="1"),
    ], reward)
    assert [type(o) for o in out] == [Rewarded, Rewarded, Rewarded, Failure, Failure]
    assert out[0].reward == 1.0 and out[1].reward == 0.0
    assert out[2].reward == 1.0 and out[2].reward_info["checked"] is True
    assert out[2].scorer["name"] == "mine"
    assert out[3].reason == "scorer_error" and "after 2 attempts" in out[3].detail
    assert out[4].reason == "unknown_data_source"


def test_a_record_the_schema_refuses_fails_as_on_the_topic():
    (out,) = score([trajectory(group_size=0, response="#### 1", ground_truth="1")])
    assert isinstance(out, Failure) and out.reason == "schema"


def test_a_bad_reward_config_names_the_field():
    from streamrl.errors import ConfigError

    with pytest.raises(ConfigError, match="max_attemptz"):
        score([], {"max_attemptz": 2})


BLOCKING = '''
import threading, time

lock = threading.Lock()
now = peak = 0

def remote_judge(data_source, solution_str, ground_truth, extra_info=None):
    """A verl-style reward function that blocks on a remote call (0.5 s)."""
    global now, peak
    with lock:
        now += 1
        peak = max(peak, now)
    time.sleep(0.5)
    with lock:
        now -= 1
    return 1.0, solution_str, ground_truth  # the reward agent's (score, query, response) shape
'''


def test_blocking_sync_functions_run_concurrently_in_threads_by_default(tmp_path):
    """With default settings a sync function runs in threads, ``reward.thread_concurrency`` (64)
    at once: 128 blocking calls overlap 64 deep (process workers would run 2 at a time), and the
    tuple result's extra items land in ``reward_info``."""
    user = tmp_path / "remote.py"
    user.write_text(BLOCKING)
    out = score([trajectory(data_source="remote", response=f"r{i}", ground_truth="g") for i in range(128)],
                {"scorers": {"remote": {"type": "function", "path": f"{user}:remote_judge"}}})
    assert all(isinstance(o, Rewarded) and o.reward == 1.0 for o in out)
    assert out[5].reward_info["extra"] == ["r5", "g"]
    module = sys.modules[load_object(f"{user}:remote_judge").__module__]
    assert module.peak == 64  # the default cap, reached


def test_run_stage_sends_by_type_stops_on_the_condition_and_fails_saying_what_it_saw():
    from streamrl.pipeline_config import PipelineConfig
    from streamrl.reward.stage import RewardStage

    cfg = PipelineConfig()
    cfg.reward.process_workers = 1
    own_bus = cfg.bus
    inputs = [trajectory(id=f"t{i}", group_id=f"g{i}", response=f"#### {40 + i}", ground_truth="40") for i in range(3)]
    out = run_stage(RewardStage, [*inputs, ("rollouts", b"k", b"{not json")], config=cfg,
                    until={"rewarded": 3, "deadletter": 1})
    assert sorted((r.id, r.reward) for r in out["rewarded"]) == [("t0", 1.0), ("t1", 0.0), ("t2", 0.0)]
    assert [(d.reason, d.original_value()) for d in out["deadletter"]] == [("bad_json", b"{not json")]
    assert out["rollouts"] == [] and out.counts() == {"rewarded": 3, "deadletter": 1}  # outputs only
    assert out.stage.loop.finished == 4  # stopped gracefully: it drained what it took
    # a predicate over the outputs; each run on a fresh broker (nothing of the run before)
    assert len(run_stage(RewardStage, inputs[:1], config=cfg, until=lambda o: o["rewarded"])["rewarded"]) == 1
    assert cfg.bus is own_bus and not own_bus.bootstrap_servers.startswith("memory://")  # the caller's config is left alone
    with pytest.raises(AssertionError, match=r"did not hold after 1 s; the stage produced 1 rewarded"):
        run_stage(RewardStage, inputs[:1], config=cfg, until={"rewarded": 2}, timeout_s=1)
    with pytest.raises(ValueError, match="not topics"):
        run_stage(RewardStage, inputs, config=cfg, until={"reward": 1})
