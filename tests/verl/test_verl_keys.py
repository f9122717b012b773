"""A verl user's keys and first run: ``custom_reward_function`` / ``reward_model.reward_manager``
with verl's meaning, the routing rule between built-in rules and the user's entries, overrides
that replace rather than merge, a scorer's extra fields as metrics, and a bad config failing
``streamrl run`` at start."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from prometheus_client import REGISTRY

from streamrl.pipeline_config import load_config
from streamrl.errors import ConfigError
from streamrl.reward.scoring import Scoring
from streamrl.feed.prompts import build_prompts
from streamrl.scorers.loader import BatchFunctionScorer
from streamrl.testing import score
from tests.helpers import trajectory

ROOT = Path(__file__).resolve().parents[2]

# A reward file as verl's docs write one: verl's signature, a dict with score and acc.
REWARD_FILE = '''
import re

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    found = re.findall(r"#### (-?[0-9.,]+)", solution_str)
    acc = bool(found) and found[-1].replace(",", "") == ground_truth
    return {"score": 1.0 if acc else 0.0, "acc": acc, "pred": found[-1] if found else ""}

def batch_score(data_sources, solution_strs, ground_truths, extra_infos, bonus=0.0):
    return [float(s.endswith(g)) + bonus for s, g in zip(solution_strs, ground_truths)]

def fails(data_source, solution_str, ground_truth, extra_info=None):
    raise RuntimeError("scorer bug")

def plain(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
    return scale
'''

QUESTIONS = [("Natalia sold clips to 48 of her friends in April, and then she sold half as many "
              "clips in May. How many clips did Natalia sell altogether in April and May?", "72"),
             ("Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of "
              "babysitting. How much did she earn?", "10"),
             ("Betty is saving money for a new wallet which costs $100. How much more money does "
              "Betty need?", "5")]


def verl_gsm8k_parquet(path: Path) -> Path:
    """Rows shaped as verl's ``examples/data_preprocess/gsm8k.py`` writes them."""
    rows = [{"data_source": "openai/gsm8k",
             "prompt": [{"role": "user", "content": q + ' Let\'s think step by step and output the final answer after "####".'}],
             "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": a},
             "extra_info": {"split": "train", "index": i, "answer": f"... #### {a}", "question": q}}
            for i, (q, a) in enumerate(QUESTIONS)]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.fixture
def reward_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent(REWARD_FILE))
    return path


def info_sum(data_source: str, field: str) -> float:
    return REGISTRY.get_sample_value("streamrl_reward_info_sum", {"data_source": data_source, "field": field}) or 0.0


def test_a_verl_users_first_run_scores_with_their_reward_file(tmp_path, reward_file):
    """verl's parquet and a reward file named by ``custom_reward_function.path`` alone: the
    function scores verl's data source (``openai/gsm8k``, which the built-in gsm8k rule would
    otherwise take), its ``acc`` lands in reward_info and in the per-data-source metric."""
    data = verl_gsm8k_parquet(tmp_path / "train.parquet")
    # the feed keys below are today's way to read verl's parquet (docs/guides/multi-turn.md)
    cfg = load_config("local.yaml", [f"feed.dataset={data}", "feed.data_source=''", "feed.prompt_template=''",
                                     "feed.ground_truth=verl", f"custom_reward_function.path={reward_file}"])
    prompts = list(build_prompts(cfg.feed))
    assert [p.data_source for p in prompts] == ["openai/gsm8k"] * 3
    answers = ["so #### 72", "she earned #### 11", "no idea"]
    records = [trajectory(group_id=p.group_id, data_source=p.data_source, prompt=p.prompt, response=r,
                          ground_truth=p.ground_truth, extra_info=p.extra_info)
               for p, r in zip(prompts, answers)]
    acc_before = info_sum("openai/gsm8k", "acc")
    out = score(records, reward=cfg.reward)
    assert [r.reward for r in out] == [1.0, 0.0, 0.0]
    assert [r.reward_info["acc"] for r in out] == [True, False, False]
    assert out[0].reward_info["pred"] == "72" and {r.scorer["name"] for r in out} == {"custom_reward_function"}
    assert info_sum("openai/gsm8k", "acc") - acc_before == 1.0
    assert REGISTRY.get_sample_value("streamrl_reward_info_count", {"data_source": "openai/gsm8k", "field": "pred"}) is None


def test_the_built_in_rules_yield_their_data_sources_to_the_users_entries(reward_file):
    # a new entry for a data source a built-in serves takes it; the built-in keeps the rest
    cfg = load_config("local.yaml", ["reward.scorers.mine.type=function", f"reward.scorers.mine.path={reward_file}:compute_score",
                                     "reward.scorers.mine.data_sources=[openai/gsm8k]"])
    table = Scoring(cfg.reward).table
    assert table.lookup("openai/gsm8k").name == "mine" and table.lookup("gsm8k").name == "gsm8k"
    assert table.lookup("aime2024").name == "math_dapo" and table.yielded == {"openai/gsm8k": "mine"}
    # custom_reward_function takes every data source but the ones the user routed
    cfg = load_config("local.yaml", [f"custom_reward_function.path={reward_file}", "reward.scorers.mine.type=function",
                                     f"reward.scorers.mine.path={reward_file}:plain", "reward.scorers.mine.data_sources=[gsm8k]"])
    table = Scoring(cfg.reward).table
    assert table.lookup("gsm8k").name == "mine"
    assert {table.lookup(ds).name for ds in ("openai/gsm8k", "math", "aime2024", "anything")} == {"custom_reward_function"}
    # two of the user's own entries on one data source: an error naming both
    with pytest.raises(ConfigError, match="'openai/gsm8k' is claimed by both 'a' and 'b'"):
        cfg = load_config(None, [f"reward.scorers.{n}.{k}" for n in "ab" for k in (
            "type=function", f"path={reward_file}:plain", "data_sources=[openai/gsm8k]")])
        Scoring(cfg.reward)


def test_overriding_a_scorer_drops_the_files_kwargs_and_a_mapping_replaces(reward_file):
    # local-gsm8k.yaml gives gsm8k {method: flexible, format_score: 0.1}: no arguments of the user's function
    cfg = load_config("local-gsm8k.yaml", ["reward.scorers.gsm8k.type=function",
                                           f"reward.scorers.gsm8k.path={reward_file}:plain"])
    assert cfg.reward.scorers["gsm8k"].kwargs == {}
    assert score([{"data_source": "gsm8k", "response": "1"}], reward=cfg.reward)[0].reward == 1.0
    cfg = load_config("local-gsm8k.yaml", ["reward.scorers.gsm8k.type=function", f"reward.scorers.gsm8k.path={reward_file}:plain",
                                     "reward.scorers.gsm8k.kwargs.scale=2.0"])
    assert cfg.reward.scorers["gsm8k"].kwargs == {"scale": 2.0}
    assert load_config("local-gsm8k.yaml", ["reward.scorers.gsm8k.kwargs={}"]).reward.scorers["gsm8k"].kwargs == {}
    strict = load_config("local-gsm8k.yaml", ["reward.scorers.gsm8k.kwargs={method: strict}"])
    assert strict.reward.scorers["gsm8k"].kwargs == {"method": "strict"}
    assert load_config("local-gsm8k.yaml", ["reward.scorers.gsm8k.timeout_s=5"]).reward.scorers["gsm8k"].kwargs == {
        "method": "flexible", "format_score": 0.1}  # a field set alone merges, as in verl
    whole = load_config("local-gsm8k.yaml", [f"reward.scorers.gsm8k={{type: function, path: '{reward_file}:plain'}}"])
    assert whole.reward.scorers["gsm8k"].kwargs == {} and whole.reward.scorers["gsm8k"].type == "function"
    whole = load_config("local-gsm8k.yaml",
                        [f"reward.scorers.gsm8k={{type: function, path: '{reward_file}:plain', kwargs: {{scale: 3}}}}",
                         "reward.scorers.gsm8k.timeout_s=7"])
    assert whole.reward.scorers["gsm8k"].kwargs == {"scale": 3} and whole.reward.scorers["gsm8k"].timeout_s == 7.0
    resources = load_config("local-gsm8k.yaml", ["run.ray.resources={reward: {num_cpus: 2}}"]).run.ray.resources
    assert resources == {"reward": {"num_cpus": 2.0}}
    with pytest.raises(ConfigError, match="reward.scorers.gsm8k.typo"):
        load_config("local-gsm8k.yaml", ["reward.scorers.gsm8k={typo: 1}"])


def test_verls_reward_managers_shape_the_function(reward_file):
    base = [f"custom_reward_function.path={reward_file}"]
    batch = load_config(None, [*base, "custom_reward_function.name=batch_score", "reward_model.reward_manager=batch",
                               "reward_model.reward_kwargs.bonus=0.5"])
    assert isinstance(Scoring(batch.reward).table.lookup("x").scorer, BatchFunctionScorer)
    out = score([{"data_source": "x", "response": "is 7", "ground_truth": "7"}], reward=batch.reward)
    assert out[0].reward == 1.5
    dapo = load_config(None, [*base, "reward_model.reward_manager=dapo", "reward_model.reward_kwargs.max_resp_len=8",
                              "reward_model.reward_kwargs.overlong_buffer_cfg="
                              "{enable: true, len: 4, penalty_factor: 1.0, log: false}"])
    out = score([{"data_source": "x", "response": "#### 7", "ground_truth": "7", "response_ids": list(range(6))}],
                reward=dapo.reward)
    assert out[0].reward == pytest.approx(0.5) and out[0].reward_info["overlong_reward"] == pytest.approx(-0.5)
    prime = load_config(None, [*base, "custom_reward_function.name=fails", "reward_model.reward_manager=prime"])
    spec = prime.reward.scorers["custom_reward_function"]
    assert spec.executor == "process" and spec.timeout_s == 300.0
    prime.reward.max_attempts, prime.reward.retry_backoff_s = 1, 0.01
    out = score([{"data_source": "x", "response": "1"}], reward=prime.reward)
    assert out[0].reward == 0.0 and out[0].reward_info["status"] == "fallback:scorer_error"
    # without a custom function the manager shapes the built-in rules
    assert load_config(None, ["reward_model.reward_manager=prime"]).reward.scorers["math"].executor == "process"
    for bad, field in [(["reward_model.reward_manager=batch"], "custom_reward_function.path"),
                       ([*base, "reward_model.reward_kwargs.x=1"], "reward_model.reward_kwargs"),
                       ([*base, "reward_model.reward_manager=dapo", "reward_model.reward_kwargs.max_resp_len=4",
                         "reward_model.reward_kwargs.overlong_buffer_cfg={enable: true, len: 4}"], "overlong_buffer_cfg.len")]:
        with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
            load_config(None, bad)
    with pytest.raises(ConfigError, match="custom_reward_function.path"):
        Scoring(load_config(None, ["custom_reward_function.path=no_such_file.py"]).reward)
    # a name no module registered: the scorer table fails at start naming it (tests/reward/test_verl_reward_managers.py)
    with pytest.raises(ConfigError, match="no reward manager 'fancy' is registered"):
        Scoring(load_config(None, ["reward_model.reward_manager=fancy"]).reward)


def test_a_bad_stage_section_fails_streamrl_run_at_start(tmp_path, reward_file):
    """Exit 2 naming the field, before the broker or any stage starts."""
    cases = [([f"custom_reward_function.path={reward_file}", "custom_reward_function.name=nope"], "custom_reward_function"),
             (["reward.scorers.a.type=function", f"reward.scorers.a.path={reward_file}:plain",
               "reward.scorers.a.data_sources=[x]", "reward.scorers.b.type=function",
               f"reward.scorers.b.path={reward_file}:plain", "reward.scorers.b.data_sources=[x]"],
              "reward.scorers.b.data_sources"),
             (["learner.lr=0"], "learner.lr"),
             (["rollout.backend=magic"], "rollout.backend")]
    for overrides, field in cases:
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "streamrl", "run", f"run.out_dir={tmp_path / 'runs'}", *overrides],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert field in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "embedded broker" not in proc.stderr and not (tmp_path / "runs").exists()
        assert time.monotonic() - started < 60


def test_a_failed_runs_summary_says_what_failed():
    from streamrl.supervisor.display import summary_line

    summary = {"ended": "failed:reward-0", "versions": 0, "reward_first": None, "reward_last": None,
               "records": {"rollouts": 0, "rewarded": 0, "dead_at_reward": 0, "unscored": 0}, "deadletters": 0,
               "plot": "r.png", "by_data_source": {},
               "failure": {"stage": "reward-0", "returncode": 2, "error": "streamrl reward: config field 'x': bad"}}
    line = summary_line(summary)
    assert line.startswith("run failed: stage reward-0 exited with 2 (streamrl reward: config field 'x': bad)")
    assert "None" not in line and "no record rewarded" in line
    done = {**summary, "ended": "done", "reward_first": 0.1, "reward_last": 0.5,
            "by_data_source": {"openai/gsm8k": {"records": 4, "reward": 0.5, "acc": 0.5}}}
    assert summary_line(done).startswith("run done: 0 versions, reward 0.1 -> 0.5 (openai/gsm8k: reward 0.5, acc 0.5)")


def test_each_replay_gets_its_own_directory(tmp_path):
    from streamrl.commands.replay import new_replay_dir

    first, second = new_replay_dir(tmp_path / "replay"), new_replay_dir(tmp_path / "replay")
    assert first != second and first.is_dir() and second.is_dir() and first.parent == second.parent



def test_replay_reads_verls_keys_from_a_pipeline_yaml(tmp_path, reward_file):
    from streamrl.replay.rescore import load_reward_config

    config = tmp_path / "pipeline.yaml"
    config.write_text(f"custom_reward_function: {{path: '{reward_file}', name: plain}}\n"
                      "reward_model: {reward_manager: prime}\nreward: {max_attempts: 1}\n")
    rc = load_reward_config(config)
    assert rc.max_attempts == 1 and rc.scorers["custom_reward_function"].executor == "process"
    assert Scoring(rc).table.lookup("openai/gsm8k").name == "custom_reward_function"
