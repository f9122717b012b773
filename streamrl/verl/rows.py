"""A row of verl's table (``Row``: mapped, ignored or refused), the reasons rows share, and
the readers that turn a verl value into streamrl keys. The table itself is ``streamrl.verl.table``;
what reads keys through it is ``streamrl.verl``."""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

MAPPED, IGNORED, REFUSED = "mapped", "ignored", "refused"

#: verl keys given, by their key without Hydra's prefix: what ``Row.read`` sees beside its value
Given = Mapping[str, Any]


class Refused(Exception):
    """A value with no counterpart here; the message says what is missing."""


class NotApplicable(Exception):
    """A value that changes nothing here (read so with the other keys given, such as the
    engine); the message says why, and the key is named at start as not applicable."""


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
        """``key`` is this row's key, or matches it as a pattern (``*`` any characters, dots too)."""
        return key == self.key or ("*" in self.key and fnmatch.fnmatchcase(key, self.key))

    @property
    def specificity(self) -> int:
        """How much of a key the row names: the most specific matching row wins."""
        return len(self.key.replace("*", ""))

    def apply(self, key: str, value: Any, given: Given) -> dict[str, Any]:
        """``{streamrl key: value}`` for this row's key given ``value``."""
        tail = key[len(self.key) - 1:] if self.key.endswith(".*") else ""
        if self.read is not None:
            out = self.read(value, given)
            return {f"{k}.{tail}": v for k, v in out.items()} if tail else out
        if tail:  # a section mapped key by key: the same tail under each target
            return {f"{to}.{tail}": value for to in self.to}
        return {to: value for to in self.to}


def mapped(key: str, *to: str, note: str = "", read: Callable[[Any, Given], dict[str, Any]] | None = None) -> Row:
    return Row(key, MAPPED, tuple(to), note, read)


def ignored(key: str, why: str) -> Row:
    return Row(key, IGNORED, (), why)


def refused(key: str, missing: str, harmless: tuple[Any, ...] = ()) -> Row:
    return Row(key, REFUSED, (), missing, harmless=harmless)


# -- reasons shared by several rows (one line each in a report) --------------------------------

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


def engine_given(given: Given) -> str:
    """verl's engine for the keys given: ``model_engine``, else what ``actor.strategy`` or
    the actor's engine sections given say (a script written for ``--config-name
    ppo_megatron_trainer``), else ``dp``."""
    if isinstance(given.get("model_engine"), str):
        return str(given["model_engine"])
    strategy = given.get(f"{_ACTOR}strategy")
    if strategy in ("megatron", "torchtitan", "veomni"):
        return str(strategy)
    for engine in ("megatron", "torchtitan", "veomni"):
        if any(k.startswith(f"{_ACTOR}{engine}.") for k in given):
            return engine
    return "dp"


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
    if value == "trtllm":
        raise Refused("TensorRT-LLM's rollouts (rollout.name=trtllm) that follow the learner: trtllm-serve takes no "
                      "new weights (verl loads them into its own Ray engine in process), so its samples would come "
                      "from the starting policy while the learner trains; streamrl launches trtllm-serve for a fixed "
                      "policy only (rollout.servers_launch.backend=trtllm with rollout.follow_policy=false)")
    raise ValueError(f"vllm, sglang, hf or trtllm (got {value!r})")


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


#: verl's trackers (verl.utils.tracking.Tracking.supported_backend, and its deprecated
#: ``tracking``, which is wandb) -> streamrl's (tracking.loggers)
VERL_LOGGERS = {"console": "console", "tensorboard": "tensorboard", "mlflow": "mlflow", "wandb": "wandb",
                "tracking": "wandb", "file": "file"}
#: verl's trackers streamrl has no counterpart for, and what each is
OTHER_LOGGERS = {"swanlab": "SwanLab", "vemlp_wandb": "Volcano Engine's ML platform W&B", "clearml": "ClearML",
                 "trackio": "Trackio", "rl_insight": "RL Insight"}


def _logger(value: Any, given: Given) -> dict[str, Any]:
    """verl's trainer.logger, each tracker mapped, or the list refused naming the ones streamrl has
    no tracker for (a run's figures would be missing where its script sends them)."""
    names = [value] if isinstance(value, str) else list(value)
    missing = [n for n in names if n in OTHER_LOGGERS]
    if missing:
        raise Refused("the tracker " + ", ".join(f"{n} ({OTHER_LOGGERS[n]})" for n in missing)
                      + f": streamrl logs to {', '.join(sorted(set(VERL_LOGGERS)))}")
    bad = [n for n in names if n not in VERL_LOGGERS]
    if bad:
        raise ValueError(f"trackers of verl's list ({', '.join([*VERL_LOGGERS, *OTHER_LOGGERS])}); got {bad}")
    return {"tracking.loggers": list(dict.fromkeys(VERL_LOGGERS[n] for n in names))}


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
    n = _int(value, "versions, an integer >= 0")
    if n < 0:
        raise ValueError(f"versions, an integer >= 0 (got {value!r})")
    return {"learner.critic_warmup": n}


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
