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
    r = resolve_config(None, ["run.verl_entry=recipe.sppo.main_sppo", "algorithm.adv_estimator=grpo"])
    assert len(r.problems) == 1 and "SPPO's self-play preference loss" in r.problems[0], r.problems
    with pytest.raises(ConfigError, match=r"run\.verl_entry=recipe\.sppo\.main_sppo"):
        r.config()


def test_verls_own_entries_change_nothing():
    for module in ("", VERL_MAIN, "verl.trainer.main_ppo_v0"):
        assert entry_keys(module) == ([], "")
    assert resolve_config(None, [f"run.verl_entry={VERL_MAIN}"]).problems == []


#: verl-recipe's GVPO launch script (gvpo/run_qwen2-7b_math_gvpo.sh at 48ea0a7): its keys, the
#: data paths and model aside (the tests give theirs)
GVPO_SCRIPT = [
    "algorithm.adv_estimator=grpo", "data.train_batch_size=1024", "data.max_prompt_length=1024",
    "data.max_response_length=1024", "data.filter_overlong_prompts=True", "data.truncation=error",
    "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.model.use_remove_padding=True",
    "actor_rollout_ref.actor.ppo_mini_batch_size=256", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.actor.use_kl_loss=False", "actor_rollout_ref.actor.policy_loss.loss_mode=gvpo",
    "actor_rollout_ref.actor.gvpo_beta=0.1", "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.model.enable_gradient_checkpointing=True", "actor_rollout_ref.actor.fsdp_config.param_offload=False",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
    "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
    "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16",
    "actor_rollout_ref.ref.fsdp_config.param_offload=True", "algorithm.use_kl_in_reward=False",
    "algorithm.norm_adv_by_std_in_grpo=False", "trainer.critic_warmup=0", "trainer.logger=['console']",
    "trainer.project_name=verl_gvpo_example_gsm8k_math", "trainer.experiment_name=qwen2_7b_function_rm",
    "trainer.n_gpus_per_node=2", "trainer.nnodes=1", "trainer.save_freq=20", "trainer.test_freq=20",
    "trainer.total_epochs=15"]


def test_the_gvpo_recipes_script_run_with_its_entry_trains_gvpo(tmp_path):
    """GVPO's script with its entry module: the recipe's loss and beta, its micro-batch as the
    loss's scale; its config file's values first (``--dry-run`` reports them), the script's after."""
    code, out, err = dry_run(["--verl-entry", "recipe.gvpo.gvpo_main_ppo", *GVPO_SCRIPT,  # (data not read here)
                              "data.train_files=['train.parquet']", "actor_rollout_ref.model.path=Qwen/Qwen2.5-Math-7B"],
                             tmp_path)
    assert code == 0, err
    resolved = yaml.safe_load(out)
    assert resolved["learner"]["policy_loss"]["loss_mode"] == "gvpo"
    assert resolved["learner"]["policy_loss"]["gvpo_beta"] == 0.1 and resolved["learner"]["micro_batch_size"] == 16
    assert resolved["learner"]["norm_adv_by_std_in_grpo"] is False and resolved["learner"]["kl_coef"] == 0.0
    report = [line[4:] for line in out.splitlines() if line.startswith("#   ")]
    assert report[:2] == ["actor_rollout_ref.actor.gvpo_beta=0.1 -> learner.policy_loss.gvpo_beta=0.1",
                          "trainer.project_name=gvpo -> tracking.project=gvpo"]  # the entry's, first
    assert "actor_rollout_ref.actor.policy_loss.loss_mode=gvpo -> learner.policy_loss.loss_mode=gvpo" in report


def test_the_gvpo_entry_refuses_another_loss_and_what_gvpo_cannot_weigh():
    """The recipe's actor trains loss_mode gvpo alone (it raises on any other): the entry without
    it is refused naming the key, never plain GRPO in its place; GVPO has no importance ratio, so
    rollout correction (whose weights the recipe drops) and the decoupled objective are refused."""
    r = resolve_config(None, ["run.verl_entry=recipe.gvpo.gvpo_main_ppo", "algorithm.adv_estimator=grpo"])
    assert len(r.problems) == 1 and "actor_rollout_ref.actor.policy_loss.loss_mode=gvpo only" in r.problems[0]
    with pytest.raises(ConfigError, match=r"run\.verl_entry=recipe\.gvpo\.gvpo_main_ppo"):
        r.config()
    gvpo = ["run.verl_entry=recipe.gvpo.gvpo_main_ppo", "actor_rollout_ref.actor.policy_loss.loss_mode=gvpo"]
    r = resolve_config(None, gvpo + ["actor_rollout_ref.actor.gvpo_beta=0.3"])
    assert not r.problems and r.cfg.learner.policy_loss.gvpo_beta == 0.3 and r.cfg.tracking.project == "gvpo"
    with pytest.raises(ConfigError, match=r"learner\.rollout_correction'.*gvpo takes no importance weight"):
        resolve_config(None, gvpo + ["algorithm.rollout_correction.rollout_is=token"]).config().learner.validate()
    with pytest.raises(ConfigError, match=r"learner\.decoupled'.*no importance ratio"):
        resolve_config(None, gvpo + ["learner.decoupled=true"]).config().learner.validate()


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_the_gvpo_entry_trains_gvpo_on_the_real_broker(bus, bus_config, tmp_path):
    """``streamrl learner`` with GVPO's entry module on the real broker: two groups of 4
    published, one version trained, and its announcement's figures are GVPO's (its residual,
    the gap between the policy's log-ratio deviations and the rewards' that the loss closes)."""
    import asyncio
    import subprocess
    import sys

    from streamrl.records import PolicyVersion
    from tests.helpers import ROOT, group, publish, read_topic

    asyncio.run(publish(bus, group("a", size=4, rewards=[1.0, 0.0, 0.5, 0.0]) +
                        group("b", size=4, rewards=[0.0, 1.0, 1.0, 0.0])))
    proc = subprocess.run(
        [sys.executable, "-m", "streamrl", "learner", "--bootstrap-servers", bus_config.bootstrap_servers,
         f"bus.topic_prefix={bus_config.topic_prefix}", "run.verl_entry=recipe.gvpo.gvpo_main_ppo",
         "actor_rollout_ref.actor.policy_loss.loss_mode=gvpo", "actor_rollout_ref.actor.gvpo_beta=0.5",
         "algorithm.norm_adv_by_std_in_grpo=False", "actor_rollout_ref.actor.ppo_epochs=2", "learner.lr=0.001",
         "learner.groups_per_mini_batch=2", "learner.mini_batches_per_version=1", "learner.versions=1",
         "learner.max_tokens_per_micro_batch=16", f"learner.checkpoint_dir={tmp_path / 'ckpt'}",
         f"learner.weights_dir={tmp_path / 'w'}", "metrics.host=127.0.0.1", "learner.end_with_data=false"],
        cwd=ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    announced = [PolicyVersion.decode(m.value) for m in asyncio.run(read_topic(bus, "policy", 1))]
    figures = announced[-1].metrics
    assert announced[-1].version == 1 and figures["gvpo/residual"] > 0, figures
    assert figures["pg_loss"] > 0 and "clip_fraction" in figures, figures
