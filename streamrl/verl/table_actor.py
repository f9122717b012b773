"""The rows of ``actor_rollout_ref`` (the actor, its optimizer, the model, the reference, the
rollout), and the builders the critic's section shares with it (``optim_rows``, ``model_rows``,
``engine_rows``): verl gives the actor and the critic the same optimizer, model and engine
sections, and here each is read the same way for both."""

from __future__ import annotations

from typing import Any

from streamrl.verl.rows import (_ACTOR, _MODEL, _ROLLOUT, _VAL, ENGINE, FSDP_TUNING, LOGPROB_PASS, MEGATRON, MEMORY,
                                MULTIMODAL, PROFILER, REF_PASS, SEQ_PARALLEL, STREAMING, Given, NotApplicable, Refused, Row,
                                _bool, _clip_ratio, _dtype, _dynamic_bsz, _int, _kl_loss_coef, _lora_modules,
                                _mini_batch, _model_path, _multi_turn_enable, _rollout_name, _temperature,
                                _token_budget, _use_kl_loss, _val_do_sample, engine_given, ignored, mapped, refused)

TARGET = "the class verl builds the section with (_target_)"
ENGINES_TUNING = ("the {} engine's parallelism, kernels and memory settings: the learner shards with FSDP2 "
                  "(learner.parallel)")
MUON = "Muon's settings, read only with optimizer=Muon (which the learner's torch.optim choice refuses)"
OPT_PRECISION = "optimizer states and gradients kept below fp32 (Megatron's precision-aware optimizer)"
MTP = "multi-token prediction (MTP) heads, trained and used for speculative decoding"
MTP_SETTINGS = "MTP's settings, read only with mtp.enable (refused when on)"
QAT_SETTINGS = "quantisation-aware training's settings, read only with qat.enable (refused when on)"
MEGATRON_LORA = ("Megatron-Bridge's LoRA layout (its module names, init, freezing, merge): the learner's LoRA is PEFT's "
                 "(actor_rollout_ref.model.lora_rank / lora_alpha / target_modules)")
WEIGHTS = ("how verl moves each version's weights from the trainer into the inference engine: here the learner "
           "publishes each version (learner.weights_dir / weights_uri) and the rollout workers load it; the same weights")


#: the lowercase names of verl's Megatron, torchtitan and VeOmni engines: Megatron's ``adam`` is Adam
#: with decoupled weight decay (AdamW); a torch.optim class name (verl FSDP's ``Adam``, ``AdamW``) is itself
_ENGINE_OPTIMIZERS = {"adam": "AdamW", "adamw": "AdamW", "sgd": "SGD"}


def _torch_optimizer(value: Any) -> str:
    return _ENGINE_OPTIMIZERS.get(str(value), str(value))


def optim_rows(verl: str, to: str) -> list[Row]:
    """``verl`` (``actor_rollout_ref.actor.optim.`` or ``critic.optim.``) onto ``to``
    (``learner.`` or ``learner.critic.``): the optimizer, its schedule, and Megatron's and
    VeOmni's names for the same things."""
    def same(key: str, target: str = "", note: str = "") -> Row:
        return mapped(verl + key, to + (target or key), note=note)

    def optimizer(value: Any, given: Given) -> dict[str, Any]:
        return {f"{to}optimizer": _torch_optimizer(value)}

    def extra(value: Any, given: Given) -> dict[str, Any]:
        if engine_given(given) == "megatron":
            raise NotApplicable("Megatron's OptimizerConfig fields (CPU offload of its states, overlap, precision): "
                                "the learner's offload is learner.parallel.cpu_offload")
        return {f"{to}override_optimizer_config": {} if value is None else value}

    def null_zero(target: str) -> Any:
        return lambda v, g: {to + target: 0 if v is None else _int(v)}

    return [
        same("lr"), same("weight_decay"), same("betas"), same("clip_grad", "grad_clip", "the max gradient norm"),
        mapped(f"{verl}optimizer", f"{to}optimizer", read=optimizer,
               note="a torch.optim class; Megatron's adam is AdamW (decoupled weight decay)"),
        mapped(f"{verl}name", f"{to}optimizer", read=optimizer, note="VeOmni's name for optimizer"),
        same("optimizer_impl", note="torch.optim only"),
        mapped(f"{verl}override_optimizer_config", f"{to}override_optimizer_config", read=extra,
               note="the torch optimizer's extra arguments (null: none); with the Megatron engine, Megatron's "
                    "OptimizerConfig fields (its offload and precision), not applicable"),
        mapped(f"{verl}override_optimizer_config.*", f"{to}override_optimizer_config", read=extra,
               note="one extra argument (Hydra's +key), as override_optimizer_config"),
        *(same(k, note="the lr schedule, counted in versions")
          for k in ("lr_warmup_steps", "lr_warmup_steps_ratio", "lr_scheduler_type", "num_cycles", "zero_indexed_step")),
        same("warmup_style", "lr_scheduler_type", note="lr_scheduler_type's older name"),
        mapped(f"{verl}min_lr_ratio", f"{to}min_lr_ratio", read=lambda v, g: {f"{to}min_lr_ratio": 0.0 if v is None else v},
               note="null: 0"),
        *(same(k, note="Megatron's schedule (OptimizerParamScheduler)")
          for k in ("lr_decay_style", "min_lr", "lr_warmup_init", "lr_wsd_decay_style")),
        mapped(f"{verl}lr_decay_steps", f"{to}lr_decay_steps", read=null_zero("lr_decay_steps"),
               note="Megatron's decay length; null: the run's versions"),
        mapped(f"{verl}lr_wsd_decay_steps", f"{to}lr_wsd_decay_steps", read=null_zero("lr_wsd_decay_steps"),
               note="WSD's anneal length; null: 0"),
        ignored(f"{verl}weight_decay_incr_style", "verl gives Megatron the same start and end weight decay: no style "
                                                  "changes it"),
        ignored(f"{verl}use_checkpoint_opt_param_scheduler", "the schedule is a function of the version, resumed as it is"),
        ignored(f"{verl}total_training_steps", "filled in by verl's trainer"),
        refused(f"{verl}eps", "Adam's epsilon other than 1e-8 (the torch.optim default the learner uses)", harmless=(1e-8,)),
        *(refused(verl + k, OPT_PRECISION) for k in ("exp_avg_dtype", "exp_avg_sq_dtype", "main_grads_dtype",
                                                     "use_precision_aware_optimizer")),
        ignored(f"{verl}use_layer_wise_distributed_optimizer", MEGATRON),
        ignored(f"{verl}muon_*", MUON),
        *(refused(verl + k, "VeOmni's lr schedule (lr_start, lr_min, decay_type, lr_decay_ratio, min_lr_factor): the "
                            "schedule is lr_scheduler_type's or lr_decay_style's")
          for k in ("lr_start", "lr_min", "decay_type", "lr_decay_ratio", "min_lr_factor")),
    ]


def override_rows(verl: str, *to: str) -> list[Row]:
    """A ``model`` section's ``override_config`` (verl's changes to the model's config at load)
    onto ``to``: the whole mapping, or one of its keys (Hydra's ``+...override_config.key=v``)."""
    note = ("the model's config changed at load as verl's update_model_config does (a mapping updates the "
            "sub-config of its name; model_config: the Megatron form; attn_implementation: the kernel, not applied)")
    return [mapped(f"{verl}override_config", *to, note=note),
            mapped(f"{verl}override_config.*", *to, note="one key of override_config")]


def model_rows(verl: str) -> list[Row]:
    """What the actor's and the critic's ``model`` sections share (the keys streamrl reads
    differently for each, such as ``path`` and LoRA, are their own sections' rows)."""
    return [
        ignored(f"{verl}enable_activation_offload", MEMORY),
        ignored(f"{verl}use_fused_kernels", "fused kernels: the same log-probs"),
        ignored(f"{verl}fused_kernel_options.*", "fused kernels: the same log-probs"),
        ignored(f"{verl}use_shm", "verl's copy of the model into shared memory"),
        ignored(f"{verl}trust_remote_code", "models load with transformers' own classes"),
        ignored(f"{verl}external_lib", "verl's import of a model's library"),
        ignored(f"{verl}use_liger", "Liger kernels: the same log-probs"),
        ignored(f"{verl}tiled_mlp.*", MEMORY),
        refused(f"{verl}custom_chat_template", "a chat template other than the tokenizer's"),
        refused(f"{verl}hf_config_path", "a model config apart from the model's own files"),
        refused(f"{verl}mtp.enable", MTP),
        refused(f"{verl}mtp.enable_train", MTP),
        ignored(f"{verl}mtp.*", MTP_SETTINGS),
        refused(f"{verl}lora.*", MEGATRON_LORA),
        refused(f"{verl}exclude_modules", "modules left out of LoRA"),
        refused(f"{verl}lora_adapter_path", "starting from a trained LoRA adapter", harmless=("",)),
    ]


def _offload_of(section: str, keys: tuple[str, ...], to: str) -> list[Row]:
    def read(value: Any, given: Given) -> dict[str, Any]:
        return {to: any(_bool(given.get(section + k, False)) for k in keys)}
    return [mapped(section + k, to, read=read, note="any offload on: FSDP2's CPU offload (parameters, gradients, "
                                                    "optimizer states)") for k in keys]


def qat_rows(section: str) -> list[Row]:
    """An engine section's quantisation-aware training (``<section>.qat.*``): it changes what is
    trained (the forward pass quantised), so ``enable`` on is refused naming the key; the rest are
    its settings, read only then."""
    return [mapped(f"{section}qat.enable", read=_qat, note="off changes nothing; on is refused (QAT)"),
            ignored(f"{section}qat.*", QAT_SETTINGS)]


#: Megatron's TransformerConfig fields that change how, not what, it computes (activation
#: recomputation, fused kernels, the attention kernel, MoE dispatch, pipeline layout, offload):
#: the same log-probs and gradients. Any other field (dropout, MoE routing, capacity and aux
#: losses, normalisation, precision of the router) changes what is trained: refused.
MEGATRON_SAME_NUMBERS = (
    "recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules", "attention_backend",
    "apply_rope_fusion", "gradient_accumulation_fusion", "bias_activation_fusion", "bias_dropout_fusion",
    "masked_softmax_fusion", "persist_layer_norm", "cross_entropy_loss_fusion", "moe_permute_fusion",
    "moe_grouped_gemm", "moe_token_dispatcher_type", "moe_shared_expert_overlap", "moe_enable_deepep",
    "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
    "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage", "cpu_offloading",
    "cpu_offloading_num_layers", "cpu_offloading_activations", "cpu_offloading_weights",
    "deallocate_pipeline_outputs", "batch_p2p_comm", "overlap_p2p_comm")
TRANSFORMER_CONFIG = ("Megatron's TransformerConfig changed at build (dropout, MoE routing, capacity and aux losses, "
                      "normalisation...): the learner builds the model from its Hugging Face config "
                      "(actor_rollout_ref.model.override_config changes that)")


def _transformer_config(value: Any, given: Given) -> dict[str, Any]:
    """A whole ``override_transformer_config`` mapping: memory and kernel fields only change
    nothing; any other field is refused naming it."""
    if value is None or not value:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"a mapping of TransformerConfig fields (got {value!r})")
    other = sorted(k for k, v in value.items() if k not in MEGATRON_SAME_NUMBERS and v is not None)
    if other:
        raise Refused(f"{TRANSFORMER_CONFIG}: {', '.join(other)}")
    raise NotApplicable("Megatron's activation recomputation, kernels and layout: the same log-probs and gradients")


def transformer_config_rows(megatron: str) -> list[Row]:
    """``<megatron>override_transformer_config`` (whole or by field): see ``MEGATRON_SAME_NUMBERS``."""
    key = f"{megatron}override_transformer_config"
    return [mapped(key, read=_transformer_config, note="memory and kernel fields only; any other refused"),
            *(ignored(f"{key}.{k}", "Megatron's activation recomputation, kernels and layout: the same log-probs "
                                    "and gradients") for k in MEGATRON_SAME_NUMBERS),
            refused(f"{key}.*", TRANSFORMER_CONFIG, harmless=(None,))]


def engine_rows(verl: str, to: str, fsdp: str) -> list[Row]:
    """The engines' own sections (``fsdp`` is the dp engine's: ``fsdp_config`` for the actor,
    ``fsdp`` for the critic): their offloads onto ``to``, their quantisation-aware training
    (refused when on), the rest their tuning."""
    return [
        *(row for engine in (fsdp, "megatron") for row in qat_rows(f"{verl}{engine}.")),  # (the engines with QAT)
        *_offload_of(f"{verl}{fsdp}.", ("param_offload", "optimizer_offload"), to),
        ignored(f"{verl}{fsdp}.*", FSDP_TUNING),
        *_offload_of(f"{verl}torchtitan.", ("param_offload", "optimizer_offload"), to),
        ignored(f"{verl}torchtitan.*", ENGINES_TUNING.format("torchtitan")),
        *_offload_of(f"{verl}veomni.", ("param_offload", "optimizer_offload", "enable_fsdp_offload"), to),
        ignored(f"{verl}veomni.*", ENGINES_TUNING.format("VeOmni")),
        *_offload_of(f"{verl}megatron.", ("param_offload", "optimizer_offload"), to),
        *transformer_config_rows(f"{verl}megatron."),
        ignored(f"{verl}megatron.*", MEGATRON),
        ignored(f"{verl}strategy", "verl's FSDP, Megatron, torchtitan or VeOmni: the learner is FSDP2"),
        ignored(f"{verl}ulysses_sequence_parallel_size", SEQ_PARALLEL),
        ignored(f"{verl}profiler.*", PROFILER),
        ignored(f"{verl}checkpoint.*", "what a verl checkpoint holds: a streamrl checkpoint always holds the weights, "
                                       "the optimizer and the consumer offsets"),
        ignored(f"{verl}data_loader_seed", "the seed of verl's shuffle of a mini-batch's samples: the same gradients"),
        ignored(f"{verl}shuffle", "verl's shuffle of a mini-batch's samples: the same gradients"),
    ]


def global_micro(verl: str, to: str) -> Any:
    """verl's deprecated ``ppo_micro_batch_size``: the whole world's, divided by its GPUs
    (``trainer.n_gpus_per_node`` x ``nnodes``, verl's defaults 8 and 1), unless the per-GPU form is given."""
    def read(value: Any, given: Given) -> dict[str, Any]:
        if value is None or f"{verl}ppo_micro_batch_size_per_gpu" in given:
            return {}
        gpus = _int(given.get("trainer.n_gpus_per_node", 8)) * _int(given.get("trainer.nnodes", 1))
        return {f"{to}micro_batch_size": max(1, _int(value) // max(1, gpus))}
    return read


_LEARNER_SAME = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode", "loss_scale_factor",
                 "entropy_coeff", "ppo_epochs", "tau_pos", "tau_neg", "kl_loss_type", "grad_clip")


def _loss_scale_factor(value: Any, given: Given) -> dict[str, Any]:
    return {"learner.loss_scale_factor": 0 if value is None else _int(value)}


def _rollout_dtype(value: Any, given: Given) -> dict[str, Any]:
    return {"rollout.dtype": _dtype(value, given)["learner.dtype"]}


def _router_replay(engine: str) -> Any:
    """``actor.<engine>.router_replay.mode`` onto ``learner.router_replay``: verl reads the section of
    the actor's engine (Megatron's or VeOmni's; its FSDP engine replays nothing), refuses R2 with
    the rollout's routing recorded, and R3 needs it."""
    def read(value: Any, given: Given) -> dict[str, Any]:
        if engine_given(given) != engine:
            return {}
        mode = str(value)
        if mode not in ("disabled", "R2", "R3"):
            raise Refused(f"router_replay.mode {mode!r}: verl's modes are disabled, R2, R3")
        rollout = _bool(given.get(f"{_ROLLOUT}enable_rollout_routing_replay", False))
        if mode == "R2" and rollout:
            raise Refused("router_replay.mode R2 with rollout.enable_rollout_routing_replay (verl refuses the two "
                          "together: R2 replays the learner's own routing, R3 the rollout's)")
        if mode == "R3" and not rollout:
            raise Refused("router_replay.mode R3 without rollout.enable_rollout_routing_replay=True (R3 replays the "
                          "routing the rollout records)")
        return {"learner.router_replay": mode}
    return read


ROUTER_REPLAY = ("MoE router replay: verl's reference and critic passes replay no routing (its flag is the actor's); "
                 "the learner's is learner.router_replay")


_ENGINE_KWARGS = {"vllm": ("rollout.vllm.engine_kwargs",), "sglang": ("rollout.servers_launch.engine_kwargs",)}


def _engine_kwargs(engine: str) -> Any:
    """verl's ``rollout.engine_kwargs.<engine>`` (whole, or one key: the row's tail), passed to
    the engine as verl passes it: only the one ``rollout.name`` names (the others are not read).
    A key that changes sampling (a KV-cache dtype, a quantisation) reaches the engine as in verl."""
    def read(value: Any, given: Given) -> dict[str, Any]:
        if given.get(f"{_ROLLOUT}name") != engine:
            return {}
        if value is None:
            value = {}
        return {_ENGINE_KWARGS[engine][0]: value}
    return read


def _quantization(value: Any, given: Given) -> dict[str, Any]:
    if value is None:
        return {"rollout.quantization": ""}
    if given.get(f"{_ROLLOUT}name") == "hf":
        raise Refused(f"quantised rollouts ({value}) with rollout.name=hf: transformers samples from the weights as "
                      "published (vLLM and SGLang quantise as they load)")
    if not isinstance(value, str) or not value:
        raise ValueError(f"a quantization method such as fp8 (got {value!r})")
    return {"rollout.quantization": value}


def _quantization_file(value: Any, given: Given) -> dict[str, Any]:
    if value is None:
        return {"rollout.quantization_config_file": ""}
    if given.get(f"{_ROLLOUT}quantization") is None:
        return {}  # verl reads it only with a quantization
    return {"rollout.quantization_config_file": str(value)}


def _qat(value: Any, given: Given) -> dict[str, Any]:
    if _bool(value):
        raise Refused("quantisation-aware training (QAT): the learner trains in learner.dtype")
    return {}


ACTOR_ROWS: tuple[Row, ...] = (
    # -- the actor's objective --------------------------------------------------------------------
    *(mapped(f"{_ACTOR}policy_loss.{k}", f"learner.policy_loss.{k}")
      for k in ("loss_mode", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")),
    *(mapped(f"{_ACTOR}policy_loss.{k}", f"learner.{k}", note=f"not in verl's schema: verl reads actor.{k} (SAPO's "
                                                               "script gives it here with Hydra's +)")
      for k in ("tau_pos", "tau_neg")),
    refused(f"{_ACTOR}policy_loss.dro_beta", "verl's DRO loss's beta (the learner's losses have no DRO)"),
    mapped(f"{_ACTOR}gvpo_beta", "learner.policy_loss.gvpo_beta",
           note="not in verl's schema: verl-recipe's GVPO config file adds it to the actor's (loss_mode gvpo)"),
    *(mapped(_ACTOR + k, f"learner.{k}") for k in _LEARNER_SAME if k != "loss_scale_factor"),
    mapped(f"{_ACTOR}loss_scale_factor", "learner.loss_scale_factor", read=_loss_scale_factor, note="null: 0 (off)"),
    mapped(f"{_ACTOR}clip_ratio", "learner.clip_ratio_low", "learner.clip_ratio_high", read=_clip_ratio,
           note="the low and high clips not given"),
    mapped(f"{_ACTOR}use_kl_loss", "learner.kl_coef", read=_use_kl_loss,
           note="on: learner.kl_coef = kl_loss_coef (verl's 0.001 by default); off: 0"),
    mapped(f"{_ACTOR}kl_loss_coef", "learner.kl_coef", read=_kl_loss_coef, note="read with use_kl_loss"),
    *optim_rows(f"{_ACTOR}optim.", "learner."),
    ignored(f"{_ACTOR}calculate_entropy", "the entropy figure: the learner reports its own"),
    ignored(f"{_ACTOR}calculate_sum_pi_squared", "a figure for verl's optimal-token-baseline estimators, which "
                                                 "algorithm.adv_estimator refuses"),
    ignored(f"{_ACTOR}rollout_n", "filled in by verl from rollout.n"),
    refused(f"{_ACTOR}freeze_vision_tower", MULTIMODAL),
    mapped(f"{_ACTOR}qat.enable", read=_qat, note="off changes nothing; on is refused (QAT)"),
    ignored(f"{_ACTOR}qat.*", QAT_SETTINGS),
    ignored(f"{_ACTOR}use_prefix_grouper", "a forward pass sharing the group's prompt: the same log-probs"),
    ignored(f"{_ACTOR}use_fused_kernels", "fused kernels: the same log-probs"),
    ignored(f"{_ACTOR}use_remove_padding", "follows actor_rollout_ref.model.use_remove_padding (verl fills it in)"),
    ignored(f"{_ACTOR}pad_to_length", MEMORY),
    ignored(f"{_ACTOR}entropy_from_logits_chunk_size", MEMORY),
    # -- batch shape ---------------------------------------------------------------------------------
    mapped(f"{_ACTOR}ppo_mini_batch_size", "learner.groups_per_mini_batch", read=_mini_batch,
           note="prompts (groups of rollout.n) per optimizer step"),
    mapped(f"{_ACTOR}ppo_micro_batch_size_per_gpu", "learner.micro_batch_size",
           note="sequences per forward pass on each rank"),
    mapped(f"{_ACTOR}ppo_micro_batch_size", "learner.micro_batch_size", read=global_micro(f"{_ACTOR}", "learner."),
           note="verl's deprecated global form, divided by the GPUs (n_gpus_per_node x nnodes) as verl does"),
    mapped(f"{_ACTOR}use_dynamic_bsz", "learner.max_tokens_per_micro_batch", read=_dynamic_bsz,
           note="on: the token budget ppo_max_token_len_per_gpu (verl's 16384 by default); off: 0"),
    mapped(f"{_ACTOR}ppo_max_token_len_per_gpu", "learner.max_tokens_per_micro_batch", read=_token_budget,
           note="read with use_dynamic_bsz"),
    mapped("actor_rollout_ref.rollout.n", "feed.group_size", note="samples per prompt (the group)"),
    # -- the learner's machinery -----------------------------------------------------------------------
    mapped(f"{_ACTOR}fsdp_config.model_dtype", "learner.dtype", read=_dtype),
    *engine_rows(_ACTOR, "learner.parallel.cpu_offload", "fsdp_config"),
    ignored(f"{_ACTOR}entropy_checkpointing", MEMORY),
    ignored(f"{_ACTOR}entropy_from_logits_with_chunking", MEMORY),
    ignored(f"{_ACTOR}use_torch_compile", "torch.compile: the same gradients"),
    ignored("actor_rollout_ref.ref.*", REF_PASS),
    *transformer_config_rows("actor_rollout_ref.ref.megatron."),  # the reference's model: other KL values
    *qat_rows("actor_rollout_ref.ref.*."),  # the reference's forward quantised: other KL values
    ignored("actor_rollout_ref.hybrid_engine", "verl's colocation of actor and rollout"),
    ignored("actor_rollout_ref.nccl_timeout", "learner.parallel.timeout_s is streamrl's"),
    # -- the model ------------------------------------------------------------------------------------
    mapped(f"{_MODEL}path", "learner.policy", "rollout.policy", read=_model_path,
           note="the policy both trains and samples from"),
    mapped(f"{_MODEL}use_remove_padding", "learner.use_remove_padding",
           note="true packs every mini-batch (refused where the model cannot pack); streamrl's default, auto, "
                "packs a mini-batch whose padding would be >= 20% of it"),
    mapped(f"{_MODEL}enable_gradient_checkpointing", "learner.gradient_checkpointing"),
    mapped(f"{_MODEL}lora_rank", "learner.lora.rank"),
    mapped(f"{_MODEL}lora_alpha", "learner.lora.alpha"),
    mapped(f"{_MODEL}target_modules", "learner.lora.target_modules", read=_lora_modules),
    *(mapped(f"{_MODEL}lora.{k}", f"learner.lora.{k}", note="Megatron-Bridge's LoRA section, as lora_rank / lora_alpha")
      for k in ("rank", "alpha", "dropout")),
    refused(f"{_MODEL}lora.adapter_path", "starting from a trained LoRA adapter", harmless=("",)),
    *model_rows(_MODEL),
    *override_rows(_MODEL, "learner.override_config", "rollout.override_config"),
    ignored(f"{_MODEL}torch_dtype", "the learner's dtype is learner.dtype"),
    refused(f"{_MODEL}tokenizer_path", "a tokenizer other than the policy's"),
    # -- the rollout -------------------------------------------------------------------------------------
    mapped(f"{_ROLLOUT}name", "rollout.backend", read=_rollout_name,
           note="vllm: vLLM's engine; sglang: SGLang servers the worker launches (rollout.servers_launch); "
                "hf: transformers"),
    mapped(f"{_ROLLOUT}temperature", "rollout.temperature", "learner.temperature", read=_temperature),
    mapped(f"{_ROLLOUT}dtype", "rollout.dtype", read=_rollout_dtype,
           note="the engine's dtype (its numbers differ from the learner's: what rollout correction is for)"),
    mapped(f"{_ROLLOUT}top_p", "rollout.top_p"),
    refused(f"{_ROLLOUT}top_k", "top-k sampling (rollout.top_k)", harmless=(-1, 0)),
    refused(f"{_ROLLOUT}do_sample", "greedy rollouts", harmless=(True,)),
    mapped(f"{_ROLLOUT}ignore_eos", "rollout.ignore_eos", note="generation goes on past EOS to the length limit"),
    mapped(f"{_ROLLOUT}tensor_model_parallel_size", "rollout.vllm.tensor_parallel_size",
           "rollout.servers_launch.gpus_per_replica", read=lambda v, g: {
               "rollout.vllm.tensor_parallel_size": _int(v), "rollout.servers_launch.gpus_per_replica": _int(v)}),
    mapped(f"{_ROLLOUT}gpu_memory_utilization", "rollout.vllm.gpu_memory_utilization"),
    *(mapped(f"{_ROLLOUT}multi_turn.{k}", f"rollout.multi_turn.{k}")
      for k in ("max_assistant_turns", "max_user_turns", "tool_config_path", "interaction_config_path", "format",
                "max_parallel_calls", "max_tool_response_length", "tool_response_truncate_side")),
    mapped(f"{_ROLLOUT}multi_turn.enable", read=_multi_turn_enable,
           note="multi-turn is on when a tool or interaction config is given"),
    refused(f"{_ROLLOUT}multi_turn.function_tool_path", "tools from a Python file's functions: tools come from "
                                                        "multi_turn.tool_config_path"),
    refused(f"{_ROLLOUT}multi_turn.use_inference_chat_template", "training on the inference chat template's "
                                                                 "rendering (the turns are tokenized as sampled)"),
    ignored(f"{_ROLLOUT}multi_turn.tokenization_sanity_check_mode", "verl's check of its own re-tokenization: the "
                                                                    "turns here are the sampled tokens"),
    ignored(f"{_ROLLOUT}multi_turn.num_repeat_rollouts", "verl's deprecated repeat of multi-turn rollouts (rollout.n)"),
    mapped(f"{_VAL}n", "eval.n"),
    mapped(f"{_VAL}temperature", "eval.temperature"),
    mapped(f"{_VAL}top_p", "eval.top_p"),
    mapped(f"{_VAL}do_sample", "eval.do_sample", read=_val_do_sample,
           note="sampling at val_kwargs.temperature; at 0 (verl's default) greedy, as verl's engine decodes"),
    refused(f"{_VAL}top_k", "top-k sampling in validation", harmless=(-1, 0)),
    ignored(f"{_ROLLOUT}log_prob_*", LOGPROB_PASS),
    ignored(f"{_ROLLOUT}mode", "verl's sync or async rollout: every rollout worker here streams"),
    ignored(f"{_ROLLOUT}over_sample_rate", "verl's abort of a step's slowest rollouts: " + STREAMING
            + ", every rollout finishes"),
    ignored(f"{_ROLLOUT}calculate_log_probs", "the rollout engine always returns the sampled tokens' log-probs"),
    *(ignored(f"{_ROLLOUT}{k}", ENGINE) for k in (
        "enable_chunked_prefill", "max_num_batched_tokens", "max_num_seqs", "enforce_eager", "free_cache_engine",
        "load_format", "layered_summon", "multi_stage_wake_up", "data_parallel_size", "expert_parallel_size",
        "pipeline_model_parallel_size", "max_model_len", "update_weights_bucket_megabytes",
        "enable_prefix_caching", "cudagraph_capture_sizes", "disable_log_stats", "skip_tokenizer_init",
        "disaggregation.*", "scheduling_policy", "moe_tensor_parallel_size", "moe_load_balance_metrics_interval")),
    *(ignored(f"{_ROLLOUT}{k}", "the engine's sampling seed and determinism: other samples from the same distribution")
      for k in ("seed", "full_determinism")),
    *(ignored(f"{_ROLLOUT}{k}", "the GPUs and router of verl's standalone rollout servers: here the rollout workers' "
                                "own (rollout.servers_launch, rollout.openai's router)")
      for k in ("n_gpus_per_node", "nnodes", "router_config_path")),
    ignored(f"{_ROLLOUT}checkpoint_engine.*", WEIGHTS),
    ignored(f"{_ROLLOUT}prometheus.*", "verl's Prometheus for its rollout servers: streamrl's metrics are its own"),
    ignored(f"{_ROLLOUT}mtp", "verl fills it in from actor_rollout_ref.model.mtp"),
    ignored(f"{_ROLLOUT}mtp.*", MTP_SETTINGS),
    ignored(f"{_ROLLOUT}qat", "verl fills it in from actor_rollout_ref.actor.qat"),
    ignored(f"{_ROLLOUT}qat.*", QAT_SETTINGS),
    *(row for engine in ("vllm", "sglang") for row in (
        mapped(f"{_ROLLOUT}engine_kwargs.{engine}", *_ENGINE_KWARGS[engine], read=_engine_kwargs(engine),
               note=f"read with rollout.name={engine} (verl passes its engine's own): "
                    + ("vLLM's engine arguments (rollout.vllm.engine_kwargs)" if engine == "vllm" else
                       "the SGLang servers' flags, --key-with-dashes value (rollout.servers_launch.engine_kwargs)")),
        mapped(f"{_ROLLOUT}engine_kwargs.{engine}.*", *_ENGINE_KWARGS[engine], read=_engine_kwargs(engine),
               note=f"one of engine_kwargs.{engine}"))),
    ignored(f"{_ROLLOUT}engine_kwargs.trtllm*", "TensorRT-LLM's engine arguments, read only with rollout.name=trtllm "
                                               "(refused)"),
    mapped(f"{_ROLLOUT}quantization", "rollout.quantization", read=_quantization,
           note="the engine quantises each published version as it loads it (vLLM's quantization=, the launched "
                "servers' --quantization); the learner trains full precision (rollout correction is for the "
                "mismatch); refused with rollout.name=hf"),
    mapped(f"{_ROLLOUT}quantization_config_file", "rollout.quantization_config_file", read=_quantization_file,
           note="vLLM's hf_overrides.quantization_config_file (with quantization; null: none)"),
    refused(f"{_ROLLOUT}logprobs_mode", "log-probs of the engine's raw logits (logprobs_mode): the rollout records the "
                                        "sampling distribution's"),
    mapped(f"{_ROLLOUT}enable_rollout_routing_replay", "rollout.return_routed_experts",
           read=lambda v, g: {"rollout.return_routed_experts": _bool(v)},
           note="each record carries the experts the rollout routed its tokens to (R3 replays them)"),
    *(mapped(f"{_ACTOR}{engine}.router_replay.mode", "learner.router_replay", read=_router_replay(engine),
             note=f"read where the actor's engine is {engine} (verl's FSDP engine replays none)")
      for engine in ("megatron", "veomni")),
    *(refused(f"{_ACTOR}{engine}.router_replay.{k}", "router replay to and from files (record_file / replay_file): "
                                                      "the routing travels on the records", harmless=(None,))
      for engine in ("megatron", "veomni") for k in ("record_file", "replay_file")),
    *(ignored(f"{section}{engine}.router_replay.*", ROUTER_REPLAY)
      for section in ("actor_rollout_ref.ref.", "critic.") for engine in ("megatron", "veomni")),
    mapped(f"{_ROLLOUT}agent.agent_loop_config_path", "rollout.agent.agent_loop_config_path",
           read=lambda v, g: {"rollout.agent.agent_loop_config_path": "" if v is None else str(v)},
           note="the agent-loop classes (name, _target_) run in the rollout workers"),
    mapped(f"{_ROLLOUT}agent.default_agent_loop", "rollout.agent.default_agent_loop",
           read=lambda v, g: {"rollout.agent.default_agent_loop": "single_turn_agent" if v is None else str(v)},
           note="a prompt without an agent_name runs it; single_turn_agent / tool_agent: the workers' own turn loop"),
    ignored(f"{_ROLLOUT}agent.num_workers", "verl's agent-loop worker processes: each rollout worker runs its "
                                            "prompts' agent loops concurrently (rollout.max_in_flight)"),
    ignored(f"{_ROLLOUT}agent._target_", TARGET),
    ignored(f"{_ROLLOUT}agent.custom_async_server._target_", TARGET),
    refused(f"{_ROLLOUT}agent.custom_async_server.name", "a custom async inference server class: the rollout "
                                                         "workers' backends (rollout.backend)", harmless=(None,)),
    refused(f"{_ROLLOUT}agent.custom_async_server.path", "a custom async inference server class: the rollout "
                                                         "workers' backends (rollout.backend)", harmless=(None,)),
    ignored(f"{_ROLLOUT}trace.*", "verl's rollout tracing"),
    ignored(f"{_ROLLOUT}profiler.*", PROFILER),
    ignored(f"{_ROLLOUT}prompt_length", "filled in by verl from data.max_prompt_length"),
    ignored(f"{_ROLLOUT}response_length", "filled in by verl from data.max_response_length"),
)

__all__ = ["ACTOR_ROWS", "optim_rows", "model_rows", "override_rows", "engine_rows", "TARGET", "MEGATRON_LORA", "WEIGHTS"]
