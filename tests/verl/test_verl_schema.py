"""verl's whole configuration (issue 56), not only the scripts we read: every key of verl 0.9.1's
schema has a row (the recorded schema checked against the installed verl); verl's defaults for
each engine start, given at once on one command line; one changed value per mapped row reaches
its streamrl key; a changed value with no counterpart is refused naming the key; values in
Hydra's grammar (``*`` in a list, quotes, escapes) never end in a traceback; Hydra's ``+key``;
images refused where the rows carry them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from omegaconf import OmegaConf

from streamrl.errors import StreamrlError
from streamrl.pipeline_config import PipelineConfig, resolve_config
from streamrl.verl import (IGNORED, MAPPED, REFUSED, VERL_TABLE, coverage, find_row, format_value, ignored_line,
                           read_verl_keys)
from streamrl.verl.overrides import OverrideError, parse_value
from streamrl.verl.rows import ENGINE
from streamrl.verl.schema import ENGINES, MISSING, VERL_VERSION, schema_keys, verl_defaults
from tests.helpers import dry_run

ROOT = Path(__file__).resolve().parents[2]

def _absent_targets() -> set[str]:
    """The table's streamrl keys that the config lacks (a row mapping to a key that does not exist)."""
    cfg = OmegaConf.structured(PipelineConfig)
    out = set()
    for to in {to for row in VERL_TABLE for to in row.to}:
        parts = to.split(".")
        for n in range(1, len(parts) + 1):
            node = OmegaConf.select(cfg, ".".join(parts[:n]), default=KeyError)
            if node is KeyError:
                out.add(to)
                break
            if OmegaConf.is_dict(node) and OmegaConf.get_type(node) is dict:
                break  # a free mapping (reward_kwargs): any key
    return out


def test_every_streamrl_key_of_the_table_exists():
    assert _absent_targets() == set()


# -- the domain: verl's schema -------------------------------------------------------------------

def test_every_key_of_verls_schema_has_a_row():
    missing = sorted(k for k in schema_keys() if find_row(k) is None)
    assert missing == []
    assert len(schema_keys()) > 1300 and {"model_engine", "trainer.use_v1", "trainer.v1.trainer_mode",
                                          "reward.reward_model.enable", "sandbox_fusion.url"} <= schema_keys()
    counts = {section: {kind: len(keys) for kind, keys in kinds.items()} for section, kinds in coverage().items()}
    assert all("none" not in kinds for kinds in counts.values()), counts
    assert counts["actor_rollout_ref"][MAPPED] > 60 and counts["trainer"][MAPPED] > 10


def test_the_recorded_schema_is_the_installed_verls():
    """tools/verl_schema.py --check: the recorded keys and defaults are the installed verl's (a verl
    upgrade fails here: rerun the tool, then give each new key a row)."""
    out = subprocess.run([sys.executable, "tools/verl_schema.py", "--check"], cwd=ROOT, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    from importlib.metadata import version

    assert VERL_VERSION == version("verl")
    dp, megatron = verl_defaults("dp"), verl_defaults("megatron")
    assert dp["actor_rollout_ref.actor.optim.lr"] == 1e-6 and dp["model_engine"] == "dp"
    assert dp["actor_rollout_ref.actor.strategy"] == "fsdp" and megatron["actor_rollout_ref.actor.strategy"] == "megatron"
    assert megatron["actor_rollout_ref.actor.megatron.qat.ignore_patterns"] == ["lm_head", "*mlp.gate"]
    assert dp["trainer.default_local_dir"] == "checkpoints/verl_examples/gsm8k"  # an interpolation, resolved
    assert dp["actor_rollout_ref.rollout.name"] == MISSING


@pytest.mark.parametrize("engine", ENGINES)
def test_verls_defaults_start_on_every_engine(engine, tmp_path):
    """Every key of verl's config for the engine at its default, on one command line (verl's
    mandatory rollout.name left out: it has no default): no problem, no traceback."""
    args = [f"{k}={format_value(v)}" for k, v in verl_defaults(engine).items() if v != MISSING]
    assert len(args) > 840 and f"model_engine={engine}" in args
    code, out, err = dry_run(args, tmp_path)
    assert code == 0 and err == "", err  # veomni's cosine too: its total is the data's, counted at start
    report = [line for line in out.splitlines() if line.startswith("#   ")]
    assert len(report) == len(args)  # one line per key given, as typed


# -- mapped rows: a changed value reaches its streamrl key ----------------------------------------

#: values in the key's own domain (a generic change would be out of it)
CHANGED: dict[str, Any] = {
    "actor_rollout_ref.actor.megatron.router_replay.mode": "R2", "actor_rollout_ref.actor.veomni.router_replay.mode": "R2",
    "actor_rollout_ref.rollout.quantization": "fp8", "actor_rollout_ref.rollout.quantization_config_file": "q.json",
    "actor_rollout_ref.rollout.engine_kwargs.vllm": {"swap_space": 4},
    "actor_rollout_ref.rollout.engine_kwargs.sglang": {"kv_cache_dtype": "fp8_e5m2"},
    "actor_rollout_ref.rollout.agent.default_agent_loop": "tool_agent",
    "algorithm.adv_estimator": "grpo", "algorithm.kl_penalty": "low_var_kl", "algorithm.kl_ctrl.type": "adaptive",
    "algorithm.filter_groups.metric": "acc", "algorithm.gdpo_reward_keys": ["acc"], "algorithm.gdpo_reward_weights": [2.0],
    "actor_rollout_ref.actor.policy_loss.loss_mode": "gspo", "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-sum",
    "critic.loss_agg_mode": "seq-mean-token-sum", "actor_rollout_ref.actor.kl_loss_type": "k1",
    "actor_rollout_ref.actor.optim.lr_scheduler_type": "cosine", "critic.optim.lr_scheduler_type": "cosine",
    "actor_rollout_ref.actor.optim.warmup_style": "cosine", "critic.optim.warmup_style": "cosine",
    "actor_rollout_ref.actor.optim.optimizer": "SGD", "critic.optim.optimizer": "SGD",
    "actor_rollout_ref.actor.optim.name": "SGD", "critic.optim.name": "SGD",
    "actor_rollout_ref.actor.optim.optimizer_impl": "bitsandbytes.optim", "critic.optim.optimizer_impl": "bitsandbytes.optim",
    "actor_rollout_ref.actor.optim.override_optimizer_config": {"foreach": False},
    "critic.optim.override_optimizer_config": {"foreach": False},
    "actor_rollout_ref.actor.optim.lr_decay_style": "cosine", "critic.optim.lr_decay_style": "cosine",
    "actor_rollout_ref.actor.optim.lr_wsd_decay_style": "linear", "critic.optim.lr_wsd_decay_style": "linear",
    "actor_rollout_ref.actor.fsdp_config.model_dtype": "bf16", "actor_rollout_ref.model.path": "/models/qwen",
    "critic.model.path": "/models/critic", "actor_rollout_ref.model.target_modules": ["q_proj", "v_proj"],
    "actor_rollout_ref.rollout.name": "sglang", "actor_rollout_ref.rollout.multi_turn.format": "chatml",
    "actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side": "left",
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": "tools.yaml",
    "actor_rollout_ref.rollout.multi_turn.interaction_config_path": "interaction.yaml",
    "data.train_files": ["a.parquet", "b.parquet"], "data.val_files": "v.parquet", "data.prompt_key": "question",
    "data.truncation": "left", "data.image_key": "pixels", "data.video_key": "clips", "data.audio_key": "sounds",
    "trainer.logger": ["console"], "trainer.project_name": "p", "trainer.experiment_name": "e",
    "trainer.default_local_dir": "/runs/mine", "trainer.resume_mode": "disable", "trainer.resume_from_path": "/runs/x",
    "reward.custom_reward_function.path": "my_reward.py", "reward.custom_reward_function.name": "score",
    "custom_reward_function.path": "my_reward.py", "custom_reward_function.name": "score",
    "reward.reward_manager.name": "batch", "reward_model.reward_manager": "batch",
    "reward.reward_manager.source": "importlib", "reward_model.reward_loop_source": "importlib",
    "reward.reward_manager.module.name": "MyManager", "reward_model.reward_loop_class_name": "MyManager",
    **{f"{p}rollout.{k}": v for p in ("reward.reward_model.", "reward_model.")
       for k, v in (("name", "vllm"), ("dtype", "float16"), ("load_format", "dummy"), ("quantization", "fp8"),
                    ("engine_kwargs", {"vllm": {"swap_space": 4}}))},
    "distillation.distillation_loss.loss_mode": "k1", "distillation.distillation_loss.policy_loss_mode": "gspo",
    "distillation.teacher_models.teacher_model.model_path": "/models/teacher",
    "actor_rollout_ref.model.override_config": {"max_position_embeddings": 4096},
    "actor_rollout_ref.rollout.dtype": "fp16",
    "critic.model.override_config": {"attention_dropout": 0.1},
}

#: the other keys a key is read with (verl reads them together)
CONTEXT: dict[str, list[str]] = {
    "actor_rollout_ref.actor.veomni.router_replay.mode": ["model_engine=veomni"],
    "actor_rollout_ref.rollout.quantization": ["actor_rollout_ref.rollout.name=vllm"],
    "actor_rollout_ref.rollout.engine_kwargs.vllm": ["actor_rollout_ref.rollout.name=vllm"],
    "actor_rollout_ref.rollout.engine_kwargs.sglang": ["actor_rollout_ref.rollout.name=sglang",
                                                       "actor_rollout_ref.model.path=m"],
    "actor_rollout_ref.rollout.quantization_config_file": ["actor_rollout_ref.rollout.name=vllm",
                                                           "actor_rollout_ref.rollout.quantization=fp8"],
    "actor_rollout_ref.actor.kl_loss_coef": ["actor_rollout_ref.actor.use_kl_loss=true"],
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": ["actor_rollout_ref.actor.use_dynamic_bsz=true"],
    "critic.ppo_max_token_len_per_gpu": ["critic.use_dynamic_bsz=true"],
    "algorithm.filter_groups.metric": ["algorithm.filter_groups.enable=true"],
    "algorithm.filter_groups.max_num_gen_batches": ["algorithm.filter_groups.enable=true"],
    "trainer.resume_from_path": ["trainer.resume_mode=resume_path"],
    "trainer.v1.sampler.max_off_policy_threshold": ["trainer.v1.trainer_mode=separate_async"],
    "actor_rollout_ref.rollout.val_kwargs.do_sample": ["actor_rollout_ref.rollout.val_kwargs.temperature=0.7"],
}

#: mapped rows that set nothing whatever their value: a check, or read with another key
SETS_NOTHING = {"actor_rollout_ref.actor.qat.enable", "critic.ppo_mini_batch_size", "actor_rollout_ref.rollout.multi_turn.enable",
                "trainer.v1.sampler.max_off_policy_strategy", "reward.launch_reward_fn_async",
                *(r.key for r in VERL_TABLE if r.key.endswith(".qat.enable")),  # QAT: off or refused
                # Megatron's TransformerConfig: not applicable (recomputation, kernels) or refused
                *(r.key for r in VERL_TABLE if r.key.endswith(".override_transformer_config"))}


def _changed(key: str, default: Any) -> Any:
    if key in CHANGED:
        return CHANGED[key]
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return 3 if default <= 0 else default * 2
    if isinstance(default, float):
        return 0.25 if default == 0 else default / 2
    if isinstance(default, list):
        return [x / 2 if isinstance(x, float) else x for x in default]
    if default is None or default == "ABSENT":
        return 4
    raise AssertionError(f"no changed value for {key} (default {default!r}): add one to CHANGED")


def _mapped_keys() -> list[str]:
    keys = []
    for row in VERL_TABLE:
        if row.kind != MAPPED or row.key in SETS_NOTHING:
            continue
        if "*" not in row.key:
            keys.append(row.key)
        else:  # a pattern: its first key in verl's schema
            under = sorted(k for k in schema_keys() if row.matches(k) and find_row(k) is row)
            keys += under[:1]
    return keys


def _default(key: str) -> Any:
    for engine in ENGINES:
        if key in verl_defaults(engine):
            return verl_defaults(engine)[key]
    return "ABSENT"


def _sets(args: list[str], strict: bool = True) -> dict[str, Any]:
    from streamrl.verl import read_command_line

    given = [pair for a in args for pair in read_command_line(a)[0]]
    out: dict[str, Any] = {}
    for o in read_verl_keys(given):
        assert o.kind in (MAPPED, IGNORED) or not strict, (o.typed, o.kind, o.why)
        out.update(o.sets)
    return out


@pytest.mark.parametrize("key", _mapped_keys())
def test_a_changed_value_reaches_its_streamrl_key(key, tmp_path):
    default = _default(key)
    value = _changed(key, default)
    context = CONTEXT.get(key, [])
    if key.startswith(("actor_rollout_ref.actor.megatron.", "critic.megatron.")):
        context = [*context, "model_engine=megatron"]
    changed = _sets([*context, f"{key}={format_value(value)}"])
    base = _sets([*context, f"{key}={format_value(default)}"], strict=False) if default not in ("ABSENT", MISSING) else {}
    assert changed and changed != base, (key, value, changed, base)
    targets = find_row(key).to
    assert set(changed) & set(targets) or any(k.startswith(t + ".") for k in changed for t in targets)
    # through the whole config: each streamrl key has the value the table set
    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        r = resolve_config(None, [*context, f"{key}={format_value(value)}"])
    finally:
        os.chdir(here)
    assert not [p for p in r.problems if key in p and "refused" in p], r.problems
    assert r.cfg is not None, r.problems
    resolved = OmegaConf.structured(r.cfg)
    for target, want in changed.items():
        if target.split(".")[0] in ("reward_model", "custom_reward_function"):
            continue  # folded into reward.scorers at resolve time (tests/verl/test_verl_keys.py)
        got = OmegaConf.select(resolved, target)
        if isinstance(want, bool) and isinstance(got, str):  # learner.use_remove_padding: auto, true, false
            got = {"true": True, "false": False}.get(got.lower(), got)
        assert got == want, (key, target, want)


# -- refused rows: values decide --------------------------------------------------------------------

def _refused_keys() -> list[str]:
    out = []
    for row in VERL_TABLE:
        if row.kind != REFUSED:
            continue
        under = [row.key] if "*" not in row.key else sorted(k for k in schema_keys() if find_row(k) is row)[:1]
        out += [k for k in under if k in schema_keys() and find_row(k) is row]
    return out


def _other(default: Any) -> Any:
    if isinstance(default, bool):
        return not default
    if isinstance(default, (int, float)):
        return default + 3
    if isinstance(default, list):
        return [*default, "x"]
    if isinstance(default, dict):
        return {**default, "x": 1}
    return "something_else"


@pytest.mark.parametrize("key", _refused_keys())
def test_a_value_with_no_counterpart_is_refused_naming_the_key_and_its_default_is_not(key):
    engine = next(e for e in ENGINES if key in verl_defaults(e))
    context = [("model_engine", engine)]
    default = verl_defaults(engine)[key]
    [at_default] = read_verl_keys([*context, (key, default)])[1:]
    assert at_default.kind == IGNORED and "verl's default" in at_default.why
    [other] = read_verl_keys([*context, (key, _other(default))])[1:]
    assert other.kind == REFUSED and other.why == find_row(key).note
    code, out, err = dry_run([f"model_engine={engine}", f"{key}={format_value(_other(default))}"], ROOT)
    assert code == 2 and key in err and "refused" in err


def test_null_is_accepted_wherever_verls_default_is_null():
    nulls = [(k, None) for k, v in verl_defaults("dp").items() if v is None]
    assert len(nulls) > 150
    outcomes = read_verl_keys(nulls)
    assert [o.typed for o in outcomes if o.kind not in (MAPPED, IGNORED)] == []
    r = resolve_config(None, [f"{k}=null" for k, _ in nulls])
    assert r.problems == [], r.problems


# -- the cases -----------------------------------------------------------------------------

def test_the_keys_that_stopped_verls_other_scripts(tmp_path):
    """The keys of the 25 scripts that did not start (issue 56's table), with their values."""
    args = ["model_engine=megatron", "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=4096",
            "actor_rollout_ref.actor.optim.clip_grad=0.5", "+actor_rollout_ref.rollout.moe_tensor_parallel_size=2",
            "+actor_rollout_ref.actor.optim.override_optimizer_config.optimizer_offload_fraction=1",
            "+actor_rollout_ref.actor.optim.override_optimizer_config.overlap_cpu_optimizer_d2h_h2d=True",
            "data.image_patch_size=28", "data.image_key=images", "+actor_rollout_ref.actor.policy_loss.tau_pos=1.5",
            "+actor_rollout_ref.actor.policy_loss.tau_neg=2.0", "reward.num_workers=16", "reward.reward_model.enable=false",
            "reward.reward_model.rollout.gpu_memory_utilization=0.8", "sandbox_fusion.url=null",
            "sandbox_fusion.max_concurrent=32", "actor_rollout_ref.actor.megatron.qat.ignore_patterns=[lm_head,*mlp.gate]",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4"]
    code, out, err = dry_run(args, tmp_path)
    assert code == 0, err
    r = resolve_config(None, args)
    cfg = r.config()
    assert cfg.learner.grad_clip == 0.5 and (cfg.learner.tau_pos, cfg.learner.tau_neg) == (1.5, 2.0)
    assert cfg.feed.image_key == "images"
    assert cfg.run.reward_members == 16  # verl's reward-loop workers: the reward group's members
    line = ignored_line(r.verl)
    for typed in ("model_engine", "update_weights_bucket_megabytes", "moe_tensor_parallel_size", "image_patch_size",
                  "override_optimizer_config.optimizer_offload_fraction", "qat.ignore_patterns"):
        assert typed in line, (typed, line)
    # the same keys that change training, refused naming them
    r = resolve_config(None, ["sandbox_fusion.url=http://localhost:8080", "actor_rollout_ref.rollout.name=hf",
                              "actor_rollout_ref.rollout.quantization=fp8", "reward.reward_model.enable=true"])
    assert any("rollout.quantization" in p for p in r.problems)  # (quantised rollouts: vLLM and SGLang only)
    assert not any("sandbox_fusion" in p for p in r.problems)  # the code rule's sandbox (tests/sandbox)
    assert any("reward_model.enable" in p for p in r.problems)


def test_the_engine_decides_what_override_optimizer_config_is():
    """verl hands override_optimizer_config to torch's optimizer (dp) or to Megatron's OptimizerConfig."""
    key = "+actor_rollout_ref.actor.optim.override_optimizer_config.foreach"
    [dp] = read_verl_keys([(key, False)])
    assert dp.sets == {"learner.override_optimizer_config.foreach": False}
    megatron = read_verl_keys([("model_engine", "megatron"), (key, False)])[1]
    assert megatron.kind == IGNORED and "Megatron" in megatron.why
    strategy = read_verl_keys([("actor_rollout_ref.actor.strategy", "megatron"), (key, False)])[1]
    assert strategy.kind == IGNORED  # a script written for ppo_megatron_trainer names its engine so


# -- Hydra's grammar ------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, value", [
    ("[lm_head,*mlp.gate]", ["lm_head", "*mlp.gate"]), ("['a b', \"c,d\"]", ["a b", "c,d"]),
    ("[1, 2.5, true, null, x]", [1, 2.5, True, None, "x"]), ("{a: 1, b: [x, y]}", {"a": 1, "b": ["x", "y"]}),
    ("1_000", 1000), ("-1", -1), ("1e-6", 1e-6), (".5", 0.5), ("inf", float("inf")), ("TRUE", True), ("Null", None),
    ("'null'", "null"), ("'it\\'s'", "it's"), ("a\\,b", "a,b"), ("a\\ b", "a b"), ("~/data/x.parquet", "~/data/x.parquet"),
    ("re:.*mlp.gate$", "re:.*mlp.gate$"), ("1.0.0", "1.0.0"), ("  padded  ", "padded"), ("", ""), ("[]", []),
    ("${trainer.project_name}", "${trainer.project_name}"), ("'cuda,nvtx'", "cuda,nvtx"),
])
def test_hydras_override_grammar_reads_values_as_verl(text, value):
    assert parse_value(text) == value
    assert parse_value(format_value(value)) == value  # and writes them back


@pytest.mark.parametrize("text, why", [
    ("a,b", "sweep"), ("[a,b", "expected ']'"), ("'open", "unclosed"), ("choice(a,b)", "function"),
    ("a'b'", "quote inside"), ("x=y", "'='"), ("{:1}", "a value expected"),
])
def test_a_value_hydra_cannot_read_is_named_never_a_traceback(text, why, tmp_path):
    with pytest.raises(OverrideError, match=why):
        parse_value(text)
    code, out, err = dry_run([f"actor_rollout_ref.actor.qat.ignore_patterns={text}", "trainer.total_epochs=1"], tmp_path)
    assert code == 2 and err.startswith("streamrl run: actor_rollout_ref.actor.qat.ignore_patterns=") and why in err


def test_the_star_list_value_of_verls_megatron_config(tmp_path):
    args = ["actor_rollout_ref.actor.megatron.qat.ignore_patterns=[lm_head,*mlp.gate]",
            "actor_rollout_ref.actor.qat.ignore_patterns=[lm_head,'re:.*mlp.gate$']"]
    code, out, err = dry_run(args, tmp_path)
    assert code == 0, err
    assert "ignore_patterns=[lm_head,*mlp.gate] -> not applicable here" in out


# -- Hydra's +key ---------------------------------------------------------------------------------------

def test_a_plus_key_verl_lacks_is_accepted_and_named_as_what_verl_does_with_it(tmp_path):
    outcomes = read_verl_keys([("+trainer.my_callback_setting", 3), ("+actor_rollout_ref.rollout.moe_tensor_parallel_size", 2),
                               ("+actor_rollout_ref.actor.policy_loss.tau_pos", 0.5)])
    added, moe, tau = outcomes
    assert added.kind == IGNORED and "not in verl's schema" in added.why and "nothing here" in added.why
    assert moe.kind == IGNORED and moe.why == ENGINE  # verl's RolloutConfig reads it (a field its yaml lacks)
    assert tau.kind == MAPPED and tau.sets == {"learner.tau_pos": 0.5}
    [plain] = read_verl_keys([("trainer.my_callback_setting", 3)])  # without +: verl refuses it too
    assert plain.kind == "unknown"
    code, out, err = dry_run(["+trainer.my_callback_setting=3", "++data.max_response_length=64"], tmp_path)
    assert code == 0, err
    assert "+trainer.my_callback_setting=3 -> not applicable here: not in verl's schema" in out
    assert "++data.max_response_length=64 -> rollout.max_new_tokens=64" in out


def test_a_tilde_key_is_named():
    [o] = read_verl_keys([("~trainer.logger", None)])
    assert o.kind == "bad" and "~" in o.why


# -- images: refused where the rows carry them ------------------------------------------------------

def _rows(images: list[Any]) -> list[dict[str, Any]]:
    return [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"q{i}"}], "images": img,
             "reward_model": {"style": "rule", "ground_truth": "1"}, "extra_info": {"index": i}} for i, img in enumerate(images)]


def test_images_are_refused_by_the_feed_where_the_rows_carry_them(tmp_path):
    from streamrl.feed.prompts import build_prompts

    text = tmp_path / "text.parquet"
    pq.write_table(pa.Table.from_pylist(_rows([[], None, []])), text)
    cfg = resolve_config(None, [f"data.train_files={text}", "data.image_key=images"]).config()
    assert len(list(build_prompts(cfg.feed))) == 3  # an empty image column is text
    pictures = tmp_path / "pictures.parquet"
    pq.write_table(pa.Table.from_pylist(_rows([[], [{"bytes": b"\x89PNG", "path": "a.png"}]])), pictures)
    cfg = resolve_config(None, [f"data.train_files={pictures}"]).config()
    with pytest.raises(StreamrlError, match=r"row 2: column 'images' carries images \(verl's data.image_key"):
        list(build_prompts(cfg.feed))
    cfg = resolve_config(None, [f"data.train_files={pictures}", "data.image_key=pixels"]).config()
    assert len(list(build_prompts(cfg.feed))) == 2  # verl reads its images from the column data.image_key names


def test_the_refused_rows_name_what_is_missing():
    assert all(row.note for row in VERL_TABLE if row.kind in (IGNORED, REFUSED))
    assert find_row("actor_rollout_ref.actor.optim.muon_momentum").kind == IGNORED
    assert find_row("critic.optim._target_").key == "*._target_"


def test_verls_global_micro_batch_and_optimizer_names_read_as_verl_reads_them():
    """verl divides the deprecated global ppo_micro_batch_size by the world's GPUs; Megatron's lowercase
    adam is AdamW (decoupled weight decay), FSDP's torch.optim class names are themselves."""
    outcomes = read_verl_keys([("trainer.n_gpus_per_node", 4), ("trainer.nnodes", 2),
                               ("actor_rollout_ref.actor.ppo_micro_batch_size", 64), ("critic.ppo_micro_batch_size", 16),
                               ("actor_rollout_ref.actor.optim.optimizer", "adam"), ("critic.optim.optimizer", "Adam")])
    sets = {k: v for o in outcomes for k, v in o.sets.items()}
    assert sets["learner.micro_batch_size"] == 8 and sets["learner.critic.micro_batch_size"] == 2
    assert sets["learner.optimizer"] == "AdamW" and sets["learner.critic.optimizer"] == "Adam"
    [per_gpu, _] = read_verl_keys([("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", 4),
                                   ("actor_rollout_ref.actor.ppo_micro_batch_size", 64)])
    assert per_gpu.sets == {"learner.micro_batch_size": 4}  # the per-GPU form wins, as in verl
