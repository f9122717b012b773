"""verl users' launch scripts, unchanged: the overrides of 27 of verl's own example scripts
(``tests/verl/verl_scripts_data.py`` names each script's repository, commit and path) through
``streamrl run --dry-run``, in process; their numbers in the resolved config; every problem at
once, each naming the key as typed; the feed's prompt-length limit with the policy's tokenizer;
and one script run for real on CPU with the tiny policy and GSM8K parquet files."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from streamrl.cli import main
from streamrl.pipeline_config import resolve_config
from streamrl.verl import VERL_TABLE, find_row, markdown_table
from tests.helpers import dry_run, resolved_script, with_reward_files
from tests.verl.verl_scripts_data import SCRIPTS


ROOT = Path(__file__).resolve().parents[2]
SHARED = Path(__file__).resolve().parents[3] / "shared"


#: the scripts that do not start yet, and what each one's problem lines name (all of them); the
#: multimodal script starts: its rows' images are refused by the feed (test_verl_schema.py)
REFUSED: dict[str, list[list[str]]] = {
    # its Dataset class rewrites the rows (AIME's columns into prompts): run it once, to parquet
    "retool_dapo_qwen2_7b": [["data.custom_cls.path"]],
}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_a_verl_script_starts_under_dry_run(name, tmp_path):
    overrides = SCRIPTS[name]["overrides"]
    with_reward_files(overrides, tmp_path)
    code, out, err = dry_run(overrides, tmp_path)
    lines = [line for line in err.strip().splitlines() if line.strip()]
    if name not in REFUSED:
        problems = lines[1:] if len(lines) > 1 else lines
        assert problems == [], err
        assert code == 0 or problems != lines
    else:
        assert code == 2
        problems = lines if len(lines) == 1 else lines[1:]
        assert len(problems) == len(REFUSED[name]), err
        for line, names in zip(problems, REFUSED[name]):
            assert all(n in line for n in names), (line, names)
    resolved = yaml.safe_load(out)  # the report is YAML comments: stdout stays the config
    assert resolved["feed"]["dataset"] and resolved["learner"]["policy"]
    report = [line[4:] for line in out.splitlines() if line.startswith("#   ")]
    assert len(report) == len(overrides)  # one line per key given, as typed
    for line, override in zip(report, overrides):
        assert line.startswith(override.split("=", 1)[0] + "="), (line, override)
        assert " -> " in line


def test_the_grpo_script_trains_the_run_its_author_wrote(tmp_path):
    cfg = resolved_script("grpo_qwen3_8b", tmp_path).config()  # examples/grpo_trainer/run_qwen3-8b.sh
    learner, feed, rollout = cfg.learner, cfg.feed, cfg.rollout
    # 1024 prompts per version in mini-batches of 256 prompts, 5 samples each
    assert (learner.groups_per_mini_batch, learner.mini_batches_per_version, feed.group_size) == (256, 4, 5)
    assert rollout.trajectories_per_version == 1024 * 5  # the staleness gate follows the batch
    assert (feed.max_prompt_length, feed.truncation, feed.filter_overlong_prompts) == (512, "error", True)
    assert rollout.max_new_tokens == 1024 and learner.lr == 1e-6 and learner.kl_coef == 0.001
    assert learner.micro_batch_size == 32 and learner.gradient_checkpointing is True
    assert learner.policy == rollout.policy == feed.tokenizer == "Qwen/Qwen3-8B" and rollout.backend == "vllm"
    assert rollout.vllm.tensor_parallel_size == 2 and rollout.vllm.gpu_memory_utilization == 0.6
    assert (learner.parallel.nproc, learner.parallel.nnodes, learner.parallel.cpu_offload) == (8, 1, False)
    # 15 epochs and no step count: the run ends with the data, not at local.yaml's 80 versions
    assert (feed.epochs, learner.versions) == (15, 0)
    assert (learner.checkpoint_every, cfg.eval.every) == (20, 5)
    assert feed.dataset == "~/data/gsm8k/train.parquet" and cfg.eval.dataset == "~/data/gsm8k/test.parquet"
    assert feed.limit == 0  # every row of the user's data, not local.yaml's limit for its own
    assert cfg.tracking.loggers == ["console", "wandb"] and cfg.tracking.project == "verl_grpo_example_gsm8k"


def test_the_dapo_recipe_carries_its_numbers(tmp_path):
    r = resolved_script("dapo_qwen2_5_32b", tmp_path)  # verl-recipe dapo/run_dapo_qwen2.5_32b.sh
    assert r.problems == []
    cfg = r.cfg
    learner = cfg.learner
    assert (learner.lr_warmup_steps, learner.lr_scheduler_type) == (10, "constant")  # issue 48
    assert (learner.groups_per_mini_batch, learner.mini_batches_per_version, cfg.feed.group_size) == (32, 16, 16)
    assert (cfg.feed.max_prompt_length, cfg.feed.truncation, cfg.rollout.max_new_tokens) == (2048, "left", 20480)
    assert (learner.clip_ratio_low, learner.clip_ratio_high, learner.clip_ratio_c) == (0.2, 0.28, 10.0)
    assert (learner.lr, learner.weight_decay, learner.kl_coef) == (1e-6, 0.1, 0.0)
    assert learner.filter_groups.enable and learner.filter_groups.max_num_gen_batches == 10
    assert learner.max_tokens_per_micro_batch == 22528 and learner.parallel.cpu_offload is True
    assert (learner.parallel.nproc, learner.parallel.nnodes, cfg.run.resume) == (8, 16, "auto")
    # the legacy reward_model.overlong_buffer section: DAPO's overlong penalty, max_resp_len the response length
    buffer = cfg.reward.scorers["math_dapo"].overlong_buffer
    assert (buffer.enable, buffer.len, buffer.penalty_factor, buffer.max_resp_len) == (True, 4096, 1.0, 20480)
    assert (cfg.eval.do_sample, cfg.eval.temperature, cfg.eval.top_p) == (True, 1.0, 0.7)
    assert cfg.run.out_dir == "~/verl/ckpts/DAPO/DAPO-Qwen2.5-32B" and cfg.feed.prompt_key == "prompt"


def test_the_lora_script_carries_its_adapter(tmp_path):
    cfg = resolved_script("grpo_lora_qwen2_5_3b", tmp_path).config()  # run_qwen2_5-3b_gsm8k_grpo_lora.sh
    overrides = dict(o.split("=", 1) for o in SCRIPTS["grpo_lora_qwen2_5_3b"]["overrides"])
    assert cfg.learner.lora.rank == int(overrides["actor_rollout_ref.model.lora_rank"]) > 0
    assert cfg.learner.lora.alpha == float(overrides["actor_rollout_ref.model.lora_alpha"])
    assert cfg.learner.lr == float(overrides["actor_rollout_ref.actor.optim.lr"])
    prompts, mini = int(overrides["data.train_batch_size"]), int(overrides["actor_rollout_ref.actor.ppo_mini_batch_size"])
    assert cfg.learner.groups_per_mini_batch * cfg.learner.mini_batches_per_version == prompts
    assert cfg.learner.groups_per_mini_batch == mini
    assert cfg.feed.group_size == int(overrides["actor_rollout_ref.rollout.n"])
    assert cfg.rollout.max_new_tokens == int(overrides["data.max_response_length"])


def test_the_multi_turn_script_launches_sglang_with_its_tools(tmp_path):
    cfg = resolved_script("multiturn_gsm8k", tmp_path).config()  # sglang_multiturn/run_qwen2.5-3b_gsm8k_multiturn.sh
    rollout = cfg.rollout
    assert (rollout.backend, rollout.servers_launch.backend, rollout.openai.model) == (
        "openai", "sglang", "Qwen/Qwen2.5-3B-Instruct")
    assert rollout.multi_turn.tool_config_path.endswith("gsm8k_tool_config.yaml")
    assert (cfg.learner.groups_per_mini_batch, cfg.learner.mini_batches_per_version, cfg.feed.group_size) == (256, 1, 16)
    assert (rollout.max_new_tokens, cfg.feed.max_prompt_length, cfg.learner.lr) == (1024, 1024, 1e-6)
    assert cfg.learner.checkpoint_every == 0  # save_freq=-1: at the end only
    assert (cfg.feed.epochs, cfg.learner.versions, cfg.eval.every) == (15, 0, 20)


def test_every_problem_at_once_each_naming_the_key_as_typed(tmp_path):
    """A misspelt verl key, verl keys with bad values (one read here, one failing the learner's
    own check) and a streamrl key that does not exist: one exit, four lines."""
    args = ["actor_rollout_ref.rollout.nn=5", "data.train_batch_size=abc", "actor_rollout_ref.actor.optim.lr=0",
            "learner.no_such_key=1", "trainer.total_epochs=2"]
    code, out, err = dry_run(args, tmp_path)
    assert code == 2
    lines = err.strip().splitlines()
    assert lines[0] == "streamrl run: 4 problems in the config:"
    assert any("actor_rollout_ref.rollout.nn=5" in line and "did you mean actor_rollout_ref.rollout.n" in line
               for line in lines)
    assert any(line.strip().startswith("data.train_batch_size=abc:") for line in lines)
    assert any("learner.lr" in line and "actor_rollout_ref.actor.optim.lr=0" in line for line in lines)
    assert any("learner.no_such_key" in line for line in lines)
    # `streamrl run` itself: the same lines, before a broker or a run directory
    err2 = io.StringIO()
    with contextlib.redirect_stderr(err2), contextlib.redirect_stdout(io.StringIO()):
        assert main(["run", f"run.out_dir={tmp_path / 'runs'}", *args]) == 2
    assert err2.getvalue().strip().splitlines() == lines and not (tmp_path / "runs").exists()


def test_hydra_prefixes_and_verls_current_reward_section(tmp_path):
    reward = tmp_path / "my_reward.py"
    reward.write_text("def batch(data_sources, solution_strs, ground_truths, extra_infos, bonus=0.0):\n"
                      "    return [bonus for _ in solution_strs]\n")
    r = resolve_config("local.yaml", [f"reward.custom_reward_function.path={reward}",
                                      "reward.custom_reward_function.name=batch", "reward.reward_manager.name=batch",
                                      "+reward.reward_kwargs.bonus=0.5", "++data.max_response_length=64",
                                      "trainer.save_freq=-1", "reward.max_attempts=5",
                                      "actor_rollout_ref.rollout.val_kwargs.do_sample=True"])
    cfg = r.config()
    spec = cfg.reward.scorers["custom_reward_function"]
    assert spec.batch and spec.kwargs == {"bonus": 0.5} and spec.path.endswith("my_reward.py:batch")
    assert cfg.reward.max_attempts == 5  # streamrl's own reward section beside verl's
    assert cfg.rollout.max_new_tokens == 64 and cfg.learner.checkpoint_every == 0
    assert cfg.eval.do_sample is False  # do_sample at verl's val temperature 0 is greedy, as verl decodes
    assert [o.typed for o in r.verl][3:5] == ["+reward.reward_kwargs.bonus", "++data.max_response_length"]


def test_keys_that_change_nothing_are_named_together_and_the_table_drives_the_guide(tmp_path):
    code, out, err = dry_run(["actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
                              "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8", "ray_kwargs.ray_init.num_cpus=4",
                              "actor_rollout_ref.rollout.top_k=-1"], tmp_path)
    assert code == 0, err
    assert "# verl keys given: 4" in out and "top_k=-1 -> not applicable here: verl's default" in out
    from streamrl.verl import ignored_line, read_verl_keys

    line = ignored_line(read_verl_keys([("actor_rollout_ref.actor.megatron.pipeline_model_parallel_size", 2),
                                        ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size", 2),
                                        ("global_profiler.tool", "nsys")]))
    assert line.count("Megatron") == 1 and "pipeline_model_parallel_size, " in line and "profilers" in line
    # every key of every script has a row, and the guide's table is made from the rows
    table = markdown_table()
    assert len(table.strip().splitlines()) == len(VERL_TABLE) + 2
    keys = {o.split("=", 1)[0].lstrip("+") for s in SCRIPTS.values() for o in s["overrides"]}
    assert all(find_row(k) is not None for k in keys), sorted(k for k in keys if find_row(k) is None)


#: table keys that verl 0.9.1's own config does not have: older verl's, and verl-recipe's (DAPO's legacy
#: reward_model.overlong_buffer)
NOT_IN_VERL_0_9 = {"actor_rollout_ref.model.torch_dtype", "actor_rollout_ref.rollout.multi_turn.interaction_config_path",
                   "actor_rollout_ref.rollout.update_weights_bucket_megabytes", "trainer.use_legacy_worker_impl",
                   "trainer.profile_steps", "reward.launch_reward_fn_async", "reward_model.launch_reward_fn_async",
                   *(f"reward_model.overlong_buffer.{k}" for k in ("enable", "len", "penalty_factor", "log")),
                   # GDPO's: fields of verl 0.9.1's AlgoConfig (trainer/config/algorithm.py), not in its yaml
                   "algorithm.gdpo_reward_keys", "algorithm.gdpo_reward_weights",
                   # fields of verl's dataclasses its yaml lacks, given with Hydra's + (RolloutConfig's; SAPO's script
                   # gives tau_pos / tau_neg under policy_loss, verl reads them as actor.tau_pos / tau_neg)
                   "actor_rollout_ref.rollout.moe_tensor_parallel_size", "actor_rollout_ref.actor.policy_loss.tau_pos",
                   "actor_rollout_ref.actor.policy_loss.tau_neg",
                   # fields of verl's EngineRouterReplayConfig its VeOmni yaml lacks (the Megatron one names them)
                   "actor_rollout_ref.actor.veomni.router_replay.record_file",
                   "actor_rollout_ref.actor.veomni.router_replay.replay_file",
                   # the GVPO recipe's own key (verl-recipe's recipe/gvpo config, read by its actor)
                   "actor_rollout_ref.actor.gvpo_beta"}


def test_the_tables_keys_are_verls():
    """Every key the table names is one of verl's (its installed package's generated configs),
    or a known older or recipe key: a misspelt row would never match what a user types."""
    import importlib.util

    spec = importlib.util.find_spec("verl")
    if spec is None:
        pytest.skip("verl is not installed (pip install --no-deps verl)")
    base = Path(spec.submodule_search_locations[0]) / "trainer" / "config"

    def flat(tree: object, prefix: str = "") -> set[str]:
        out = set()
        for k, v in (tree.items() if isinstance(tree, dict) else ()):
            key = f"{prefix}.{k}" if prefix else str(k)
            out |= {key, *flat(v, key)}
        return out

    from streamrl.verl.schema import schema_keys  # every engine's keys (test_verl_schema.py checks them)

    verl = set(schema_keys()) | flat(yaml.safe_load((base / "legacy_reward_impl.yaml").read_text()))
    exact = {r.key for r in VERL_TABLE if "*" not in r.key}
    # Megatron's TransformerConfig fields, given under override_transformer_config with Hydra's +
    # (verl's yaml names a few of them; any field of Megatron's dataclass is taken)
    transformer = {k for k in exact if ".megatron.override_transformer_config" in k}
    assert sorted(exact - verl - NOT_IN_VERL_0_9 - transformer) == []
    assert "data.train_batch_size" in verl and "critic.optim.lr" in verl  # the configs were read


def verl_rows(jsonl: Path, n: int, split: str) -> list[dict]:
    """GSM8K rows as verl's examples/data_preprocess/gsm8k.py writes them."""
    instruction = 'Let\'s think step by step and output the final answer after "####".'
    rows = []
    for i, line in enumerate(jsonl.read_text().splitlines()[:n]):
        row = json.loads(line)
        rows.append({"data_source": "openai/gsm8k", "ability": "math",
                     "prompt": [{"role": "user", "content": f"{row['question']} {instruction}"}],
                     "reward_model": {"style": "rule", "ground_truth": row["answer"].split("#### ")[-1].replace(",", "")},
                     "extra_info": {"split": split, "index": i, "answer": row["answer"], "question": row["question"]}})
    return rows


def test_the_feed_limits_prompt_length_with_the_policys_tokenizer(tmp_path):
    from streamrl.errors import StreamrlError
    from streamrl.feed.prompts import build_prompts

    rows = verl_rows(SHARED / "data" / "gsm8k" / "train.jsonl", 12, "train")
    for row in rows:
        row["question_chat"] = row.pop("prompt")
    pq.write_table(pa.Table.from_pylist(rows[:6]), tmp_path / "a.parquet")
    pq.write_table(pa.Table.from_pylist(rows[6:]), tmp_path / "b.parquet")
    base = [f"data.train_files=[{tmp_path / 'a.parquet'},{tmp_path / 'b.parquet'}]", "data.prompt_key=question_chat",
            "data.max_prompt_length=300", "trainer.total_epochs=1", "data.shuffle=False"]
    lengths = [len(f"user: {r['question_chat'][0]['content']}\nassistant: ".encode()) for r in rows]  # tiny: bytes
    assert min(lengths) <= 300 < max(lengths)

    def prompts(*more: str) -> list:
        return list(build_prompts(resolve_config("local.yaml", [*base, *more]).config().feed))

    kept = prompts("data.filter_overlong_prompts=True")
    assert len(kept) == sum(n <= 300 for n in lengths)  # both files, one after the other, the long ones dropped
    assert [p.ground_truth for p in kept] == [r["reward_model"]["ground_truth"] for r, n in zip(rows, lengths) if n <= 300]
    cut = prompts("data.truncation=left")
    assert len(cut) == 12 and all(len(p.prompt.encode()) <= 300 for p in cut if isinstance(p.prompt, str))
    assert sum(isinstance(p.prompt, str) for p in cut) == sum(n > 300 for n in lengths)
    assert all(p.prompt.endswith("assistant: ") for p in cut if isinstance(p.prompt, str))  # left: the end kept
    middle = prompts("data.truncation=middle")
    assert all(p.prompt.startswith("user: ") and p.prompt.endswith("assistant: ") for p in middle if isinstance(p.prompt, str))
    with pytest.raises(StreamrlError, match="more than feed.max_prompt_length"):
        prompts("data.truncation=error")


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_a_verl_script_runs_for_real_on_cpu(tmp_path):
    """verl's classic GSM8K GRPO script (examples/grpo_trainer/run_qwen2-7b.sh) as it is, but
    for the tiny policy, transformers on CPU, GSM8K parquet files made here (training as two
    files), small batches and three versions: it trains, filters its long prompts with the
    tiny policy's tokenizer, and ends."""
    data = SHARED / "data" / "gsm8k"
    for name, rows in (("train0", verl_rows(data / "train.jsonl", 24, "train")[:12]),
                       ("train1", verl_rows(data / "train.jsonl", 24, "train")[12:]),
                       ("test", verl_rows(data / "test.jsonl", 4, "test"))):
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / f"{name}.parquet")
    script = list(SCRIPTS["grpo_qwen2_7b"]["overrides"])
    small = [f"data.train_files=[{tmp_path / 'train0.parquet'},{tmp_path / 'train1.parquet'}]",
             f"data.val_files={tmp_path / 'test.parquet'}", "actor_rollout_ref.model.path=tiny",
             "actor_rollout_ref.rollout.name=hf", "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.n=2",
             "data.max_prompt_length=400", "data.max_response_length=8", "trainer.total_training_steps=3",
             "trainer.n_gpus_per_node=1", "trainer.logger=console", "trainer.test_freq=-1",
             f"trainer.default_local_dir={tmp_path / 'runs'}"]
    proc = subprocess.run([sys.executable, "-m", "streamrl", "run", *script, *small, "run.reward_members=1",
                           "run.warm_start_steps=0"], cwd=tmp_path, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["ended"] == "done" and summary["versions"] == 3, summary
    assert "verl keys accepted as not applicable here: " in proc.stderr  # one line, at start
    accepted = next(line for line in proc.stderr.splitlines() if "not applicable here" in line)
    assert "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu" in accepted
    records = summary["records"]
    assert records["trained"] >= 3 * 4 * 2
    # the prompts over 400 tokens of the tiny policy's tokenizer (bytes) filtered out, from both files
    kept = sum(len(f"user: {r['prompt'][0]['content']}\nassistant: ".encode()) <= 400
               for r in verl_rows(data / "train.jsonl", 24, "train"))
    assert 0 < kept < 24 and records["prompts"] == kept * 15  # the script's 15 epochs, all fed
    assert summary["validation_by_version"], summary  # val_files: the eval stage ran
    assert Path(summary["out"]).parent == tmp_path / "runs"


def test_train_batch_size_alone_is_one_mini_batch_of_all_its_prompts():
    """Without ``ppo_mini_batch_size`` a verl step is one mini-batch of ``train_batch_size``
    prompts: a version here of that many groups, not the config's own mini-batch size."""
    from streamrl.pipeline_config import load_config

    cfg = load_config("local.yaml", ["data.train_batch_size=32"])
    assert (cfg.learner.mini_batches_per_version, cfg.learner.groups_per_mini_batch) == (1, 32)
    cfg = load_config("local.yaml", ["data.train_batch_size=32", "actor_rollout_ref.actor.ppo_mini_batch_size=8"])
    assert (cfg.learner.mini_batches_per_version, cfg.learner.groups_per_mini_batch) == (4, 8)


def test_the_on_policy_distillation_script_distils_as_its_author_wrote(tmp_path):
    """verl's examples/on_policy_distillation_trainer/run_qwen3_8b_fsdp.sh (issue 51): its
    ``distillation.*`` keys as they are, its teacher as the teacher stage's model, no reward group
    (``use_task_rewards=False``)."""
    cfg = resolved_script("opd_qwen3_8b_fsdp", tmp_path).config()
    dl = cfg.distillation.distillation_loss
    assert cfg.distillation.enabled and cfg.learner.distillation is cfg.distillation
    assert (dl.loss_mode, dl.topk, dl.use_task_rewards, dl.use_policy_gradient) == ("k1", 64, False, True)
    assert (dl.loss_max_clamp, dl.log_prob_min_clamp) == (10.0, -10.0)
    (teacher,) = cfg.distillation.teachers(cfg.teacher).values()  # verl's single teacher: every record (issue 59)
    assert (teacher.name, teacher.key, teacher.config.model) == ("teacher_model", "default", "Qwen/Qwen3-32B")
    assert cfg.learner.policy == "Qwen/Qwen3-8B"
