"""The audit of verl's table (issue 66): a key that changes what is trained is mapped or refused,
never "not applicable". This file holds every key (or pattern) the table may accept as not
applicable, by why; a row added as ``ignored`` fails here until it is listed under one of these
reasons (or mapped, or refused). A key listed as read only with another key names that key,
whose row must map or refuse it: the settings of a feature that is off change nothing."""

from __future__ import annotations

from streamrl.verl import IGNORED, MAPPED, REFUSED, VERL_TABLE, find_row
from streamrl.verl.table_actor import MEGATRON_SAME_NUMBERS

A, C, R = "actor_rollout_ref.actor.", "critic.", "actor_rollout_ref.rollout."
M, CM = "actor_rollout_ref.model.", "critic.model."

#: why a key changes nothing that is trained -> the keys (rows' keys, patterns as written)
NOT_APPLICABLE: dict[str, list[str]] = {
    # the same log-probs and gradients, computed another way (kernels, memory, padding, compile)
    "same numbers: kernels, memory savings, compilation, padding": [
        f"{A}use_prefix_grouper", f"{A}use_fused_kernels", f"{M}use_fused_kernels", f"{M}fused_kernel_options.*",
        f"{CM}use_fused_kernels", f"{CM}fused_kernel_options.*", f"{A}pad_to_length",
        f"{A}entropy_from_logits_chunk_size", f"{A}entropy_checkpointing", f"{A}entropy_from_logits_with_chunking",
        f"{M}enable_activation_offload", f"{M}tiled_mlp.*", f"{CM}enable_activation_offload", f"{CM}tiled_mlp.*",
        f"{A}use_torch_compile", f"{M}use_liger", f"{CM}use_liger", f"{CM}use_remove_padding",
        f"{CM}enable_gradient_checkpointing", "distillation.distillation_loss.use_chunked*",
        "distillation.distillation_loss.chunked*", "trainer.balance_batch",
    ],
    # Megatron's TransformerConfig fields that recompute activations, fuse kernels, pick the
    # attention kernel, dispatch MoE tokens or lay out the pipeline (any other field is refused)
    "same numbers: Megatron's recomputation, kernels and layout": [
        f"{section}megatron.override_transformer_config.{k}" for section in (A, C, "actor_rollout_ref.ref.")
        for k in MEGATRON_SAME_NUMBERS
    ],
    # how verl's engines shard and place the work: the learner's FSDP2 and streamrl's stages
    "parallelism and placement: the same update, sharded otherwise": [
        f"{A}optim.use_layer_wise_distributed_optimizer", f"{A}megatron.*", f"{C}optim.use_layer_wise_distributed_optimizer",
        f"{C}megatron.*", f"{A}fsdp_config.*", f"{CM}fsdp_config.*", f"{C}fsdp.*", f"{A}torchtitan.*",
        f"{C}torchtitan.*", f"{A}veomni.*", f"{C}veomni.*", f"{A}strategy", f"{C}strategy",
        f"{A}ulysses_sequence_parallel_size", f"{C}ulysses_sequence_parallel_size", "actor_rollout_ref.hybrid_engine",
        "actor_rollout_ref.nccl_timeout", f"{C}nccl_timeout", "model_engine", "trainer.device",
        f"{R}n_gpus_per_node", f"{R}nnodes", f"{R}router_config_path", "distillation.n_gpus_per_node",
        "distillation.nnodes", "actor_rollout_ref.ref.*", f"{R}agent.num_workers", f"{C}forward_micro_batch_size",
        f"{C}forward_micro_batch_size_per_gpu", f"{C}forward_max_token_len_per_gpu",
    ],
    # the inference engine's memory and scheduling: the same samples, sooner or later
    "the inference engine's memory and scheduling": [
        f"{R}{k}" for k in ("enable_chunked_prefill", "max_num_batched_tokens", "max_num_seqs", "enforce_eager",
                            "free_cache_engine", "load_format", "layered_summon", "multi_stage_wake_up",
                            "data_parallel_size", "expert_parallel_size", "pipeline_model_parallel_size",
                            "max_model_len", "update_weights_bucket_megabytes",
                            "enable_prefix_caching", "cudagraph_capture_sizes", "disable_log_stats",
                            "skip_tokenizer_init", "disaggregation.*", "scheduling_policy", "moe_tensor_parallel_size",
                            "moe_load_balance_metrics_interval", "checkpoint_engine.*", "mode",
                            "calculate_log_probs", "log_prob_*")
    ],
    # other draws from the same distribution, or the same data in another order
    "seeds, determinism and order": [
        f"{R}seed", f"{R}full_determinism", f"{A}data_loader_seed", f"{C}data_loader_seed", f"{A}shuffle",
        f"{C}shuffle", "data.validation_shuffle",
    ],
    # verl fills it in from another key, which is mapped
    "filled in by verl from a mapped key": [
        f"{A}rollout_n", f"{C}rollout_n", f"{A}use_remove_padding", f"{R}prompt_length", f"{R}response_length",
        f"{R}mtp", f"{R}qat", f"{A}optim.total_training_steps", f"{C}optim.total_training_steps",
        f"{M}torch_dtype", "data.tokenizer", f"{CM}tokenizer_path", f"{C}enable", "data.reward_fn_key",
        "data.return_raw_chat", f"{R}multi_turn.num_repeat_rollouts",
    ],
    # verl's processes, files and services: streamrl's stages, topics and run directory
    "verl's own machinery: processes, files, Ray, loading": [
        f"{M}use_shm", f"{CM}use_shm", f"{M}trust_remote_code", f"{CM}trust_remote_code", f"{M}external_lib",
        f"{CM}external_lib", "data.return_full_prompt", "data.return_raw_input_ids",
        "data.filter_overlong_prompts_workers", "data.val_batch_size", "data.dataloader_num_workers",
        "data.trust_remote_code", "data.use_shm", "trainer.use_legacy_worker_impl",
        "trainer.ray_wait_register_center_timeout", "ray_kwargs.*", "ray_init.*", "trainer.rollout_data_dir",
        "trainer.validation_data_dir", "trainer.del_local_ckpt_after_load", "trainer.esi_redundant_time",
        "trainer.val_only", "trainer.default_hdfs_dir", "trainer.max_critic_ckpt_to_keep", "trainer.use_v1",
        "trainer.v1.*", "trainer.v1.trainer_mode", "*._target_", "transfer_queue.*", f"{R}agent._target_",
        f"{R}agent.custom_async_server._target_", "reward_model.model.trust_remote_code",
        "reward_model.launch_reward_fn_async", f"{A}checkpoint.*", f"{C}checkpoint.*",
        f"{A}optim.use_checkpoint_opt_param_scheduler", f"{C}optim.use_checkpoint_opt_param_scheduler",
        f"{R}multi_turn.tokenization_sanity_check_mode", "trainer.log_val_generations",
    ],
    # figures only
    "figures, logs and profilers": [
        f"{A}calculate_entropy", f"{A}calculate_sum_pi_squared", f"{A}profiler.*", f"{R}profiler.*", f"{C}profiler.*",
        "trainer.profile_steps", "global_profiler.*", f"{R}prometheus.*", f"{R}trace.*",
    ],
    # a stream has no step-synchronous batch: what verl does to fill or trim one has no counterpart
    "the step-synchronous batch a stream does not have": [
        "algorithm.filter_groups.max_inflight_gen_batches", "data.gen_batch_size", f"{R}over_sample_rate",
        "trainer.v1.sampler.sync_refill_failed_groups",
    ],
    # the reward model's servers (verl's reward.reward_model.rollout.*): the same scores, served otherwise
    "the reward model's servers' memory and scheduling": [
        f"{rm}rollout.{k}" for rm in ("reward.reward_model.", "reward_model.")
        for k in ("free_cache_engine", "limit_images", "cudagraph_capture_sizes", "expert_parallel_size",
                  "disable_log_stats", "skip_tokenizer_init", "disaggregation.*")
    ] + [f"reward.reward_model.rollout.{k}" for k in ("multi_stage_wake_up", "pipeline_model_parallel_size", "layered_summon",
                                                      "scheduling_policy", "mtp", "full_determinism")],
    # verl never sends them: a discriminative model is not sampled, a generative one's requests are the user's function's
    "the reward model's sampling settings, which verl does not send": [
        f"reward.reward_model.rollout.{k}" for k in ("temperature", "top_k", "top_p", "do_sample", "n", "ignore_eos")
    ],
    # verl gives Megatron the same start and end weight decay
    # verl's reference and critic passes replay no routing: the flag that turns replay on is the actor's
    "router replay outside the actor's passes, which verl does not do": [
        f"{section}{engine}.router_replay.*" for section in ("actor_rollout_ref.ref.", "critic.")
        for engine in ("megatron", "veomni")],
    "a schedule verl keeps constant": [f"{A}optim.weight_decay_incr_style", f"{C}optim.weight_decay_incr_style"],
}

#: settings of a feature, read only with the key named (whose row maps or refuses it)
READ_WITH: dict[str, str] = {
    "algorithm.pf_ppo.*": "algorithm.use_pf_ppo",
    f"{A}optim.muon_*": f"{A}optim.optimizer", f"{C}optim.muon_*": f"{C}optim.optimizer",
    f"{A}qat.*": f"{A}qat.enable", f"{A}fsdp_config.qat.*": f"{A}fsdp_config.qat.enable",
    f"{A}megatron.qat.*": f"{A}megatron.qat.enable", "actor_rollout_ref.ref.*.qat.*": "actor_rollout_ref.ref.*.qat.enable",
    f"{R}qat.*": f"{A}qat.enable", f"{C}fsdp.qat.*": f"{C}fsdp.qat.enable", f"{C}megatron.qat.*": f"{C}megatron.qat.enable",
    f"{M}mtp.*": f"{M}mtp.enable", f"{R}mtp.*": f"{M}mtp.enable", f"{CM}mtp.*": f"{CM}mtp.enable",
    "data.image_patch_size": "data.image_key", "data.mm_processor_kwargs": "data.image_key",
    "data.return_multi_modal_inputs": "data.image_key", "data.custom_cls.*": "data.custom_cls.path",
    "skip.*": "skip.rollout.enable", f"{R}engine_kwargs.trtllm*": f"{R}name",
}


def test_every_not_applicable_key_is_listed_with_its_reason():
    listed = [k for keys in NOT_APPLICABLE.values() for k in keys] + list(READ_WITH)
    assert len(listed) == len(set(listed)), sorted(k for k in listed if listed.count(k) > 1)
    ignored = {r.key for r in VERL_TABLE if r.kind == IGNORED}
    assert sorted(ignored - set(listed)) == [], "ignored rows not in the audit's list: list them with a reason"
    assert sorted(set(listed) - ignored) == [], "listed keys that are no longer ignored rows"


def test_a_feature_whose_settings_are_not_applicable_is_itself_mapped_or_refused():
    for settings, switch in READ_WITH.items():
        row = find_row(switch)
        assert row is not None and row.kind in (MAPPED, REFUSED), (settings, switch, row)


def test_the_keys_the_audit_found_are_mapped_or_refused():
    """What the audit moved out of "not applicable" (issue 66): QAT in every engine section, a
    Dataset class of one's own, the critic's own mini-batches, the rollout engine's dtype, the
    model's config overrides, the critic warm-up."""
    from streamrl.verl import read_verl_keys

    refused = {"actor_rollout_ref.actor.fsdp_config.qat.enable": True, "critic.fsdp.qat.enable": True,
               "actor_rollout_ref.actor.megatron.qat.enable": True, "actor_rollout_ref.ref.fsdp_config.qat.enable": True,
               "data.custom_cls.path": "my_dataset.py", "critic.ppo_mini_batch_size": 64,
               "actor_rollout_ref.rollout.name": "trtllm"}
    for key, value in refused.items():
        [o] = read_verl_keys([(key, value)])
        assert o.kind == REFUSED, (key, o.line())
    [o] = read_verl_keys([("critic.ppo_mini_batch_size", 64), ("actor_rollout_ref.actor.ppo_mini_batch_size", 64)])[:1]
    assert o.kind == MAPPED  # the actor's size: the same mini-batches
    mapped = {"actor_rollout_ref.rollout.dtype": ("bf16", {"rollout.dtype": "bfloat16"}),
              "actor_rollout_ref.rollout.quantization": ("fp8", {"rollout.quantization": "fp8"}),
              "trainer.critic_warmup": (2, {"learner.critic_warmup": 2}),
              "actor_rollout_ref.rollout.enable_rollout_routing_replay": (True, {"rollout.return_routed_experts": True}),
              "critic.model.override_config": ({"attention_dropout": 0.1},
                                               {"learner.critic.override_config": {"attention_dropout": 0.1}})}
    for key, (value, sets) in mapped.items():
        [o] = read_verl_keys([(key, value)])
        assert o.kind == MAPPED and o.sets == sets, (key, o.line())


def test_engine_arguments_reach_the_engine_and_transformer_config_changes_are_refused():
    """The audit's second pass (issue 66): verl's rollout.engine_kwargs.<engine> (a KV-cache dtype
    or a quantisation there changes the samples) reach the engine rollout.name names, whole or by
    key, the reward model's by key too; Megatron's override_transformer_config is not applicable
    only for its recomputation, kernel and layout fields, refused for any other (by field or
    whole), for the actor, the critic and the reference."""
    from streamrl.verl import read_verl_keys

    def sets(*pairs):
        return {k: v for o in read_verl_keys(list(pairs)) for k, v in o.sets.items()}

    vllm, sglang = (f"{R}name", "vllm"), (f"{R}name", "sglang")
    assert sets(vllm, (f"{R}engine_kwargs.vllm.kv_cache_dtype", "fp8")) == {
        "rollout.backend": "vllm", "rollout.vllm.engine_kwargs.kv_cache_dtype": "fp8"}
    assert sets(sglang, (f"{R}engine_kwargs.sglang", {"kv_cache_dtype": "fp8_e5m2"}))[
        "rollout.servers_launch.engine_kwargs"] == {"kv_cache_dtype": "fp8_e5m2"}
    assert sets(vllm, (f"{R}engine_kwargs.sglang.kv_cache_dtype", "fp8")) == {"rollout.backend": "vllm"}  # not read
    assert sets(("reward.reward_model.rollout.engine_kwargs.vllm.swap_space", 4)) == {
        "reward_model.rollout.engine_kwargs.vllm.swap_space": 4}
    for section in (A, C, "actor_rollout_ref.ref."):
        key = f"{section}megatron.override_transformer_config"
        for field, value in (("attention_dropout", 0.1), ("moe_aux_loss_coeff", 0.01), ("moe_router_dtype", "fp32"),
                             ("moe_expert_capacity_factor", 1.0)):
            [o] = read_verl_keys([(f"{key}.{field}", value)])
            assert o.kind == REFUSED, o.line()
            [o] = read_verl_keys([(key, {"recompute_granularity": "full", field: value})])
            assert o.kind == REFUSED and field in o.line() and "recompute" not in o.line().split(": ")[-1], o.line()
        [o] = read_verl_keys([(f"{key}.recompute_granularity", "full")])
        assert o.kind == IGNORED
        [o] = read_verl_keys([(key, {"recompute_granularity": "full", "attention_backend": "flash"})])
        assert o.kind == IGNORED, o.line()
