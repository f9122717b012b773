"""``streamrl.testing``: the reward stage's own scoring path on in-memory records, no broker."""

from __future__ import annotations

import sys
import textwrap

import pytest

from streamrl.errors import Failure
from streamrl.loading import load_object
from streamrl.records import Rewarded
from streamrl.testing import score, trajectory


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
