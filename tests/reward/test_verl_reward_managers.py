"""verl's reward managers as verl users write them (issue 63): a manager class of the user's,
registered by their module (``register``) or named by ``reward.reward_manager.source=importlib``,
runs in the reward group unchanged: built once per member with verl's config (its
``reward_kwargs``), handed each record as verl's ``DataProto`` fields, its ``reward_extra_info``
in the record's ``reward_info`` and the per-data-source metric."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from streamrl.errors import ConfigError
from streamrl.pipeline_config import load_config
from streamrl.policy import byte_tokenizer
from streamrl.reward.scoring import Scoring
from streamrl.testing import score
from tests.helpers import dry_run

# A manager written against verl's reward-loop interface (its base class and register here are
# streamrl's, for a machine without verl): decode the valid response tokens, call the scoring
# function off the loop, add a bonus from reward_kwargs, report extra info.
MANAGER = '''
from streamrl.reward.managers import RewardManagerBase, register

BUILT = []


class LengthAwareManager(RewardManagerBase):
    def __init__(self, config, tokenizer, compute_score, reward_router_address=None, reward_model_tokenizer=None):
        super().__init__(config, tokenizer, compute_score)
        self.bonus = config.reward.get("reward_kwargs", {}).get("bonus", 0.0)
        self.experiment = config.trainer.experiment_name
        BUILT.append(self)

    async def run_single(self, data):
        item = data[-1:][0]
        responses = item.batch["responses"]
        valid = int(item.batch["attention_mask"][-responses.shape[-1]:].sum())
        text = self.tokenizer.decode(responses[:valid], skip_special_tokens=True)
        extra = dict(item.non_tensor_batch.get("extra_info", {}))
        truth = item.non_tensor_batch["reward_model"]["ground_truth"]
        result = await self.loop.run_in_executor(None, lambda: self.compute_score(
            data_source=item.non_tensor_batch["data_source"], solution_str=text, ground_truth=truth,
            extra_info=extra))
        score = result["score"] if isinstance(result, dict) else result
        return {"reward_score": score + self.bonus,
                "reward_extra_info": {"acc": score, "valid_tokens": valid, "members": len(BUILT),
                                      "prompt_tokens": int(item.batch["prompts"].shape[-1])}}


register("length_aware")(LengthAwareManager)
'''

# The custom reward function's file imports the manager's module (registering it), as verl recipes do.
REWARD = '''
import user_manager  # noqa: F401  registers length_aware

def compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
    return {"score": scale * float(solution_str.strip().endswith(ground_truth)), "seen": len(solution_str)}
'''


@pytest.fixture
def files(tmp_path: Path, monkeypatch) -> Path:
    (tmp_path / "user_manager.py").write_text(textwrap.dedent(MANAGER))
    (tmp_path / "my_reward.py").write_text(textwrap.dedent(REWARD))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def records(n: int = 4) -> list[dict]:
    tok = byte_tokenizer()
    out = []
    for i in range(n):
        response = f"the answer is {i}" if i % 2 else f"so it is {i + 10}"
        rec = {"data_source": "puzzles", "prompt": f"question {i}", "response": response, "ground_truth": str(i)}
        if i < n // 2:  # half carry the policy's token ids, half are text-only
            rec["prompt_ids"] = tok.encode(rec["prompt"], add_special_tokens=False)
            rec["response_ids"] = tok.encode(response, add_special_tokens=False)
        out.append(rec)
    return out


def test_a_manager_the_users_module_registers_scores_with_reward_kwargs(files):
    cfg = load_config(None, [f"reward.custom_reward_function.path={files / 'my_reward.py'}",
                             "reward.custom_reward_function.reward_kwargs.scale=2.0",
                             "reward.reward_manager.name=length_aware", "+reward.reward_kwargs.bonus=0.25",
                             "trainer.experiment_name=exp7"])
    spec = cfg.reward.scorers["custom_reward_function"]
    assert spec.type == "manager" and spec.data_sources == ["*"] and spec.manager["name"] == "length_aware"
    before = REGISTRY.get_sample_value("streamrl_reward_info_count", {"data_source": "puzzles",
                                                                      "field": "valid_tokens"}) or 0.0
    out = score(records(), reward=cfg.reward)
    expected = [2.0 * float(r["response"].endswith(r["ground_truth"])) + 0.25 for r in records()]
    assert [r.reward for r in out] == pytest.approx(expected)
    assert [r.reward_info["acc"] for r in out] == [e - 0.25 for e in expected]
    # the valid response tokens, the same whether the record carried them or the tokenizer made them
    assert [r.reward_info["valid_tokens"] for r in out] == [len(r["response"].encode()) for r in records()]
    assert [r.reward_info["prompt_tokens"] for r in out] == [len(r["prompt"].encode()) for r in records()]
    assert {r.reward_info["members"] for r in out} == {1}  # one instance in this member, every record
    assert {r.scorer["name"] for r in out} == {"custom_reward_function"}
    after = REGISTRY.get_sample_value("streamrl_reward_info_count", {"data_source": "puzzles", "field": "valid_tokens"})
    assert after - before == 4


def test_a_manager_named_by_importlib_scores_with_default_compute_score(files):
    """``source: importlib``: the class by name in ``module.path``, no custom function: verl's
    default_compute_score (here the built-in gsm8k rule) is what it calls; the legacy keys too."""
    for keys in (["reward.reward_manager.source=importlib", f"reward.reward_manager.module.path={files / 'user_manager.py'}",
                  "reward.reward_manager.name=LengthAwareManager", "+reward.reward_kwargs.bonus=1.0"],
                 ["reward_model.reward_loop_source=importlib",
                  f"reward_model.reward_loop_module_path={files / 'user_manager.py'}",
                  "reward_model.reward_loop_class_name=LengthAwareManager", "reward_model.reward_manager=LengthAwareManager",
                  "reward_model.reward_kwargs.bonus=1.0"]):
        cfg = load_config(None, keys)
        assert cfg.reward.scorers["reward_manager"].type == "manager"
        out = score([{"data_source": "gsm8k", "response": "so #### 72", "ground_truth": "72"},
                     {"data_source": "gsm8k", "response": "so #### 71", "ground_truth": "72"}], reward=cfg.reward)
        assert [r.reward for r in out] == [2.0, 1.0]
        assert [r.scorer["name"] for r in out] == ["reward_manager"] * 2


def test_a_manager_nobody_registered_fails_at_start_naming_it(files):
    cfg = load_config(None, ["reward.reward_manager.name=nobody_registered"])
    with pytest.raises(ConfigError, match="nobody_registered"):
        Scoring(cfg.reward)
    code, _, err = dry_run(["reward.reward_manager.name=nobody_registered"], files)
    assert code == 2 and "no reward manager 'nobody_registered' is registered" in err
    code, _, err = dry_run(["reward.reward_manager.source=importlib", "reward.reward_manager.name=Nope",
                            f"reward.reward_manager.module.path={files / 'user_manager.py'}"], files)
    assert code == 2 and "Nope" in err
    with pytest.raises(ConfigError, match="reward_manager_source"):
        load_config(None, ["reward.reward_manager.source=pip"])
