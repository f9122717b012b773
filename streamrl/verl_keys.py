"""verl's keys with verl's meaning: ONE table (``VERL_TABLE``) says, for every key a verl launch
script or config may carry, what it becomes here, why it changes nothing here, or what is
missing for it. The table drives three things, so they cannot disagree: the parser
(``read_verl_keys``, called by ``streamrl.pipeline_config``), ``streamrl run --dry-run``'s report,
and the table of ``docs/guides/verl.md`` (``markdown_table``, generated when the site is built).

A row is one of:

- ``mapped``: the key sets streamrl keys (``to``), by default to its value as given; ``read``
  turns the value (and the other verl keys given, for keys verl reads together, such as
  ``train_batch_size`` with ``ppo_mini_batch_size``) into ``{streamrl key: value}``, and may
  raise ``Refused`` for a value that has no counterpart (``adv_estimator=gae``) or ``ValueError``
  for a bad one.
- ``ignored``: accepted and named once at start as not applicable, with the reason: the key
  tunes verl's own machinery (Megatron, the reference's log-prob pass, Ray, profilers) and does
  not change what trains. ``harmless`` values of a ``refused`` row are treated the same way
  (``top_k=-1`` is verl's "off").
- ``refused``: the key would change what trains and streamrl has no counterpart; ``note`` says
  what is missing. Keys refused for the same reason are reported together, in one line.

A row's ``key`` is a verl key, or ``prefix.*`` for every key under ``prefix`` (``prefix*`` for
every key that starts so; the longest matching row wins). Adding a key is adding a row (``mapped`` / ``ignored`` / ``refused``).
Hydra's ``+key`` and ``++key`` are read as ``key``; a report names the key as it was typed.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

__all__ = ["Row", "Refused", "KeyOutcome", "VERL_TABLE", "VERL_TOPS", "is_verl_key", "read_verl_keys",
           "markdown_table", "find_row"]

MAPPED, IGNORED, REFUSED = "mapped", "ignored", "refused"

#: verl keys given, by their key without Hydra's prefix: what ``Row.read`` sees beside its value
Given = Mapping[str, Any]


class Refused(Exception):
    """A value with no counterpart here; the message says what is missing."""


@dataclass(frozen=True)
class Row:
    """One verl key (or ``prefix.*``) and what it is here (see the module's doc)."""

    key: str
    kind: str  # mapped | ignored | refused
    to: tuple[str, ...] = ()  # mapped: the streamrl keys it sets
    note: str = ""  # mapped: how it is read; ignored: why it changes nothing here; refused: what is missing
    read: Callable[[Any, Given], dict[str, Any]] | None = None  # mapped: value -> {streamrl key: value}
    harmless: tuple[Any, ...] = ()  # refused: values that change nothing (verl's "off"), accepted as ignored

    def matches(self, key: str) -> bool:
        return key == self.key or (self.key.endswith("*") and key.startswith(self.key[:-1]))

    def apply(self, key: str, value: Any, given: Given) -> dict[str, Any]:
        """``{streamrl key: value}`` for this row's key given ``value``."""
        if self.read is not None:
            return self.read(value, given)
        if self.key.endswith(".*"):  # a section mapped key by key: the same tail under each target
            tail = key[len(self.key) - 1:]
            return {f"{to}.{tail}": value for to in self.to}
        return {to: value for to in self.to}


def mapped(key: str, *to: str, note: str = "", read: Callable[[Any, Given], dict[str, Any]] | None = None) -> Row:
    return Row(key, MAPPED, tuple(to), note, read)


def ignored(key: str, why: str) -> Row:
    return Row(key, IGNORED, (), why)


def refused(key: str, missing: str, harmless: tuple[Any, ...] = ()) -> Row:
    return Row(key, REFUSED, (), missing, harmless=harmless)


# -- reasons shared by several rows (one line each in a report) --------------------------------

CRITIC = "the critic's other machinery (its own micro-batches, FSDP, schedules): the critic runs the learner's"
CRITIC_WARMUP = ("a critic warm-up (the critic trained alone for the first steps): streamrl trains the critic and "
                 "the policy from the first version")
CRITIC_LR_SCHEDULE = "a learning-rate schedule for the critic: its lr is learner.critic.lr, constant"
MULTIMODAL = "images and videos in the prompts: the feed and the rollout workers read text only"
MEGATRON = "Megatron's parallelism and checkpoints: the learner shards with FSDP2 (learner.parallel)"
REF_PASS = ("the reference model's log-prob pass (its micro-batches, offload, parallelism): the learner computes "
            "the reference's log-probs itself, within learner.micro_batch_size / max_tokens_per_micro_batch")
LOGPROB_PASS = ("the rollout's log-prob recomputation pass (its micro-batches): the rollout engine returns each "
                "token's log-prob as it samples")
ENGINE = "the inference engine's memory and scheduling: the same samples, sooner or later"
FSDP_TUNING = "FSDP's own tuning (sharding size, prefetch, wrap policy): the learner's FSDP2 is set by learner.parallel"
MEMORY = "memory savings that compute the same gradients"
SEQ_PARALLEL = ("Ulysses sequence parallelism (a sequence split across GPUs): the learner's ranks each hold whole "
                "sequences; the same gradients")
PROFILER = "profilers: streamrl's figures are its Prometheus metrics"
RAY = "verl's Ray set-up: streamrl starts its stages itself (run.launcher, run.ray.*)"
STREAMING = "a stream has no step-synchronous batch"


# -- reading values -----------------------------------------------------------------------------

def _int(value: Any, what: str = "an integer") -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ValueError(f"{what} (got {value!r})")
    try:
        out = float(value)
    except ValueError:
        raise ValueError(f"{what} (got {value!r})") from None
    if not math.isfinite(out) or out != int(out):
        raise ValueError(f"{what} (got {value!r})")
    return int(out)


def _bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ValueError(f"true or false (got {value!r})")


_ACTOR, _ROLLOUT, _MODEL, _VAL = ("actor_rollout_ref.actor.", "actor_rollout_ref.rollout.",
                                  "actor_rollout_ref.model.", "actor_rollout_ref.rollout.val_kwargs.")
_VERL_DEFAULTS = {f"{_ACTOR}ppo_max_token_len_per_gpu": 16384, f"{_ACTOR}kl_loss_coef": 0.001}


def _adv_estimator(value: Any, given: Given) -> dict[str, Any]:
    return {"learner.adv_estimator": value}  # gae trains a critic, remax adds a greedy baseline (issue 48)


def _batch(value: Any, given: Given) -> dict[str, Any]:
    """verl's train_batch_size prompts per step, in ppo_mini_batch_size mini-batches: here one
    version of train_batch_size / ppo_mini_batch_size optimizer steps."""
    prompts = _int(value, "prompts per step, an integer >= 1")
    if f"{_ACTOR}ppo_mini_batch_size" not in given:  # one mini-batch of all the step's prompts
        if prompts < 1:
            raise ValueError(f"prompts per step, an integer >= 1 (got {value!r})")
        return {"learner.mini_batches_per_version": 1, "learner.groups_per_mini_batch": prompts}
    mini = _int(given[f"{_ACTOR}ppo_mini_batch_size"], "an integer >= 1")
    if prompts < 1 or mini < 1 or prompts % mini:
        raise ValueError(f"a multiple of actor_rollout_ref.actor.ppo_mini_batch_size ({mini}), as verl requires "
                         f"(got {value!r})")
    return {"learner.mini_batches_per_version": prompts // mini}


def _mini_batch(value: Any, given: Given) -> dict[str, Any]:
    return {"learner.groups_per_mini_batch": _int(value)}


def _use_kl_loss(value: Any, given: Given) -> dict[str, Any]:
    on = _bool(value)
    coef = given.get(f"{_ACTOR}kl_loss_coef", _VERL_DEFAULTS[f"{_ACTOR}kl_loss_coef"])
    return {"learner.kl_coef": coef if on else 0.0}


def _kl_loss_coef(value: Any, given: Given) -> dict[str, Any]:
    return {}  # read with use_kl_loss (below): without it verl's KL loss is off


def _clip_ratio(value: Any, given: Given) -> dict[str, Any]:
    return {f"learner.{side}": value for side in ("clip_ratio_low", "clip_ratio_high") if _ACTOR + side not in given}


def _dynamic_bsz(value: Any, given: Given) -> dict[str, Any]:
    if not _bool(value):
        return {"learner.max_tokens_per_micro_batch": 0}
    budget = given.get(f"{_ACTOR}ppo_max_token_len_per_gpu", _VERL_DEFAULTS[f"{_ACTOR}ppo_max_token_len_per_gpu"])
    return {"learner.max_tokens_per_micro_batch": _int(budget)}


def _token_budget(value: Any, given: Given) -> dict[str, Any]:
    _int(value)
    return {}  # read with use_dynamic_bsz (verl uses it only then)


def _offload(value: Any, given: Given) -> dict[str, Any]:
    both = [given.get(f"{_ACTOR}fsdp_config.{k}", False) for k in ("param_offload", "optimizer_offload")]
    return {"learner.parallel.cpu_offload": any(_bool(v) for v in both)}


def _model_path(value: Any, given: Given) -> dict[str, Any]:
    out = {"learner.policy": str(value), "rollout.policy": str(value)}
    if given.get(f"{_ROLLOUT}name") == "sglang":
        out["rollout.openai.model"] = str(value)
    return out


def _rollout_name(value: Any, given: Given) -> dict[str, Any]:
    if value == "vllm":
        return {"rollout.backend": "vllm"}
    if value == "sglang":  # SGLang servers the rollout worker launches, loading each version
        return {"rollout.backend": "openai", "rollout.servers_launch.backend": "sglang",
                "rollout.openai.model": str(given.get(f"{_MODEL}path", ""))}
    if value == "hf":
        return {"rollout.backend": "transformers"}
    raise ValueError(f"vllm, sglang or hf (got {value!r})")


def _temperature(value: Any, given: Given) -> dict[str, Any]:
    return {"rollout.temperature": value, "learner.temperature": value}


def _val_do_sample(value: Any, given: Given) -> dict[str, Any]:
    """verl samples at val_kwargs.temperature (0 by default: greedy), so do_sample without a
    temperature above 0 is greedy decoding."""
    on = _bool(value)
    temperature = given.get(f"{_VAL}temperature", 0)
    return {"eval.do_sample": on and float(temperature) > 0}


def _minus_one_off(target: str) -> Callable[[Any, Given], dict[str, Any]]:
    def read(value: Any, given: Given) -> dict[str, Any]:
        n = _int(value)
        return {target: 0 if n < 0 else n}
    return read


def _save_freq(value: Any, given: Given) -> dict[str, Any]:
    n = _int(value)
    # -1: verl saves no checkpoint; here a checkpoint is also the learner's consumer offsets,
    # so it keeps one at the end only (learner.checkpoint_every 0)
    return {"learner.checkpoint_every": 0 if n < 0 else n}


def _total_epochs(value: Any, given: Given) -> dict[str, Any]:
    out: dict[str, Any] = {"feed.epochs": _int(value)}
    if "trainer.total_training_steps" not in given or given["trainer.total_training_steps"] is None:
        out["learner.versions"] = 0  # the run's length is the data's: it ends when the feed's epochs are trained
    return out


def _total_steps(value: Any, given: Given) -> dict[str, Any]:
    return {} if value is None else {"learner.versions": _int(value)}


def _files(section: str, samples: str) -> Callable[[Any, Given], dict[str, Any]]:
    """verl's file, or list of files read one after the other; every row of them unless
    ``samples`` (``data.train_max_samples``) says otherwise: a config's own ``limit`` was for its
    own dataset."""
    def read(value: Any, given: Given) -> dict[str, Any]:
        files = list(value) if isinstance(value, (list, tuple)) else [value]
        if not files or not all(isinstance(f, str) and f for f in files):
            raise ValueError(f"a file or a list of files (got {value!r})")
        out: dict[str, Any] = {f"{section}.dataset": files[0], f"{section}.more_datasets": files[1:]}
        if samples not in given:
            out[f"{section}.limit"] = 0
        return out
    return read


def _logger(value: Any, given: Given) -> dict[str, Any]:
    return {"tracking.loggers": [value] if isinstance(value, str) else list(value)}


def _resume_mode(value: Any, given: Given) -> dict[str, Any]:
    if value == "auto":
        return {"run.resume": "auto"}
    if value == "disable":
        return {"run.resume": "never"}
    if value == "resume_path":
        path = given.get("trainer.resume_from_path")
        if not path:
            raise ValueError("resume_path needs trainer.resume_from_path (a streamrl run directory)")
        return {"run.resume": str(path)}
    raise ValueError(f"auto, disable or resume_path (got {value!r})")


def _critic_warmup(value: Any, given: Given) -> dict[str, Any]:
    if _int(value) > 0:
        raise Refused(CRITIC_WARMUP)
    return {}


def _dtype(value: Any, given: Given) -> dict[str, Any]:
    names = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
             "fp32": "float32", "float32": "float32"}
    if value not in names:
        raise ValueError(f"one of {', '.join(names)} (got {value!r})")
    return {"learner.dtype": names[value]}


def _overlong(name: str) -> Row:
    """The DAPO recipe's legacy ``reward_model.overlong_buffer.<name>``: the dapo manager's
    ``overlong_buffer_cfg``, with ``max_resp_len`` data.max_response_length unless given."""
    def read(value: Any, given: Given) -> dict[str, Any]:
        out = {f"reward_model.reward_kwargs.overlong_buffer_cfg.{name}": value}
        if "reward_model.reward_kwargs.max_resp_len" not in given and "data.max_response_length" in given:
            out["reward_model.reward_kwargs.max_resp_len"] = _int(given["data.max_response_length"])
        return out
    return mapped(f"reward_model.overlong_buffer.{name}", f"reward_model.reward_kwargs.overlong_buffer_cfg.{name}",
                  read=read, note="the DAPO recipe's legacy section (max_resp_len: data.max_response_length)")


def _harmless(value: Any, harmless: tuple[Any, ...]) -> bool:
    """Whether ``value`` is one of ``harmless``, a bool only equal to a bool (``0`` is not ``False``)."""
    return any(value is h if isinstance(h, bool) or h is None or isinstance(value, bool) else value == h
               for h in harmless)


def _multi_turn_enable(value: Any, given: Given) -> dict[str, Any]:
    _bool(value)
    return {}  # multi-turn is on when a tool or interaction config is given


def _lora_modules(value: Any, given: Given) -> dict[str, Any]:
    return {"learner.lora.target_modules": [value] if isinstance(value, str) else list(value)}


def _same(key: str) -> Row:
    """A verl key streamrl's config has under the same name (its reward sections)."""
    return mapped(key, key[:-2] if key.endswith(".*") else key, note="the same key")


#: verl's distillation.distillation_loss keys, the same in streamrl.distillation.config
_DISTILLATION_LOSS = ("loss_mode", "topk", "use_task_rewards", "distillation_loss_coef", "loss_max_clamp",
                      "log_prob_min_clamp", "use_policy_gradient", "policy_loss_mode", "clip_ratio", "clip_ratio_low",
                      "clip_ratio_high")
CHUNKED_TOPK = ("verl's chunked top-k log-softmax, a memory trade-off at long context; the learner's top-k gather "
                "changes no number")
TEACHER_SCALE = ("the teacher's GPUs and replicas: here its consumer group (run.teacher_members, or KEDA on its lag), "
                 "each member on teacher.device")

# -- the table ------------------------------------------------------------------------------------

_LEARNER_SAME = ("clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode", "loss_scale_factor",
                 "entropy_coeff", "ppo_epochs", "tau_pos", "tau_neg", "kl_loss_type", "grad_clip")

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
    *(mapped(f"algorithm.filter_groups.{k}", f"learner.filter_groups.{k}")
      for k in ("enable", "metric", "max_num_gen_batches")),
    mapped("algorithm.lam", "learner.lam", note="GAE's lambda (adv_estimator=gae)"),
    mapped("algorithm.rollout_correction.*", "learner.rollout_correction",
           note="verl's rollout correction, decoupled or bypass; rollout_corr/* figures"),
    *(mapped(f"algorithm.{k}", f"learner.{k}", note="GDPO's reward components (reward_info fields)")
      for k in ("gdpo_reward_keys", "gdpo_reward_weights")),
    refused("algorithm.pf_ppo.*", "verl's PF-PPO reweighting of samples"),
    ignored("algorithm.use_pf_ppo", "verl's PF-PPO switch; refused with its algorithm.pf_ppo.* settings when on"),
    # -- the actor's objective --------------------------------------------------------------------
    *(mapped(f"{_ACTOR}policy_loss.{k}", f"learner.policy_loss.{k}")
      for k in ("loss_mode", "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")),
    *(mapped(_ACTOR + k, f"learner.{k}") for k in _LEARNER_SAME),
    mapped(f"{_ACTOR}clip_ratio", "learner.clip_ratio_low", "learner.clip_ratio_high", read=_clip_ratio,
           note="the low and high clips not given"),
    mapped(f"{_ACTOR}use_kl_loss", "learner.kl_coef", read=_use_kl_loss,
           note="on: learner.kl_coef = kl_loss_coef (verl's 0.001 by default); off: 0"),
    mapped(f"{_ACTOR}kl_loss_coef", "learner.kl_coef", read=_kl_loss_coef, note="read with use_kl_loss"),
    mapped(f"{_ACTOR}optim.lr", "learner.lr"),
    mapped(f"{_ACTOR}optim.weight_decay", "learner.weight_decay"),
    *(mapped(f"{_ACTOR}optim.{k}", f"learner.{k}", note="the lr schedule, counted in versions")
      for k in ("lr_warmup_steps", "lr_warmup_steps_ratio", "lr_scheduler_type", "num_cycles")),
    mapped(f"{_ACTOR}optim.warmup_style", "learner.lr_scheduler_type", note="lr_scheduler_type's older name"),
    mapped(f"{_ACTOR}optim.min_lr_ratio", "learner.min_lr_ratio",
           read=lambda v, g: {"learner.min_lr_ratio": 0.0 if v is None else v}, note="null: 0"),
    ignored(f"{_ACTOR}optim.total_training_steps", "filled in by verl's trainer"),
    # -- batch shape ---------------------------------------------------------------------------------
    mapped("data.train_batch_size", "learner.mini_batches_per_version", read=_batch,
           note="prompts per version: train_batch_size / ppo_mini_batch_size optimizer steps of "
                "ppo_mini_batch_size groups (rollout.trajectories_per_version follows)"),
    mapped(f"{_ACTOR}ppo_mini_batch_size", "learner.groups_per_mini_batch", read=_mini_batch,
           note="prompts (groups of rollout.n) per optimizer step"),
    mapped(f"{_ACTOR}ppo_micro_batch_size_per_gpu", "learner.micro_batch_size",
           note="sequences per forward pass on each rank"),
    mapped(f"{_ACTOR}ppo_micro_batch_size", "learner.micro_batch_size", note="verl's deprecated global form"),
    mapped(f"{_ACTOR}use_dynamic_bsz", "learner.max_tokens_per_micro_batch", read=_dynamic_bsz,
           note="on: the token budget ppo_max_token_len_per_gpu (verl's 16384 by default); off: 0"),
    mapped(f"{_ACTOR}ppo_max_token_len_per_gpu", "learner.max_tokens_per_micro_batch", read=_token_budget,
           note="read with use_dynamic_bsz"),
    mapped("actor_rollout_ref.rollout.n", "feed.group_size", note="samples per prompt (the group)"),
    # -- the learner's machinery -----------------------------------------------------------------------
    mapped(f"{_ACTOR}fsdp_config.param_offload", "learner.parallel.cpu_offload", read=_offload,
           note="either offload on: FSDP2's CPU offload (parameters, gradients, optimizer states)"),
    mapped(f"{_ACTOR}fsdp_config.optimizer_offload", "learner.parallel.cpu_offload", read=_offload,
           note="either offload on: FSDP2's CPU offload"),
    mapped(f"{_ACTOR}fsdp_config.model_dtype", "learner.dtype", read=_dtype),
    ignored(f"{_ACTOR}fsdp_config.*", FSDP_TUNING),
    ignored(f"{_ACTOR}strategy", "verl's FSDP or Megatron: the learner is FSDP2"),
    ignored(f"{_ACTOR}megatron.*", MEGATRON),
    ignored(f"{_ACTOR}ulysses_sequence_parallel_size", SEQ_PARALLEL),
    ignored(f"{_ACTOR}entropy_checkpointing", MEMORY),
    ignored(f"{_ACTOR}entropy_from_logits_with_chunking", MEMORY),
    ignored(f"{_ACTOR}checkpoint.*", "what a verl checkpoint holds: a streamrl checkpoint always holds the weights, "
                                     "the optimizer and the consumer offsets"),
    ignored(f"{_ACTOR}profiler.*", PROFILER),
    ignored(f"{_ACTOR}use_torch_compile", "torch.compile: the same gradients"),
    ignored(f"{_ACTOR}shuffle", "verl's shuffle of a mini-batch's samples: the same gradients"),
    ignored("actor_rollout_ref.ref.*", REF_PASS),
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
    refused(f"{_MODEL}lora_adapter_path", "starting from a trained LoRA adapter", harmless=(None, "")),
    ignored(f"{_MODEL}enable_activation_offload", MEMORY),
    ignored(f"{_MODEL}use_fused_kernels", "fused kernels: the same log-probs"),
    ignored(f"{_MODEL}fused_kernel_options.*", "fused kernels: the same log-probs"),
    ignored(f"{_MODEL}use_shm", "verl's copy of the model into shared memory"),
    ignored(f"{_MODEL}trust_remote_code", "models load with transformers' own classes"),
    ignored(f"{_MODEL}torch_dtype", "the learner's dtype is learner.dtype"),
    ignored(f"{_MODEL}external_lib", "verl's import of a model's library"),
    ignored(f"{_MODEL}use_liger", "Liger kernels: the same log-probs"),
    # -- the rollout -------------------------------------------------------------------------------------
    mapped(f"{_ROLLOUT}name", "rollout.backend", read=_rollout_name,
           note="vllm: vLLM's engine; sglang: SGLang servers the worker launches (rollout.servers_launch); "
                "hf: transformers"),
    mapped(f"{_ROLLOUT}temperature", "rollout.temperature", "learner.temperature", read=_temperature),
    mapped(f"{_ROLLOUT}top_p", "rollout.top_p"),
    refused(f"{_ROLLOUT}top_k", "top-k sampling (rollout.top_k)", harmless=(-1, 0)),
    refused(f"{_ROLLOUT}do_sample", "greedy rollouts", harmless=(True,)),
    mapped(f"{_ROLLOUT}tensor_model_parallel_size", "rollout.vllm.tensor_parallel_size",
           "rollout.servers_launch.gpus_per_replica", read=lambda v, g: {
               "rollout.vllm.tensor_parallel_size": _int(v), "rollout.servers_launch.gpus_per_replica": _int(v)}),
    mapped(f"{_ROLLOUT}gpu_memory_utilization", "rollout.vllm.gpu_memory_utilization"),
    *(mapped(f"{_ROLLOUT}multi_turn.{k}", f"rollout.multi_turn.{k}")
      for k in ("max_assistant_turns", "max_user_turns", "tool_config_path", "interaction_config_path", "format",
                "max_parallel_calls", "max_tool_response_length", "tool_response_truncate_side")),
    mapped(f"{_ROLLOUT}multi_turn.enable", read=_multi_turn_enable,
           note="multi-turn is on when a tool or interaction config is given"),
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
        "pipeline_model_parallel_size", "max_model_len", "dtype", "engine_kwargs.*", "update_weights_bucket_megabytes",
        "enable_prefix_caching", "cudagraph_capture_sizes", "disable_log_stats", "skip_tokenizer_init")),
    ignored(f"{_ROLLOUT}agent.*", "verl's agent-loop workers: multi-turn runs in the rollout workers"),
    ignored(f"{_ROLLOUT}trace.*", "verl's rollout tracing"),
    ignored(f"{_ROLLOUT}prompt_length", "filled in by verl from data.max_prompt_length"),
    ignored(f"{_ROLLOUT}response_length", "filled in by verl from data.max_response_length"),
    # -- the critic (issue 48: adv_estimator=gae) ----------------------------------------------------------
    mapped("critic.model.path", "learner.critic.model", note="its weights; a fresh value head on top"),
    *(mapped(f"critic.optim.{k}", f"learner.critic.{k}") for k in ("lr", "weight_decay")),
    mapped("critic.optim.clip_grad", "learner.critic.grad_clip"),
    *(mapped(f"critic.{k}", f"learner.critic.{k}") for k in ("cliprange_value", "grad_clip", "ppo_epochs",
                                                               "loss_agg_mode")),
    *(refused(f"critic.optim.{k}", CRITIC_LR_SCHEDULE, harmless=h) for k, h in (
        ("lr_warmup_steps", (-1, 0)), ("lr_warmup_steps_ratio", (0, 0.0)), ("warmup_style", ("constant",)),
        ("lr_scheduler_type", ("constant",)), ("min_lr_ratio", (0, 0.0, None)), ("num_cycles", (0.5,)))),
    ignored("critic.optim.total_training_steps", "filled in by verl's trainer"),
    *(ignored(f"critic.{k}", "the critic runs the learner's micro-batches (learner.micro_batch_size, "
                             "max_tokens_per_micro_batch) and mini-batches")
      for k in ("ppo_micro_batch_size_per_gpu", "ppo_micro_batch_size", "ppo_mini_batch_size", "use_dynamic_bsz",
                "ppo_max_token_len_per_gpu", "forward_micro_batch_size", "forward_micro_batch_size_per_gpu",
                "forward_max_token_len_per_gpu", "rollout_n")),
    ignored("critic.model.use_remove_padding", "the critic's forward passes are padded; the same values"),
    ignored("critic.model.enable_gradient_checkpointing", "the critic follows learner.gradient_checkpointing"),
    ignored("critic.model.fsdp_config.*", FSDP_TUNING),
    ignored("critic.model.tokenizer_path", "the critic reads the policy's token ids"),
    ignored("critic.model.trust_remote_code", "models load with transformers' own classes"),
    ignored("critic.model.external_lib", "verl's import of a model's library"),
    ignored("critic.strategy", "verl's FSDP or Megatron: the critic is FSDP2, as the learner"),
    ignored("critic.enable", "the critic is on with adv_estimator=gae"),
    ignored("critic.profiler.*", PROFILER),
    ignored("critic.checkpoint.*", "a streamrl checkpoint always holds the critic (critic_dcp/)"),
    ignored("critic.megatron.*", MEGATRON),
    ignored("critic.ulysses_sequence_parallel_size", SEQ_PARALLEL),
    refused("critic.*", CRITIC),
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
    refused("data.image_key", MULTIMODAL),
    refused("data.video_key", MULTIMODAL),
    ignored("data.filter_overlong_prompts_workers", "processes verl's filter uses"),
    ignored("data.return_raw_chat", "the rollout workers always get the prompt's chat messages"),
    ignored("data.val_batch_size", "the eval stage's batching"),
    ignored("data.dataloader_num_workers", "verl's data loader processes"),
    ignored("data.trust_remote_code", "the tokenizer loads with transformers' own classes"),
    ignored("data.use_shm", "verl's copy of the data into shared memory"),
    ignored("data.gen_batch_size", "DAPO's generation batch: " + STREAMING
            + "; groups filtered out (learner.filter_groups) are replaced as the stream brings more"),
    ignored("data.custom_cls.*", "verl's Dataset class: the feed reads rows in verl's preprocessed format "
                                 "(prompt, data_source, reward_model.ground_truth, extra_info) as they are; "
                                 "a class that changes them must be run once, to parquet"),
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
    mapped("trainer.resume_from_path", note="read with resume_mode=resume_path", read=lambda v, g: {}),
    mapped("trainer.max_actor_ckpt_to_keep", "learner.keep_checkpoints",
           read=lambda v, g: {} if v is None else {"learner.keep_checkpoints": _int(v)}),
    mapped("trainer.n_gpus_per_node", "learner.parallel.nproc",
           note="the learner's ranks per node (the rollout servers take their own GPUs)"),
    mapped("trainer.nnodes", "learner.parallel.nnodes"),
    mapped("trainer.critic_warmup", read=_critic_warmup, note="0 (no critic) changes nothing; above 0 needs a critic"),
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
    ignored("global_profiler.*", PROFILER),
    ignored("ray_kwargs.*", RAY),
    ignored("ray_init.*", RAY),
    ignored("transfer_queue.*", "verl's transfer queue: the topics are streamrl's"),
    # -- reward: verl's current section beside the legacy ones -----------------------------------------
    mapped("reward.custom_reward_function.path", "custom_reward_function.path"),
    mapped("reward.custom_reward_function.name", "custom_reward_function.name"),
    mapped("reward.custom_reward_function.reward_kwargs.*", "custom_reward_function.reward_kwargs"),
    mapped("reward.reward_manager.name", "reward_model.reward_manager"),
    ignored("reward.reward_manager.source", "where verl finds its reward manager"),
    mapped("reward.reward_kwargs.*", "reward_model.reward_kwargs"),
    mapped("reward.reward_model.enable", "reward_model.enable"),
    mapped("reward.launch_reward_fn_async", read=lambda v, g: {}, note="the reward stage always scores apart"),
    _same("custom_reward_function.path"),
    _same("custom_reward_function.name"),
    _same("custom_reward_function.reward_kwargs.*"),
    _same("reward_model.reward_manager"),
    _same("reward_model.reward_kwargs.*"),
    _same("reward_model.enable"),
    *(_overlong(k) for k in ("enable", "len", "penalty_factor", "log")),
    ignored("reward_model.launch_reward_fn_async", "the reward stage always scores apart from the learner"),
    refused("reward_model.*", "verl's reward-model worker: a reward model is a reward.scorers entry of type model "
                              "here (configs/reward.example.yaml)"),
    # -- on-policy distillation (docs/guides/distillation.md): the losses the same, the teacher a stage --
    _same("distillation.enabled"),
    *(_same(f"distillation.distillation_loss.{k}") for k in _DISTILLATION_LOSS),
    ignored("distillation.distillation_loss.use_chunked*", CHUNKED_TOPK),  # (in verl after 0.9.1)
    ignored("distillation.distillation_loss.chunked*", CHUNKED_TOPK),
    # verl's teachers by entry name, one per data source (key, model_path; teacher_model alone is the
    # single teacher, dropped beside others, said at start); inference.* and num_replicas are accepted
    # on each entry and named at start as not applicable (streamrl.distillation.config)
    _same("distillation.teacher_models.*"),
    _same("distillation.teacher_key"),
    ignored("distillation.n_gpus_per_node", TEACHER_SCALE),
    ignored("distillation.nnodes", TEACHER_SCALE),
)

#: the first parts of keys that are verl's alone (a key under them that no row matches is unknown)
VERL_TOPS = ("algorithm", "actor_rollout_ref", "data", "trainer", "critic", "reward_model", "custom_reward_function",
             "global_profiler", "ray_kwargs", "ray_init", "transfer_queue")


def find_row(key: str) -> Row | None:
    """The row for ``key``: an exact one, else the longest ``prefix.*`` that matches."""
    best = None
    for row in VERL_TABLE:
        if row.key == key:
            return row
        if row.matches(key) and (best is None or len(row.key) > len(best.key)):  # the most specific
            best = row
    return best


def is_verl_key(key: str) -> bool:
    """Whether an override's key (Hydra's ``+``/``++`` allowed) is verl's: under one of verl's
    own sections, or a row of the table (``reward.custom_reward_function.path``, beside
    streamrl's ``reward`` section)."""
    key = key.lstrip("+")
    return key.split(".", 1)[0] in VERL_TOPS or find_row(key) is not None


@dataclass
class KeyOutcome:
    """What one verl key given became: ``kind`` is mapped, ignored, refused, unknown or bad."""

    typed: str  # the key as typed (with Hydra's prefix)
    key: str
    value: Any
    kind: str
    sets: dict[str, Any] = field(default_factory=dict)  # mapped: streamrl key -> value
    why: str = ""  # ignored: the reason; refused: what is missing; unknown / bad: the problem

    def line(self) -> str:
        """The dry run's report line."""
        given = f"{self.typed}={_show(self.value)}"
        if self.kind == MAPPED:
            if not self.sets:  # read with other keys, or a value that needs nothing here
                return f"{given} -> nothing set ({self.why})"
            return f"{given} -> " + " ".join(f"{k}={_show(v)}" for k, v in self.sets.items())
        if self.kind == IGNORED:
            return f"{given} -> not applicable here: {self.why}"
        return f"{given} -> {self.kind}: {self.why}"


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_show(v) for v in value) + "]"
    return str(value)


def read_verl_keys(given: Iterable[tuple[str, Any]]) -> list[KeyOutcome]:
    """Each verl key given (``(typed key, value)``, in order: a later one wins) through the
    table. Never raises: a problem is an outcome (``refused``, ``unknown``, ``bad``)."""
    given = list(given)
    by_key = {typed.lstrip("+"): value for typed, value in given}
    known = sorted({r.key for r in VERL_TABLE})
    out = []
    for typed, value in given:
        key = typed.lstrip("+")
        row = find_row(key)
        if row is None:
            close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
            out.append(KeyOutcome(typed, key, value, "unknown", why="not a verl key streamrl knows"
                                  + (f" (did you mean {close[0]}?)" if close else "")))
        elif row.kind == IGNORED:
            out.append(KeyOutcome(typed, key, value, IGNORED, why=row.note))
        elif row.kind == REFUSED:
            if _harmless(value, row.harmless):
                out.append(KeyOutcome(typed, key, value, IGNORED, why="verl's default, which changes nothing"))
            else:
                out.append(KeyOutcome(typed, key, value, REFUSED, why=row.note))
        else:
            try:
                out.append(KeyOutcome(typed, key, value, MAPPED, row.apply(key, value, by_key), why=row.note))
            except Refused as exc:
                out.append(KeyOutcome(typed, key, value, REFUSED, why=str(exc)))
            except (ValueError, TypeError) as exc:
                out.append(KeyOutcome(typed, key, value, "bad", why=str(exc)))
    return out


def problem_lines(outcomes: Iterable[KeyOutcome]) -> list[str]:
    """One line per problem: each unknown key and bad value, and the refused keys grouped by what
    is missing (a PPO script's ``adv_estimator=gae`` and its ``critic.*`` keys: one line)."""
    lines, refusals = [], {}
    for o in outcomes:
        if o.kind in ("unknown", "bad"):
            lines.append(f"{o.typed}={_show(o.value)}: {o.why}")
        elif o.kind == REFUSED:
            row = find_row(o.key)  # a key refused whatever its value is named alone (critic.*)
            named = f"{o.typed}={_show(o.value)}" if row is not None and row.key == o.key else o.typed
            refusals.setdefault(o.why, []).append(named)
    for why, keys in refusals.items():
        lines.append(f"{', '.join(keys)}: refused, streamrl has no counterpart for {why}")
    return lines


def ignored_line(outcomes: Iterable[KeyOutcome]) -> str:
    """The keys accepted as not applicable, grouped by reason, in one line ("" when none)."""
    groups: dict[str, list[str]] = {}
    for o in outcomes:
        if o.kind == IGNORED:
            groups.setdefault(o.why, []).append(o.typed)
    return "; ".join(f"{', '.join(keys)} ({why})" for why, keys in groups.items())


def markdown_table() -> str:
    """The verl guide's table, generated from ``VERL_TABLE`` (docs/hooks.py)."""
    head = "| verl key | here | note |\n| --- | --- | --- |\n"
    rows = []
    for row in VERL_TABLE:
        if row.kind == MAPPED:
            here = ", ".join(f"`{t}`" for t in row.to) or "(read with other keys)"
        elif row.kind == IGNORED:
            here = "accepted, not applicable"
        else:
            here = "refused" + (f" (accepted as {', '.join(_show(h) for h in row.harmless)})" if row.harmless else "")
        note = row.note.replace("|", "\\|")
        rows.append(f"| `{row.key}` | {here} | {note} |")
    return head + "\n".join(rows) + "\n"
