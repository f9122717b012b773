"""verl's reward shapes and routing: ``verl_compat`` routes data sources as verl's
``default_compute_score`` does (read from verl's ``verl/utils/reward_score/__init__.py``), DAPO's
scorer serves ``math_dapo`` / ``aime*`` with +1/-1 and ``acc``; scored through the stage's own
path without a broker (``streamrl.testing``)."""

from __future__ import annotations

import sys

from streamrl.loading import load_object
from streamrl.records import Rewarded
from streamrl.reward.config import RewardConfig
from streamrl.reward.table import build_table
from streamrl.testing import score
from tests.helpers import trajectory

#: verl's default_compute_score: data source -> the scorer it picks (where streamrl has one)
VERL_ROUTES = {
    "openai/gsm8k": "verl_gsm8k",  # gsm8k.compute_score, strict
    # math_reward.compute_score: verl's own MATH rule
    "lighteval/MATH": "verl_math", "DigitalLearningGmbH/MATH-lighteval": "verl_math",
    "HuggingFaceH4/MATH-500": "verl_math",
    "math_dapo": "math_dapo", "math": "math_dapo", "math_dapo_reasoning": "math_dapo",
    "aime24": "math_dapo", "aime_2025": "math_dapo",
    "hiyouga/geometry3k": "geo3k",
    **{f"numina_{name}": "prime_math" for name in ("aops_forum", "synthetic_math", "amc_aime", "synthetic_amc",
                                                   "cn_k12", "olympiads")},
    **{f"searchR1_{name}": "search_r1" for name in ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa",
                                                    "musique", "bamboogle")},
}


def test_verl_compat_routes_as_verl_and_the_default_differs_where_readme_says():
    compat = build_table(RewardConfig(verl_compat=True, process_workers=1))
    assert {ds: compat.lookup(ds).name for ds in VERL_ROUTES} == VERL_ROUTES
    default = build_table(RewardConfig(process_workers=1))
    assert default.lookup("openai/gsm8k").name == "gsm8k" and default.lookup("math").name == "math"
    assert default.lookup("aime2024").name == "math_dapo" and default.lookup("chess") is None
    assert default.lookup("lighteval/MATH").name == "math" and default.lookup("hiyouga/geometry3k").name == "geo3k"
    assert compat.lookup("math_dapo").scorer.kwargs["method"] == "verl"
    assert default.lookup("math_dapo").scorer.kwargs.get("method", "math_verify") == "math_verify"


def test_gsm8k_strict_under_verl_compat_and_robust_by_default():
    recs = [trajectory(data_source="openai/gsm8k", response="The answer is 42.", ground_truth="42"),
            trajectory(data_source="openai/gsm8k", response="so #### 42", ground_truth="42")]
    strict = score(recs, {"verl_compat": True})
    robust = score(recs)
    assert [r.reward for r in strict] == [0.0, 1.0]  # verl's strict mode reads only "#### N"
    assert [r.reward for r in robust] == [1.0, 1.0]


def test_dapo_scorer_shape():
    out = score([trajectory(data_source="math_dapo", response="work...\nAnswer: \\frac{1}{2}", ground_truth="0.5"),
                 trajectory(data_source="aime24", response="Answer: 17", ground_truth="18"),
                 trajectory(data_source="math_dapo", response="no final line", ground_truth="3")],
                {"process_workers": 1})
    assert all(isinstance(o, Rewarded) for o in out)
    assert [o.reward for o in out] == [1.0, -1.0, -1.0]
    assert [o.reward_info["acc"] for o in out] == [True, False, False]
    assert out[0].scorer["name"] == "math_dapo" and out[1].reward_info["pred"] == "17"


VERL_USER_FILE = '''
import asyncio


def tuple_score(data_source, solution_str, ground_truth, extra_info=None):
    """The asynchronous reward agent's shape: (score, query, response)."""
    return float(solution_str.strip() == ground_truth), "query?", solution_str


class LengthReward:
    """A reward class as verl users write them: constructed with kwargs, compute_score per
    sample (async here), post_process_scores over the group."""

    def __init__(self, bonus=0.0):
        self.bonus = bonus
        self.seen = []

    async def compute_score(self, data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        await asyncio.sleep(0)
        self.seen.append(solution_str)
        return {"score": float(solution_str == ground_truth) + self.bonus, "length": len(solution_str)}

    def post_process_scores(self, scores, solution_strs):
        best = max(scores)
        return [1.0 if s == best else 0.0 for s in scores]


CALLS = []


def batch_score(data_sources, solution_strs, ground_truths, extra_infos, scale=1.0):
    """verl's BatchRewardManager signature: lists in, a list out."""
    CALLS.append(len(solution_strs))
    return [scale * float(s == g) for s, g in zip(solution_strs, ground_truths)]
'''


def test_verl_reward_code_runs_unchanged(tmp_path):
    user = tmp_path / "verl_rewards.py"
    user.write_text(VERL_USER_FILE)
    reward = {"scorers": {
        "agent": {"type": "function", "path": f"{user}:tuple_score", "data_sources": ["agent"]},
        "cls": {"type": "class", "path": f"{user}:LengthReward", "kwargs": {"bonus": 0.5},
                "data_sources": ["cls"]},
        "batched": {"type": "function", "path": f"{user}:batch_score", "batch": True, "batch_size": 8,
                    "batch_wait_ms": 200, "kwargs": {"scale": 2.0}, "data_sources": ["batched"]}}}
    records = ([trajectory(data_source="agent", response=r, ground_truth="7") for r in ("7", "8")]
               + [trajectory(data_source="cls", group_id="G", group_size=3, response=r, ground_truth="ab")
                  for r in ("ab", "abc", "x")]
               + [trajectory(data_source="batched", response=str(i % 2), ground_truth="1") for i in range(16)])
    out = score(records, reward)
    assert all(isinstance(o, Rewarded) for o in out), [getattr(o, "detail", "") for o in out]
    agent, cls, batched = out[:2], out[2:5], out[5:]
    assert [o.reward for o in agent] == [1.0, 0.0] and agent[0].reward_info["extra"] == ["query?", "7"]
    # compute_score per sample (1.5, 0.5, 0.5), then post_process_scores over the group
    assert [o.reward for o in cls] == [1.0, 0.0, 0.0]
    assert [o.reward_info["group"]["raw_reward"] for o in cls] == [1.5, 0.5, 0.5]
    assert cls[1].reward_info["length"] == 3
    assert [o.reward for o in batched] == [2.0 * (i % 2) for i in range(16)]
    module = sys.modules[load_object(f"{user}:batch_score").__module__]
    assert sum(module.CALLS) == 16 and max(module.CALLS) == 8 and len(module.CALLS) <= 4  # micro-batches


def test_dapo_overlong_buffer_and_acc():
    reward = {"process_workers": 1, "scorers": {"math_dapo": {
        "overlong_buffer": {"enable": True, "len": 4, "penalty_factor": 1.0, "max_resp_len": 10}}}}
    recs = [trajectory(data_source="math_dapo", response="Answer: 3", ground_truth="3", response_ids=list(range(n)))
            for n in (6, 8, 10)] + [trajectory(data_source="math_dapo", response="Answer: 3", ground_truth="3")]
    out = score(recs, reward)
    # expected length 10 - 4 = 6: 6 tokens no penalty, 8 tokens -2/4, 10 tokens -4/4
    assert [o.reward for o in out[:3]] == [1.0, 0.5, 0.0]
    assert [o.reward_info["overlong"] for o in out[:3]] == [False, True, True]
    assert out[1].reward_info["overlong_reward"] == -0.5 and out[1].reward_info["acc"] is True
    assert out[3].reason == "no_response_ids"


def test_a_verl_launch_script_scores_in_verls_mode_unless_told_otherwise(tmp_path):
    """verl's keys (a launch script) turn ``reward.verl_compat`` on: its data sources score as in
    verl; the command line or the config file can still say otherwise."""
    from streamrl.pipeline_config import resolve_config

    assert resolve_config("local.yaml", []).config().reward.verl_compat is False
    script = ["trainer.total_training_steps=3", "algorithm.adv_estimator=grpo"]
    assert resolve_config("local.yaml", script).config().reward.verl_compat is True
    assert resolve_config("local.yaml", [*script, "reward.verl_compat=false"]).config().reward.verl_compat is False
    config = tmp_path / "mine.yaml"
    config.write_text("reward:\n  verl_compat: false\ntrainer:\n  total_training_steps: 3\n")
    assert resolve_config(str(config), []).config().reward.verl_compat is False


def test_verls_families_through_the_stage_in_verls_mode():
    """Each family's records through the stage's own path in verl's mode: DAPO's box fallback,
    verl's MATH rule, search-R1's target as the JSON text the feed writes, geo3k; a ground truth
    verl's MATH rule cannot hold an answer in is a Failure (a dead letter with its reason)."""
    from streamrl.errors import Failure

    out = score([
        trajectory(data_source="aime24", response="so it is \\boxed{17}", ground_truth="17"),
        trajectory(data_source="lighteval/MATH", response="$\\boxed{\\dfrac{1}{2}}$", ground_truth="\\frac12"),
        trajectory(data_source="lighteval/MATH", response="$\\boxed{0.5}$", ground_truth="\\frac{1}{3}"),
        trajectory(data_source="searchR1_nq", response="<answer>The Beatles</answer>",
                   ground_truth='{"target": ["beatles", "the beatles"]}'),
        trajectory(data_source="hiyouga/geometry3k", response="<think>x</think> \\boxed{3\\sqrt{2}}",
                   ground_truth="3 \\sqrt{2}"),
        trajectory(data_source="lighteval/MATH", response="$\\boxed{}$", ground_truth=""),
    ], {"verl_compat": True, "process_workers": 1})
    assert [o.reward for o in out[:5]] == [1.0, 1.0, 0.0, 1.0, 1.0]
    assert out[0].reward_info["acc"] is True and out[0].reward_info["pred"] == "17"
    assert [o.scorer["name"] for o in out[:5]] == ["math_dapo", "verl_math", "verl_math", "search_r1", "geo3k"]
    assert isinstance(out[5], Failure) and out[5].reason == "bad_ground_truth"
