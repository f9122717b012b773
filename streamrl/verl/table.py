"""verl's table: one row for every key of verl's schema (``streamrl.verl.schema``), by section:
``actor_rollout_ref``'s rows are ``streamrl.verl.table_actor``'s, the rest are here. A test
(tests/verl/test_verl_schema.py) fails when a key of the recorded schema has no row."""

from __future__ import annotations

from typing import Any

from streamrl.verl.rows import (_DISTILLATION_LOSS, CHUNKED_TOPK, ENGINE, FSDP_TUNING, MULTIMODAL,
                                PROFILER, RAY,
                                STREAMING, TEACHER_SCALE, Given, Refused, Row, _adv_estimator, _batch, _bool,
                                _critic_warmup, _files, _int, _logger, _minus_one_off, _overlong, _resume_mode, _same,
                                _save_freq, _total_epochs, _total_steps, ignored, mapped, refused)
from streamrl.verl.table_actor import (ACTOR_ROWS, TARGET, engine_rows, global_micro, model_rows, optim_rows,
                                      override_rows)

__all__ = ["VERL_TABLE", "VERL_TOPS"]

V1 = ("verl's V1 trainer and its modes (sync, colocated or separate async): streamrl's stages stream, the learner "
      "training on samples up to learner.max_staleness versions old")
#: the reward model's rollout.* keys streamrl reads (streamrl.reward.config.reward_model_entry: its servers' flags)
_RM_READ = ("name", "tensor_model_parallel_size", "data_parallel_size", "engine_kwargs", "prompt_length",
            "response_length", "dtype", "gpu_memory_utilization", "enforce_eager", "max_model_len", "max_num_seqs",
            "max_num_batched_tokens", "load_format", "seed", "quantization", "enable_prefix_caching",
            "enable_chunked_prefill")
RM_SAMPLING = ("the reward model's sampling settings: verl sends none of them (a discriminative model is not sampled; "
               "a generative model's requests carry what your reward function asks)")
RM_SLEEP = "verl frees the reward model's memory between steps to share GPUs with training; here its servers keep theirs"


def _rm_rows(prefix: str) -> tuple[Row, ...]:
    """verl's reward model, in its 0.9.1 section (``reward.reward_model.``) or its legacy one
    (``reward_model.``): streamrl.reward.config.reward_model_entry reads it."""
    legacy = prefix == "reward_model."
    rows = [
        mapped(f"{prefix}model.path" if legacy else f"{prefix}model_path", "reward_model.model_path",
               note="the reward model: a reward.scorers entry reward_model (discriminative) or the servers a "
                    "custom function calls through reward_router_address (generative)"),
        *(mapped(f"{prefix}{k}", f"reward_model.{k}",
                 note="the reward model's own GPUs (verl's standalone pool), shared among the reward group's members: "
                      "replicas of tensor_model_parallel_size GPUs (reward.servers.reward_model), the group's placement")
          for k in ("enable_resource_pool", "n_gpus_per_node", "nnodes")),
        *(mapped(f"{prefix}rollout.{k}", f"reward_model.rollout.{k}",
                  note="the reward model's servers (rollout.name vllm or sglang; unset or hf: transformers in each "
                       "member): replicas, flags, batches (streamrl.reward.config.reward_model_entry)")
          for k in _RM_READ),
        mapped(f"{prefix}rollout.engine_kwargs.*", "reward_model.rollout.engine_kwargs",
               note="one key of engine_kwargs (Hydra's +...engine_kwargs.vllm.key=v): the servers' --key value"),
        *(ignored(f"{prefix}rollout.{k}", RM_SAMPLING) for k in ("temperature", "top_k", "top_p", "do_sample", "n",
                                                                 "ignore_eos")),
        ignored(f"{prefix}rollout.free_cache_engine", RM_SLEEP),
        ignored(f"{prefix}rollout.multi_stage_wake_up", RM_SLEEP),
        ignored(f"{prefix}rollout.limit_images", MULTIMODAL),
        *(ignored(f"{prefix}rollout.{k}", ENGINE) for k in ("cudagraph_capture_sizes", "expert_parallel_size",
                                                            "pipeline_model_parallel_size", "layered_summon",
                                                            "scheduling_policy", "disable_log_stats", "mtp",
                                                            "full_determinism", "skip_tokenizer_init")),
        ignored(f"{prefix}rollout.disaggregation.*", ENGINE + " (prefill and decode on separate servers)"),
        refused(f"{prefix}rollout.quantization_config_file", "a quantization config file for the reward model's "
                                                             "servers (rollout.quantization is read)"),
    ]
    if legacy:  # verl's legacy section has fewer rollout keys
        from streamrl.verl.schema import schema_keys

        rows = [r for r in rows if "*" in r.key or r.key in schema_keys()]
        rows += [refused(f"{prefix}model.external_lib", "a module holding the reward model's classes"),
                 ignored(f"{prefix}model.trust_remote_code", "the reward model loads with transformers' own classes "
                                                             "(a model that needs its own code fails at start)")]
    return tuple(rows)


CRITIC_BATCH = "the critic's forward passes run the learner's micro-batches and mini-batches"
_ASYNC_MODES = ("colocate_async", "separate_async")


def _off_policy(value: Any, given: Given) -> dict[str, Any]:
    """verl's V1 sampler bound: used in its async modes only."""
    if given.get("trainer.v1.trainer_mode", "sync") not in _ASYNC_MODES:
        return {}
    return {"learner.max_staleness": _int(value)}


def _off_policy_strategy(value: Any, given: Given) -> dict[str, Any]:
    if value != "drop" and given.get("trainer.v1.trainer_mode", "sync") in _ASYNC_MODES:
        raise Refused(f"the sampler strategy {value!r} for stale samples: the learner drops them (drop)")
    return {}


def _filter_groups(name: str) -> Any:
    """DAPO's dynamic sampling: its settings are read only when it is on."""
    def read(value: Any, given: Given) -> dict[str, Any]:
        on = _bool(value if name == "enable" else given.get("algorithm.filter_groups.enable", False))
        return {f"learner.filter_groups.{name}": value} if on or name == "enable" else {}
    return read


def _critic_micro(value: Any, given: Given) -> dict[str, Any]:
    return {} if value is None else {"learner.critic.micro_batch_size": _int(value)}


def _critic_tokens(value: Any, given: Given) -> dict[str, Any]:
    if not _bool(given.get("critic.use_dynamic_bsz", False)):
        return {}
    return {"learner.critic.max_tokens_per_micro_batch": _int(value)}


def _critic_mini_batch(value: Any, given: Given) -> dict[str, Any]:
    """verl's critic takes an optimizer step per its own mini-batch; here per the policy's."""
    actor = given.get("actor_rollout_ref.actor.ppo_mini_batch_size", 256)  # (verl's default for both)
    if _int(value) != _int(actor):
        raise Refused("critic mini-batches of another size than the actor's (the critic steps with the policy's "
                      "mini-batches, actor_rollout_ref.actor.ppo_mini_batch_size)")
    return {}


def _critic_dynamic(value: Any, given: Given) -> dict[str, Any]:
    if not _bool(value):
        return {"learner.critic.max_tokens_per_micro_batch": 0}
    return {"learner.critic.max_tokens_per_micro_batch": _int(given.get("critic.ppo_max_token_len_per_gpu", 32768))}


def _reward_workers(value: Any, given: Given) -> dict[str, Any]:
    """verl's reward-loop workers (reward.num_workers, legacy reward_model.num_workers): the
    reward group's members; null (the legacy default) sets nothing."""
    if value is None:
        return {}
    n = _int(value, "an integer >= 1")
    if n < 1:
        raise ValueError(f"an integer >= 1 (got {value!r})")
    return {"run.reward_members": n}


VERL_TABLE: tuple[Row, ...] = (
    # -- algorithm ---------------------------------------------------------------------------------
    mapped("algorithm.adv_estimator", "learner.adv_estimator", read=_adv_estimator,
           note="gae trains a critic in the learner's processes (learner.critic); remax turns "
                "rollout.greedy_baseline on"),
    mapped("algorithm.norm_adv_by_std_in_grpo", "learner.norm_adv_by_std_in_grpo"),
    mapped("algorithm.gamma", "learner.gamma"),
    mapped("algorithm.use_kl_in_reward", "learner.use_kl_in_reward"),
    mapped("algorithm.kl_penalty", "learner.kl_penalty"),
    *(mapped(f"algorithm.kl_ctrl.{k}", f"learner.kl_ctrl.{k}") for k in ("type", "kl_coef", "horizon", "target_kl")),
    *(mapped(f"algorithm.filter_groups.{k}", f"learner.filter_groups.{k}", read=_filter_groups(k),
             note="read with filter_groups.enable (off: changes nothing)")
      for k in ("enable", "metric", "max_num_gen_batches")),
    ignored("algorithm.filter_groups.max_inflight_gen_batches", "DAPO's generation batches in flight: " + STREAMING),
    mapped("algorithm.lam", "learner.lam", note="GAE's lambda (adv_estimator=gae)"),
    mapped("algorithm.rollout_correction.*", "learner.rollout_correction",
           note="verl's rollout correction, decoupled or bypass; rollout_corr/* figures"),
    *(mapped(f"algorithm.{k}", f"learner.{k}", note="GDPO's reward components (reward_info fields)")
      for k in ("gdpo_reward_keys", "gdpo_reward_weights")),
    refused("algorithm.use_pf_ppo", "verl's PF-PPO reweighting of samples"),
    ignored("algorithm.pf_ppo.*", "PF-PPO's settings, read only with algorithm.use_pf_ppo (refused when on)"),
    *ACTOR_ROWS,
    # -- the critic (issue 48: adv_estimator=gae) ----------------------------------------------------------
    mapped("critic.model.path", "learner.critic.model", note="its weights; a fresh value head on top"),
    *(mapped(f"critic.{k}", f"learner.critic.{k}") for k in ("cliprange_value", "grad_clip", "ppo_epochs",
                                                               "loss_agg_mode")),
    *optim_rows("critic.optim.", "learner.critic."),
    mapped("critic.ppo_micro_batch_size_per_gpu", "learner.critic.micro_batch_size", read=_critic_micro,
           note="the critic's sequences per forward pass on each rank; null: the learner's"),
    mapped("critic.ppo_micro_batch_size", "learner.critic.micro_batch_size", read=global_micro("critic.", "learner.critic."),
           note="verl's deprecated global form, divided by the GPUs as verl does"),
    mapped("critic.use_dynamic_bsz", "learner.critic.max_tokens_per_micro_batch", read=_critic_dynamic,
           note="on: the critic's token budget ppo_max_token_len_per_gpu; off: 0 (the learner's)"),
    mapped("critic.ppo_max_token_len_per_gpu", "learner.critic.max_tokens_per_micro_batch", read=_critic_tokens,
           note="read with critic.use_dynamic_bsz"),
    mapped("critic.ppo_mini_batch_size", read=_critic_mini_batch,
           note="the critic steps with the policy's mini-batches: a size other than the actor's is refused"),
    *(ignored(f"critic.{k}", CRITIC_BATCH) for k in ("forward_micro_batch_size",
                                                     "forward_micro_batch_size_per_gpu", "forward_max_token_len_per_gpu",
                                                     "rollout_n")),
    refused("critic.loss_scale_factor", "a fixed divisor of the critic's loss (the learner's is learner.loss_scale_factor)"),
    ignored("critic.model.use_remove_padding", "the critic's forward passes are padded; the same values"),
    ignored("critic.model.enable_gradient_checkpointing", "the critic follows learner.gradient_checkpointing"),
    ignored("critic.model.fsdp_config.*", FSDP_TUNING),
    ignored("critic.model.tokenizer_path", "the critic reads the policy's token ids"),
    *(refused(f"critic.model.{k}", "LoRA on the critic: it trains whole") for k in ("lora_rank", "lora_alpha",
                                                                                  "target_modules")),
    *model_rows("critic.model."),
    *override_rows("critic.model.", "learner.critic.override_config"),
    ignored("critic.enable", "the critic is on with adv_estimator=gae"),
    ignored("critic.nccl_timeout", "learner.parallel.timeout_s is streamrl's"),
    *engine_rows("critic.", "learner.critic.cpu_offload", "fsdp"),
    ignored("critic.profiler.*", PROFILER),
    # -- data ---------------------------------------------------------------------------------------------
    mapped("data.train_files", "feed.dataset", "feed.more_datasets", "feed.limit",
           read=_files("feed", "data.train_max_samples"),
           note="a list is read one file after the other; every row (feed.limit 0) unless train_max_samples"),
    mapped("data.val_files", "eval.dataset", "eval.more_datasets", "eval.limit",
           read=_files("eval", "data.val_max_samples"),
           note="a list is read one file after the other; every row (eval.limit 0) unless val_max_samples"),
    mapped("data.train_max_samples", "feed.limit", read=_minus_one_off("feed.limit"), note="-1: every row"),
    mapped("data.val_max_samples", "eval.limit", read=_minus_one_off("eval.limit"), note="-1: every row"),
    mapped("data.prompt_key", "feed.prompt_key"),
    mapped("data.max_prompt_length", "feed.max_prompt_length", note="tokens, with the policy's tokenizer and chat "
                                                                    "template, as verl's dataset counts them"),
    mapped("data.truncation", "feed.truncation"),
    mapped("data.filter_overlong_prompts", "feed.filter_overlong_prompts"),
    mapped("data.max_response_length", "rollout.max_new_tokens", note="per assistant turn"),
    mapped("data.shuffle", "feed.shuffle"),
    mapped("data.seed", "feed.seed", read=lambda v, g: {} if v is None else {"feed.seed": _int(v)},
           note="null: the feed's own"),
    mapped("data.train_batch_size", "learner.mini_batches_per_version", read=_batch,
           note="prompts per version: train_batch_size / ppo_mini_batch_size optimizer steps of "
                "ppo_mini_batch_size groups (rollout.trajectories_per_version follows)"),
    *(mapped(f"data.{k}", f"feed.{k}", note="the column of a row's " + what + ": a row carrying any is refused by "
                                            "the feed, naming the column (the rollout reads text)")
      for k, what in (("image_key", "images"), ("video_key", "videos"), ("audio_key", "audio"))),
    *(ignored(f"data.{k}", "the images' processing, read only for rows that carry images (refused by the feed)")
      for k in ("image_patch_size", "mm_processor_kwargs", "return_multi_modal_inputs")),
    ignored("data.return_full_prompt", "what verl's dataset hands its own trainer"),
    ignored("data.return_raw_input_ids", "what verl's dataset hands its own trainer"),
    ignored("data.validation_shuffle", "the order of the validation rows: the same scores"),
    refused("data.apply_chat_template_kwargs", "arguments to the chat template (enable_thinking, ...): prompts are "
                                               "rendered with the template's defaults"),
    refused("data.apply_chat_template_kwargs.*", "arguments to the chat template"),
    refused("data.tool_config_path", "tool schemas in the dataset's prompts: tools come from "
                                     "actor_rollout_ref.rollout.multi_turn.tool_config_path"),
    refused("data.function_tool_path", "tools from a Python file's functions"),
    ignored("data.filter_overlong_prompts_workers", "processes verl's filter uses"),
    ignored("data.return_raw_chat", "the rollout workers always get the prompt's chat messages"),
    ignored("data.val_batch_size", "the eval stage's batching"),
    ignored("data.dataloader_num_workers", "verl's data loader processes"),
    ignored("data.trust_remote_code", "the tokenizer loads with transformers' own classes"),
    ignored("data.use_shm", "verl's copy of the data into shared memory"),
    ignored("data.gen_batch_size", "DAPO's generation batch: " + STREAMING
            + "; groups filtered out (learner.filter_groups) are replaced as the stream brings more"),
    refused("data.custom_cls.path", "a Dataset class of your own (it changes the rows trained on): the feed reads "
                                    "rows in verl's preprocessed format (prompt, data_source, "
                                    "reward_model.ground_truth, extra_info) as they are; run the class once, to "
                                    "parquet", harmless=(None, "")),
    ignored("data.custom_cls.*", "verl's Dataset class's name, read only with data.custom_cls.path (refused)"),
    ignored("data.reward_fn_key", "the rows' data_source picks the scorer"),
    ignored("data.tokenizer", "the policy's tokenizer (actor_rollout_ref.model.path)"),
    # -- the trainer ---------------------------------------------------------------------------------------
    mapped("trainer.total_epochs", "feed.epochs", "learner.versions", read=_total_epochs,
           note="without total_training_steps the run ends when the data does (learner.versions 0)"),
    mapped("trainer.total_training_steps", "learner.versions", read=_total_steps),
    mapped("trainer.save_freq", "learner.checkpoint_every", read=_save_freq,
           note="-1: a checkpoint at the end only (it also holds the consumer offsets)"),
    mapped("trainer.test_freq", "eval.every", read=_minus_one_off("eval.every"),
           note="-1: no evaluation but val_before_train's and the last version's"),
    mapped("trainer.val_before_train", "eval.before_train"),
    mapped("trainer.logger", "tracking.loggers", read=_logger),
    mapped("trainer.project_name", "tracking.project"),
    mapped("trainer.experiment_name", "tracking.experiment"),
    mapped("trainer.default_local_dir", "run.out_dir", note="each run gets its directory under it"),
    mapped("trainer.resume_mode", "run.resume", read=_resume_mode),
    mapped("trainer.resume_from_path", "run.resume", note="read with resume_mode=resume_path", read=lambda v, g: {}),
    mapped("trainer.max_actor_ckpt_to_keep", "learner.keep_checkpoints",
           read=lambda v, g: {} if v is None else {"learner.keep_checkpoints": _int(v)}),
    mapped("trainer.n_gpus_per_node", "learner.parallel.nproc",
           note="the learner's ranks per node (the rollout servers take their own GPUs)"),
    mapped("trainer.nnodes", "learner.parallel.nnodes"),
    mapped("trainer.critic_warmup", "learner.critic_warmup", read=_critic_warmup,
           note="the versions numbered below it train the critic alone, as verl's steps (the policy unchanged)"),
    ignored("trainer.balance_batch", "verl's reordering of a batch to balance tokens across GPUs: the learner "
                                     "balances its micro-batches by tokens itself"),
    ignored("trainer.log_val_generations", "every validation response is on the eval topic"),
    ignored("trainer.use_legacy_worker_impl", "verl's worker implementation"),
    ignored("trainer.device", "learner.device and rollout.device are streamrl's"),
    ignored("trainer.ray_wait_register_center_timeout", RAY),
    ignored("trainer.rollout_data_dir", "the rollouts are on the rollouts topic (streamrl archive, replay)"),
    ignored("trainer.validation_data_dir", "the validation responses are on the eval topic"),
    ignored("trainer.del_local_ckpt_after_load", "the checkpoints stay in the run directory"),
    ignored("trainer.esi_redundant_time", "verl's elastic-instance checkpointing"),
    ignored("trainer.profile_steps", PROFILER),
    ignored("trainer.val_only", "streamrl eval evaluates a run's versions on its own"),
    refused("trainer.checkpoint_callback_class", "a checkpoint callback of your own"),
    ignored("trainer.default_hdfs_dir", "verl's copy of checkpoints to HDFS: a run's checkpoints are in its directory "
                                        "(run.out_dir), its weights at learner.weights_uri"),
    ignored("trainer.max_critic_ckpt_to_keep", "the critic is in the learner's checkpoints (learner.keep_checkpoints)"),
    # -- verl's V1 trainer (sync, colocated-async, separate-async) -----------------------------------
    ignored("trainer.use_v1", V1),
    ignored("trainer.v1.trainer_mode", V1 + "; in an async mode sampler.max_off_policy_threshold is "
                                            "learner.max_staleness"),
    mapped("trainer.v1.sampler.max_off_policy_threshold", "learner.max_staleness", read=_off_policy,
           note="in verl's async modes (trainer.v1.trainer_mode): the versions a sample may lag; sync: unused"),
    mapped("trainer.v1.sampler.max_off_policy_strategy", read=_off_policy_strategy,
           note="drop: the learner drops a sample staler than max_staleness, as verl"),
    refused("trainer.v1.sampler.custom_sampler.*", "a sampler of your own"),
    refused("trainer.v1.sampler.sampler_kwargs", "a sampler of your own's arguments"),
    refused("trainer.v1.sampler.sampler_kwargs.*", "a sampler of your own's arguments"),
    ignored("trainer.v1.sampler.sync_refill_failed_groups", "groups filtered out are replaced as the stream brings more"),
    ignored("trainer.v1.*", V1),
    ignored("model_engine", "verl's training engine (dp, megatron, torchtitan, veomni): the learner is FSDP2 whichever; "
                            "it picks the defaults a key is compared with, and the engine's sections are its tuning"),
    ignored("*._target_", TARGET),
    ignored("skip.*", "verl's dumps of rollouts (read only with skip.*.enable, refused when on)"),
    *(refused(f"skip.{k}.enable", "verl's replay of dumped rollouts in place of sampling (streamrl replay "
                                  "re-scores archived rollouts)") for k in ("rollout", "rollout_tq", "async_rollout")),
    ignored("global_profiler.*", PROFILER),
    ignored("ray_kwargs.*", RAY),
    ignored("ray_init.*", RAY),
    ignored("transfer_queue.*", "verl's transfer queue: the topics are streamrl's"),
    # -- reward: verl's current section beside the legacy ones -----------------------------------------
    mapped("reward.custom_reward_function.path", "custom_reward_function.path"),
    mapped("reward.custom_reward_function.name", "custom_reward_function.name"),
    mapped("reward.custom_reward_function.reward_kwargs.*", "custom_reward_function.reward_kwargs"),
    mapped("reward.reward_manager.name", "reward_model.reward_manager",
           note="a built-in (naive, batch, dapo, prime, gdpo, remote, rate_limited), a manager your module registers "
                "(verl's register, or streamrl.reward.managers.register), or with source importlib the class's name"),
    mapped("reward.reward_manager.source", "reward_model.reward_manager_source", note="register or importlib"),
    mapped("reward.reward_manager.module.path", "reward_model.reward_manager_module",
           note="the file or module of your manager class (importlib; register: imported first)"),
    mapped("reward.reward_manager.module.name", "reward_model.reward_manager_class",
           note="importlib: tried after reward_manager.name (the name verl 0.9.1 loads)"),
    mapped("reward.reward_kwargs.*", "reward_model.reward_kwargs"),
    mapped("reward.reward_model.enable", "reward_model.enable",
           note="a reward model scores (no custom function: discriminative, every record) or serves your function "
                "(generative, through reward_router_address)"),
    *_rm_rows("reward.reward_model."),
    *(mapped(f"{s}num_workers", "run.reward_members", read=_reward_workers,
             note="verl's reward-loop workers: the reward consumer group's members, each with its own manager")
      for s in ("reward.", "reward_model.")),
    # verl's code data sources' execution (docs/guides/sandbox.md): the code rule's arguments, both generations
    *(mapped(f"{s}sandbox_fusion.{k}", f"reward.scorers.code.kwargs.{to}", note=why)
      for s in ("", "reward.") for k, to, why in (
          ("url", "sandbox_fusion_url", "the code rule runs cases on this SandboxFusion API (streamrl sandbox, or "
                                        "SandboxFusion); null: locally, isolated (bubblewrap)"),
          ("max_concurrent", "max_concurrent", "cases running at once per reward member"),
          ("memory_limit_mb", "memory_limit_mb", "each run's memory"))),
    mapped("reward.launch_reward_fn_async", read=lambda v, g: {}, note="the reward stage always scores apart"),
    _same("custom_reward_function.path"),
    _same("custom_reward_function.name"),
    _same("custom_reward_function.reward_kwargs.*"),
    _same("reward_model.reward_manager"),
    _same("reward_model.reward_kwargs.*"),
    _same("reward_model.enable"),
    *(_overlong(k) for k in ("enable", "len", "penalty_factor", "log")),
    ignored("reward_model.launch_reward_fn_async", "the reward stage always scores apart from the learner"),
    mapped("reward_model.reward_loop_source", "reward_model.reward_manager_source",
           note="verl's legacy name of reward.reward_manager.source"),
    mapped("reward_model.reward_loop_module_path", "reward_model.reward_manager_module",
           note="verl's legacy name of reward.reward_manager.module.path"),
    mapped("reward_model.reward_loop_class_name", "reward_model.reward_manager_class",
           note="verl's legacy name of reward.reward_manager.module.name"),
    *_rm_rows("reward_model."),
    # -- on-policy distillation (docs/guides/distillation.md): the losses the same, the teacher a stage --
    _same("distillation.enabled"),
    *(_same(f"distillation.distillation_loss.{k}") for k in _DISTILLATION_LOSS),
    ignored("distillation.distillation_loss.use_chunked*", CHUNKED_TOPK),  # (in verl after 0.9.1)
    ignored("distillation.distillation_loss.chunked*", CHUNKED_TOPK),
    # verl's teachers by entry name, one per data source (key, model_path; teacher_model alone is the
    # single teacher, dropped beside others, said at start); inference.* and num_replicas are accepted
    # on each entry and named at start as not applicable (streamrl.distillation.config)
    _same("distillation.teacher_models.*"),
    refused("distillation.teacher_key", "routing by a record field other than data_source: each teacher serves the "
                                        "records of its key's data source", harmless=("data_source",)),
    ignored("distillation.n_gpus_per_node", TEACHER_SCALE),
    ignored("distillation.nnodes", TEACHER_SCALE),
)

#: the first parts of keys that are verl's alone (a key under them that no row matches is unknown)
VERL_TOPS = ("algorithm", "actor_rollout_ref", "data", "trainer", "critic", "reward_model", "custom_reward_function",
             "global_profiler", "ray_kwargs", "ray_init", "transfer_queue", "sandbox_fusion", "skip",
             "model_engine")
