"""A verl launch script's entry module (``python -m MODULE``; ``streamrl run --verl-entry``,
``run.verl_entry``): a recipe's trainer is trained with its config file's defaults, or refused
naming the module, never verl's plain trainer in its place (issue 66)."""

from __future__ import annotations

import pytest
import yaml

from streamrl.errors import ConfigError
from streamrl.pipeline_config import resolve_config
from streamrl.verl.entries import ENTRIES, VERL_MAIN, entry_keys
from tests.helpers import dry_run, with_reward_files
from tests.verl.verl_scripts_data import SCRIPTS

#: the entry module each recorded recipe script runs (its `python3 -m`)
SCRIPT_ENTRIES = {"dapo_qwen2_5_32b": "recipe.dapo.main_dapo", "retool_dapo_qwen2_7b": VERL_MAIN}


def test_the_dapo_recipes_script_run_with_its_entry_trains_dapo(tmp_path):
    """DAPO's script, unchanged, with its entry module: DAPO's config file's values come first,
    the script's own keys after them (its project name wins)."""
    overrides = SCRIPTS["dapo_qwen2_5_32b"]["overrides"]
    with_reward_files(overrides, tmp_path)
    code, out, err = dry_run(["--verl-entry", SCRIPT_ENTRIES["dapo_qwen2_5_32b"], *overrides], tmp_path)
    assert code == 0, err
    resolved = yaml.safe_load(out)
    assert resolved["run"]["verl_entry"] == "recipe.dapo.main_dapo"
    assert resolved["reward_model"]["reward_manager"] == "dapo"
    assert resolved["learner"]["filter_groups"]["enable"] is True  # the script's own DAPO keys, as before
    report = [line[4:] for line in out.splitlines() if line.startswith("#   ")]
    assert report[:2] == ["reward.reward_manager.name=dapo -> reward_model.reward_manager=dapo",
                          "trainer.project_name=verl-dapo -> tracking.project=verl-dapo"]  # the entry's, first
    assert len(report) == len(overrides) + 2 and resolved["tracking"]["project"] == "DAPO"  # the script's wins


def test_a_key_the_script_gives_wins_over_its_entrys_default():
    r = resolve_config(None, ["run.verl_entry=recipe.dapo.main_dapo", "trainer.project_name=mine",
                              "reward.reward_manager.name=naive"])
    assert not r.problems and r.cfg.tracking.project == "mine" and r.cfg.reward_model.reward_manager == "naive"
    r = resolve_config(None, ["run.verl_entry=recipe.dapo.main_dapo"])
    assert r.cfg.tracking.project == "verl-dapo" and r.cfg.reward_model.reward_manager == "dapo"


def test_a_recipe_whose_algorithm_is_not_trained_here_is_refused_naming_its_entry():
    for module in sorted(m for m, e in ENTRIES.items() if e.missing) + ["recipe.mine.main_mine"]:
        keys, problem = entry_keys(module)
        assert keys == [] and problem.startswith(f"run.verl_entry={module}: refused"), problem
    r = resolve_config(None, ["run.verl_entry=recipe.gvpo.gvpo_main_ppo", "algorithm.adv_estimator=grpo"])
    assert len(r.problems) == 1 and "GVPO's policy loss" in r.problems[0], r.problems
    with pytest.raises(ConfigError, match=r"run\.verl_entry=recipe\.gvpo\.gvpo_main_ppo"):
        r.config()


def test_verls_own_entries_change_nothing():
    for module in ("", VERL_MAIN, "verl.trainer.main_ppo_v0"):
        assert entry_keys(module) == ([], "")
    assert resolve_config(None, [f"run.verl_entry={VERL_MAIN}"]).problems == []
