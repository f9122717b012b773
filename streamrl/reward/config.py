"""The reward stage's config section (``reward:`` in a pipeline YAML).

The scorer table is keyed by *scorer name*; each entry says how to score and which
``data_source`` values it serves (default: its own name). Keeping names and data sources apart
lets one judge serve several data sets (one connection pool, one rate limit) and lets a hybrid
scorer name its parts. The built-in rule scorers are in the defaults, so a config only adds or
overrides entries::

    reward:
      scorers:
        gsm8k: {kwargs: {method: strict}}            # verl parity for the built-in
        my_code: {type: function, path: scorers/code.py:compute_score, executor: process,
                  timeout_s: 10, data_sources: [apps, taco], fallbacks: {timeout: 0.0}}

Judge and model entries carry their own sections (``judge:`` / ``model:``), checked against
``JudgeConfig`` / ``ModelScorerConfig`` when the stage starts, so those heavy modules are only
imported where they are used.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

from streamrl.errors import ConfigError
from streamrl.scorers.rules import RULES
from streamrl.servers.processes import ServerConfig

SCORER_TYPES = ("rule", "function", "class", "judge", "model", "hybrid", "manager")
EXECUTORS = ("auto", "inline", "thread", "process")


@dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong punishment, as verl's DAPO reward manager applies it: a response of
    more than ``max_resp_len - len`` tokens loses ``penalty_factor`` times the part of ``len`` it
    runs into (linearly, all of it at ``max_resp_len``); ``reward_info`` gets ``overlong_reward``
    and ``overlong``. Needs the record's ``response_ids``."""

    enable: bool = False  # apply the overlong penalty
    len: int = 0  # the buffer: the last len tokens before max_resp_len are penalised
    penalty_factor: float = 1.0  # the penalty at max_resp_len
    max_resp_len: int = 0  # verl's data.max_response_length


@dataclass
class ScorerSpec:
    """One entry of the scorer table."""

    type: str = "rule"  # rule | function | class | judge | model | hybrid
    rule: str = ""  # type rule: a built-in rule scorer (streamrl.scorers.RULES); default: the entry's name
    # type function: "file.py:name" or "package.module:name", verl's signature. type class: a
    # reward class, "file.py:ClassName": built with ``kwargs``, its ``compute_score`` (sync or
    # async) scores each record and its ``post_process_scores``, if any, is the group hook.
    path: str = ""
    kwargs: dict[str, Any] = field(default_factory=dict)  # extra keyword arguments (class: for __init__)
    # type function: a batch function (verl's BatchRewardManager), called on micro-batches
    batch: bool = False
    batch_size: int = 32  # batch: records per call, at most
    batch_wait_ms: float = 20.0  # batch: how long the first record waits for others
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    # Which data_source values this entry serves (exact, or a "prefix*"). None: its own name, or
    # for a built-in rule entry (gsm8k, math, math_dapo) that rule's usual data sources, which
    # any entry of yours that names one of them takes over (``routes``); []: none (a hybrid part).
    data_sources: Optional[list[str]] = None
    # Where a sync function runs: inline (on the event loop: cheap rules only), thread (up to
    # reward.thread_concurrency at once: blocking remote calls, as verl's reward agent runs its
    # functions), or process (a worker process, killed at timeout_s: CPU-heavy or unsafe work
    # such as math equivalence or code checks). auto: thread for your functions, process for the
    # math rules, thread for gsm8k.
    executor: str = "auto"
    # Per record. Long enough for remote calls that take 1-40 s (the reward agent's own test).
    timeout_s: float = 120.0
    version: str = ""  # reported in Rewarded.scorer.version; default: the module's VERSION or "0"
    # Failure reason -> score this config accepts instead of a dead letter, once retries are
    # spent, e.g. {timeout: 0.0}. The record says so: reward_info.status = "fallback:timeout".
    # A backend outage (Unavailable) never falls back: the stage holds the record.
    fallbacks: dict[str, float] = field(default_factory=dict)
    parts: dict[str, float] = field(default_factory=dict)  # type hybrid: scorer name -> weight
    judge: dict[str, Any] = field(default_factory=dict)  # type judge: JudgeConfig fields
    model: dict[str, Any] = field(default_factory=dict)  # type model: ModelScorerConfig fields
    # type manager: a verl reward manager class (streamrl.reward.managers.ManagerSpec fields);
    # path is then the custom reward function it scores with (none: default_compute_score), kwargs
    # that function's reward_kwargs
    manager: dict[str, Any] = field(default_factory=dict)


@dataclass
class GroupHookConfig:
    """A function over a complete group (all ``group_size`` samples of one prompt), run before
    any of them is published: normalisation, majority vote, pass@k. Empty ``function``: none.
    Waiting members count against ``reward.max_in_flight``: keep it several group sizes large,
    or groups only ever finish by timing out."""

    function: str = ""  # built-in name (streamrl.reward.hooks.HOOKS) or "file.py:name" / "module:name"
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to the hook's function as keyword arguments
    timeout_s: float = 120.0  # a group not complete by then is published unadjusted, marked so
    data_sources: list[str] = field(default_factory=list)  # only these; empty: every data source


TURN_REDUCERS = ("none", "last", "sum", "mean", "max", "discounted")


@dataclass
class TurnScoresConfig:
    """Multi-turn trajectories carry a score per turn (``turns[i].score``: the interaction's
    score of an answer, a tool call's step reward). ``reducer`` folds them, in transcript order,
    into one number added to the scorer's reward: ``reward = score + weight * reduce(scores)``
    (``reward_info.turn_reward``). ``discounted`` is the return ``sum(gamma**t * s_t)``, so a
    success in fewer turns is worth more. ``none``: the turn scores stay in the record only. The
    learner trains on the resulting trajectory reward; there is no per-turn credit."""

    reducer: str = "none"  # none | last | sum | mean | max | discounted
    weight: float = 1.0  # how much the reduced turn scores add to the scorer's reward
    gamma: float = 1.0  # discounted only


def _default_scorers() -> dict[str, ScorerSpec]:
    """The built-in rules, each serving its usual data sources (``streamrl.scorers.RULES``)
    until an entry of the user's claims them (``routes``)."""
    return {name: ScorerSpec(type="rule", rule=name) for name in RULES}


def routes(scorers: dict[str, ScorerSpec]) -> tuple[dict[str, ScorerSpec], set[str]]:
    """Every entry with its ``data_sources`` spelled out, and the names of the entries whose
    routes are *default routes*: a built-in rule entry (named after its rule) whose
    ``data_sources`` were not given serves the rule's usual data sources, and yields each of
    them to any other entry whose ``data_sources`` match it (exactly, or by a ``prefix*``;
    ``custom_reward_function``'s ``*`` matches all). Every other route is the user's own: two
    of them claiming the same data source is an error (``reward.table.ScorerTable``)."""
    out, defaults = {}, set()
    for name, spec in scorers.items():
        if spec.data_sources is None:
            rule = RULES.get(name) if spec.type == "rule" and spec.rule in ("", name) else None
            if rule is not None:
                defaults.add(name)
            spec = dataclasses.replace(spec, data_sources=list(rule.data_sources) if rule else [name])
        out[name] = spec
    return out, defaults


@dataclass
class RewardConfig:
    """The reward stage: a consumer group on rollouts that scores each record through the scorer
    table (``scorers``, routed by ``data_source``) and publishes it on rewarded."""

    group: str = ""  # the consumer group id (--group overrides); "": <bus.topic_prefix>-reward
    max_in_flight: int = 256  # records being scored at once per member (back-pressure above)
    max_attempts: int = 3  # tries of a failing scorer before the record is dead-lettered
    retry_backoff_s: float = 0.2  # first retry's wait; doubles each time, with jitter
    # A scorer whose backend is down (Unavailable) is retried without end, waiting up to
    # this long between tries: the record is held, never scored 0.
    unavailable_backoff_max_s: float = 30.0
    process_workers: int = 0  # worker processes for executor=process; 0: the CPU count
    thread_concurrency: int = 64  # sync functions in threads at once, per member (blocking I/O)
    # how much address space each worker process may add to what it inherits from the member
    # (a fork starts with all of the member's mappings); 0: no cap
    process_memory_mb: int = 4096
    # verl's reward_router_address for async user functions: the name of a judge entry in
    # ``scorers`` (its router's local proxy is passed), of a ``servers`` entry (a router over its
    # replicas: a generative reward model's, verl's reward.reward_model) or a literal HOST:PORT. Empty: none, and
    # a function that requires one fails at start.
    reward_router: str = ""
    reward_model_tokenizer: str = ""  # HF name or path passed (loaded) to functions that take it
    drain_timeout_s: float = 30.0  # on stop: how long in-flight records may finish
    # A reward beyond this magnitude (after the fp32 cast) is dead-lettered, not published: a
    # scorer bug such as 1e39 (inf in fp32) would make the learner's advantages NaN.
    max_abs_reward: float = 1e6
    scorers: dict[str, ScorerSpec] = field(default_factory=_default_scorers)
    group_hook: GroupHookConfig = field(default_factory=GroupHookConfig)
    turn_scores: TurnScoresConfig = field(default_factory=TurnScoresConfig)  # multi-turn scores into the reward
    # reward-model servers this stage launches (streamrl.servers.processes); model entries name
    # one with model.server
    servers: list[ServerConfig] = field(default_factory=list)
    # Score verl's data sources exactly as verl's default_compute_score does where streamrl's
    # defaults differ (openai/gsm8k strict, MATH's strings, "math" to DAPO's scorer, DAPO's string
    # verdict): streamrl.scorers.rules.verl_compat. On by itself under a verl launch script
    # (verl's keys given) unless set (streamrl.pipeline_config).
    verl_compat: bool = False

    def validate(self) -> "RewardConfig":
        """Raise ``ConfigError`` naming the first bad field (the scorer table's own checks run
        when it is built: ``reward.table.build_table``)."""
        for name in ("max_in_flight", "max_attempts", "thread_concurrency"):
            if getattr(self, name) < 1:
                raise ConfigError(f"config field 'reward.{name}': must be at least 1")
        if not self.max_abs_reward > 0:
            raise ConfigError("config field 'reward.max_abs_reward': must be positive")
        ts = self.turn_scores
        if ts.reducer not in TURN_REDUCERS:
            raise ConfigError(f"config field 'reward.turn_scores.reducer': {ts.reducer!r} is not one of {TURN_REDUCERS}")
        if not math.isfinite(ts.weight):
            raise ConfigError("config field 'reward.turn_scores.weight': must be finite")
        if not 0 < ts.gamma <= 1:
            raise ConfigError("config field 'reward.turn_scores.gamma': must be in (0, 1]")
        return self


# -- verl's own keys ------------------------------------------------------------------------------
# A verl user types ``custom_reward_function.path=...`` and ``reward_model.reward_manager=...``;
# streamrl reads them with verl's meaning and turns them into scorer-table entries
# (``apply_verl_keys``), so there is one table and one routing rule either way.

#: verl's managers built in here: 0.9.1's reward loop registers naive, dapo, gdpo, remote and
#: rate_limited; its legacy workers batch and prime. Any other name is a class of the user's
#: (``streamrl.reward.managers``).
REWARD_MANAGERS = ("naive", "batch", "dapo", "prime", "gdpo", "remote", "rate_limited")
MANAGER_SOURCES = ("register", "importlib")
#: The entry ``custom_reward_function`` becomes in ``reward.scorers``.
CUSTOM_ENTRY = "custom_reward_function"
#: verl's prime reward manager scores in a process pool, 300 s per record, and scores 0 whatever
#: fails; these are the failure reasons it maps to 0 (a backend outage still holds the record).
PRIME_FALLBACK_REASONS = ("timeout", "scorer_error", "worker_died", "memory", "bad_score")


@dataclass
class CustomRewardFunctionConfig:
    """verl's ``custom_reward_function``: a function with verl's scorer signature that scores
    every data source (verl calls it instead of ``default_compute_score``), with
    ``reward_kwargs`` added to every call. Data sources you route to entries of
    ``reward.scorers`` yourself stay with them."""

    path: Optional[str] = None  # a file (``my_reward.py``, ``file://...``) or ``pkg://package.module``
    name: str = "compute_score"  # the function's name in path (verl's custom_reward_function.name)
    reward_kwargs: dict[str, Any] = field(default_factory=dict)  # keyword arguments added to every call


@dataclass
class RewardModelConfig:
    """The part of verl's ``reward_model`` section that picks how the scoring function runs.
    ``reward_kwargs`` are what verl hands the reward manager: the batch function's keyword
    arguments (batch), ``max_resp_len`` and ``overlong_buffer_cfg`` (dapo)."""

    enable: bool = False  # verl's model-based reward: here a reward.scorers entry of type model
    # a built-in (REWARD_MANAGERS), a name a module registered, or with source importlib the
    # class's name in reward_manager_module
    reward_manager: str = "naive"
    reward_manager_source: str = "register"  # register | importlib (verl's reward.reward_manager.source)
    reward_manager_module: str = ""  # verl's reward_manager.module.path: the file or module of the class
    reward_manager_class: str = ""  # verl's reward_manager.module.name (importlib: tried after reward_manager)
    reward_kwargs: dict[str, Any] = field(default_factory=dict)  # what the reward manager takes (above)
    # verl's reward model (reward.reward_model.*, legacy reward_model.*), read with enable:
    # ``reward_model_entry`` says what each becomes
    model_path: str = ""  # the reward model (legacy reward_model.model.path)
    enable_resource_pool: bool = False  # its own GPUs: n_gpus_per_node x nnodes over the group
    n_gpus_per_node: int = 8  # with enable_resource_pool: the pool's GPUs per node
    nnodes: int = 0  # with enable_resource_pool: the pool's nodes
    rollout: dict[str, Any] = field(default_factory=dict)  # verl's rollout.* of the reward model, as given


def apply_verl_keys(reward: RewardConfig, crf: CustomRewardFunctionConfig, rm: RewardModelConfig,
                    policy: str = "tiny", experiment: str = "", members: int = 1) -> None:
    """Fold verl's keys into ``reward.scorers`` (in place), with verl's meaning:

    - ``custom_reward_function.path`` / ``.name``: an entry ``custom_reward_function`` serving
      ``*``, every data source no entry of the user's routes (the built-in rules' default
      routes yield to it, as verl's custom function replaces ``default_compute_score``);
      ``reward_kwargs`` are its ``kwargs``;
    - ``reward_model.reward_manager`` shapes that entry (or, without a custom function, the
      built-in rules): ``naive`` one call per record; ``batch`` verl's batch signature on
      micro-batches (``reward_model.reward_kwargs`` to every call); ``dapo`` DAPO's overlong
      buffer from ``reward_model.reward_kwargs``; ``prime`` worker processes, 300 s per record,
      a failure scores 0.

    - any other manager (a name the user's module registers, or ``reward_manager_source:
      importlib``): an entry of ``type: manager`` serving ``*`` (``streamrl.reward.managers``),
      its class built once per member and scoring every record with ``run_single``, as verl's
      reward loop does; it reads ``reward_kwargs`` from its config itself.

    - ``reward_model.enable``: verl's reward model, as its reward loop uses it
      (``reward_model_entry``): without a custom function a discriminative model scores every
      record; with one, the function scores, calling the generative model's servers through
      ``reward_router_address``.

    ``members`` is the reward group's size (the reward model's GPUs are shared among them),
    ``policy`` is the policy's tokenizer (a manager decodes token ids with it), ``experiment`` the
    run's name (verl's ``trainer.experiment_name``, which gdpo-style managers read).
    A bad value is a ``ConfigError`` naming the verl key."""
    manager, extra = rm.reward_manager, dict(rm.reward_kwargs)
    if rm.reward_manager_source not in MANAGER_SOURCES:
        raise ConfigError(f"config field 'reward_model.reward_manager_source': {rm.reward_manager_source!r} is "
                          f"not one of {MANAGER_SOURCES}")
    if rm.reward_manager_source == "importlib" or manager not in REWARD_MANAGERS:
        if rm.enable:
            reward_model_entry(reward, crf, rm, members)
            if crf.path is None:  # verl: the discriminative model scores, not the manager
                return
        _user_manager(reward, crf, rm, policy, experiment)
        return
    if rm.enable:
        reward_model_entry(reward, crf, rm, members)
        if crf.path is None:  # a discriminative model scores every record (verl's reward loop)
            return
    overlong = None
    if manager == "dapo":
        unknown = sorted(set(extra) - {"max_resp_len", "overlong_buffer_cfg"})
        if unknown:
            raise ConfigError(f"config field 'reward_model.reward_kwargs': verl's dapo reward manager takes "
                              f"max_resp_len and overlong_buffer_cfg, not {unknown}")
        buffer = dict(extra.get("overlong_buffer_cfg") or {})
        where = "config field 'reward_model.reward_kwargs.overlong_buffer_cfg"
        unknown = sorted(set(buffer) - {"enable", "len", "penalty_factor", "log"})
        if unknown:
            raise ConfigError(f"{where}': verl's overlong buffer has enable, len, penalty_factor, log; not {unknown}")
        if buffer.get("enable"):
            try:
                overlong = OverlongBufferConfig(enable=True, len=int(buffer.get("len", 0)),
                                                penalty_factor=float(buffer.get("penalty_factor", 1.0)),
                                                max_resp_len=int(extra.get("max_resp_len") or 0))
            except (TypeError, ValueError) as exc:
                raise ConfigError(f"{where}': {exc}") from None
            if not 0 < overlong.len < overlong.max_resp_len:
                raise ConfigError("config field 'reward_model.reward_kwargs.overlong_buffer_cfg.len': needs "
                                  f"0 < len < max_resp_len (got {overlong.len}, max_resp_len {overlong.max_resp_len})")
    elif manager != "batch" and extra:
        raise ConfigError(f"config field 'reward_model.reward_kwargs': verl's {manager} reward manager takes "
                          f"none (got {sorted(extra)})")

    def shaped(spec: ScorerSpec) -> ScorerSpec:
        if manager == "batch":
            return dataclasses.replace(spec, batch=True, kwargs={**extra, **spec.kwargs})
        if manager == "dapo" and overlong is not None:
            return dataclasses.replace(spec, overlong_buffer=overlong)
        if manager == "prime":
            return dataclasses.replace(spec, executor="process", timeout_s=300.0,
                                       fallbacks={**dict.fromkeys(PRIME_FALLBACK_REASONS, 0.0), **spec.fallbacks})
        if manager == "remote":  # verl: each call in a worker process (Ray actors); a sync function only
            return dataclasses.replace(spec, executor="process")
        if manager == "rate_limited":  # verl: naive's call under rate limits (none unless +reward.max_rpm, ...), 300 s
            return dataclasses.replace(spec, timeout_s=300.0)
        return spec  # naive; gdpo (naive's call; verl also writes trainer.experiment_name into extra_info)

    if crf.path:
        reward.scorers[CUSTOM_ENTRY] = shaped(ScorerSpec(
            type="function", path=_reference(crf.path, crf.name), kwargs=dict(crf.reward_kwargs),
            data_sources=["*"]))
    elif manager == "batch":
        raise ConfigError("config field 'reward_model.reward_manager': batch needs a batch function in "
                          "custom_reward_function.path (verl's default_compute_score scores one record)")
    elif manager not in ("naive", "gdpo"):
        _, defaults = routes(reward.scorers)
        for name in defaults:
            reward.scorers[name] = shaped(reward.scorers[name])


def _reference(path: str, name: str) -> str:
    """verl's module path (``file.py``, ``file://file.py``, ``pkg://package.module``) and object
    name as streamrl's loader reference."""
    if not name:
        raise ConfigError("config field 'custom_reward_function.name': empty (verl's default: compute_score)")
    if path.startswith("pkg://"):
        return f"{path[len('pkg://'):].replace('/', '.')}:{name}"
    return f"{path.removeprefix('file://')}:{name}"


def _user_manager(reward: RewardConfig, crf: CustomRewardFunctionConfig, rm: RewardModelConfig, policy: str,
                  experiment: str) -> None:
    """A manager class of the user's: one ``type: manager`` entry serving ``*`` (named
    ``custom_reward_function`` when that function is given, as it is what scores, else
    ``reward_manager``), with verl's config as its manager reads it."""
    module = {"path": rm.reward_manager_module or None, "name": rm.reward_manager_class or "custom_reward_manager"}
    config = {
        "reward": {"reward_kwargs": dict(rm.reward_kwargs), "num_workers": 1,
                   "reward_manager": {"source": rm.reward_manager_source, "name": rm.reward_manager, "module": module},
                   "custom_reward_function": {"path": crf.path, "name": crf.name,
                                              "reward_kwargs": dict(crf.reward_kwargs)},
                   "reward_model": {"enable": rm.enable, "model_path": None},
                   "sandbox_fusion": {"url": None, "max_concurrent": 64, "memory_limit_mb": 1024}},
        "trainer": {"experiment_name": experiment},
        "actor_rollout_ref": {"model": {"path": policy, "tokenizer_path": None}},
    }
    manager = {"name": rm.reward_manager, "source": rm.reward_manager_source, "module_path": rm.reward_manager_module,
               "class_name": rm.reward_manager_class, "tokenizer": policy, "config": config}
    name = CUSTOM_ENTRY if crf.path else "reward_manager"
    reward.scorers[name] = ScorerSpec(type="manager", path=_reference(crf.path, crf.name) if crf.path else "",
                                      kwargs=dict(crf.reward_kwargs), data_sources=["*"], manager=manager)


#: the name of the reward model's entry in reward.scorers and of its servers in reward.servers
RM_ENTRY = "reward_model"
_RM_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
              "fp32": "float32", "float32": "float32"}
#: verl's rollout.* of the reward model -> each server's flag (vLLM, SGLang); a bool flag is given when true
_RM_FLAGS = {
    "vllm": {"dtype": "--dtype", "gpu_memory_utilization": "--gpu-memory-utilization", "enforce_eager": "--enforce-eager",
             "max_model_len": "--max-model-len", "max_num_seqs": "--max-num-seqs",
             "max_num_batched_tokens": "--max-num-batched-tokens", "load_format": "--load-format", "seed": "--seed",
             "quantization": "--quantization"},
    "sglang": {"dtype": "--dtype", "gpu_memory_utilization": "--mem-fraction-static",
               "enforce_eager": "--disable-cuda-graph", "max_model_len": "--context-length",
               "max_num_seqs": "--max-running-requests", "max_num_batched_tokens": "--chunked-prefill-size",
               "load_format": "--load-format", "seed": "--random-seed", "quantization": "--quantization"},
}
#: features verl turns on by default: off is a flag of its own
_RM_OFF_FLAGS = {"vllm": {"enable_prefix_caching": "--no-enable-prefix-caching",
                          "enable_chunked_prefill": "--no-enable-chunked-prefill"},
                 "sglang": {"enable_prefix_caching": "--disable-radix-cache",
                            "enable_chunked_prefill": "--chunked-prefill-size=-1"}}
#: the reward model's rollout.* keys read here (the others change nothing: streamrl.verl.table)
RM_ROLLOUT_KEYS = ("name", "tensor_model_parallel_size", "data_parallel_size", "engine_kwargs", "prompt_length",
                   "response_length", *_RM_FLAGS["vllm"], *_RM_OFF_FLAGS["vllm"])


def _flag_value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def reward_model_flags(engine: str, rollout: dict[str, Any]) -> list[str]:
    """The server's command-line flags for verl's ``rollout.*`` of the reward model (given keys
    only: the server's own defaults otherwise), and ``engine_kwargs.<engine>`` as ``--key value``."""
    out: list[str] = []
    for key, flag in _RM_FLAGS[engine].items():
        value = rollout.get(key)
        if value is None:
            continue
        if key == "enforce_eager":
            out += [flag] if value else []
        else:
            out += [flag, _flag_value(_RM_DTYPES.get(value, value) if key == "dtype" else value)]
    for key, flag in _RM_OFF_FLAGS[engine].items():
        if rollout.get(key) is False:
            out += flag.split("=") if "=" in flag else [flag]
    from streamrl.servers.processes import kwargs_flags

    return out + kwargs_flags((rollout.get("engine_kwargs") or {}).get(engine) or {})


def reward_model_entry(reward: RewardConfig, crf: CustomRewardFunctionConfig, rm: RewardModelConfig,
                       members: int = 1) -> None:
    """verl's reward model (``reward.reward_model.*`` / legacy ``reward_model.*``) as a consumer
    group's scorer, with verl's meaning (its reward loop, ``RewardLoopWorker.compute_score``):

    - **no custom reward function: a discriminative model** scores every record (``*``; the
      built-in rules yield to it, as verl calls the model instead of ``default_compute_score``):
      the score of the last token of the reward model's chat template over [prompt, response]
      (``type: model``, streamrl.scorers.model). ``rollout.name`` vllm or sglang: servers the
      reward member launches (``reward.servers`` entry ``reward_model``: each replica
      ``tensor_model_parallel_size`` GPUs, the reward model's ``rollout.*`` as their flags,
      ``reward_model_flags``), batched dynamically (``max_num_seqs`` records a batch); unset
      (verl's ``???``) or ``hf``: transformers in each member's process (CPU or its GPU).
    - **with a custom reward function: a generative model**: the function scores, and gets
      ``reward_router_address``, a router over the reward model's own servers (``reward.servers``
      entry ``reward_model``, serving chat completions; never the policy's), and the model's
      tokenizer as ``reward_model_tokenizer``, as verl's.

    Replicas: ``n_gpus_per_node * nnodes // tensor_model_parallel_size`` with
    ``enable_resource_pool`` (verl's standalone pool), shared among the group's ``members`` (each
    launches its share); without it verl colocates the model on the trainer's GPUs, here it takes
    ``data_parallel_size`` replicas of its own per member."""
    if not rm.model_path:
        raise ConfigError("config field 'reward_model.model_path': reward_model.enable needs the reward model "
                          "(verl's reward.reward_model.model_path, legacy reward_model.model.path)")
    ro = dict(rm.rollout)
    engine = ro.get("name") or "hf"
    engine = "hf" if engine in ("???", "transformers") else engine
    if engine not in ("vllm", "sglang", "hf"):
        raise ConfigError(f"config field 'reward_model.rollout.name': {engine!r}: the reward model is served by vllm "
                          f"or sglang, or runs in the reward members (hf, or unset)")
    if "dtype" in ro and ro["dtype"] not in _RM_DTYPES:
        raise ConfigError(f"config field 'reward_model.rollout.dtype': {ro['dtype']!r} is not one of {sorted(_RM_DTYPES)}")
    genrm = bool(crf.path)
    max_len = ro.get("max_model_len") or int(ro.get("prompt_length", 2048)) + int(ro.get("response_length", 2048))
    model: dict[str, Any] = {"model_path": rm.model_path, "max_length": int(max_len)}
    if ro.get("max_num_seqs"):
        model["max_batch_size"] = int(ro["max_num_seqs"])
    if engine == "hf":
        if genrm:
            raise ConfigError("config field 'reward_model.rollout.name': a generative reward model (reward_model.enable "
                              "with custom_reward_function.path) is served by vllm or sglang: name one")
        if "dtype" in ro:
            model["dtype"] = _RM_DTYPES[ro["dtype"]]
        if ro.get("max_num_batched_tokens"):
            model["max_batch_tokens"] = int(ro["max_num_batched_tokens"])
        reward.scorers[RM_ENTRY] = ScorerSpec(type="model", data_sources=["*"], model=model)
        return
    tp = int(ro.get("tensor_model_parallel_size", 2))
    dp = int(ro.get("data_parallel_size", 1))
    if tp < 1 or dp < 1:
        raise ConfigError("config field 'reward_model.rollout.tensor_model_parallel_size': must be at least 1")
    if rm.enable_resource_pool:
        gpus = int(rm.n_gpus_per_node) * int(rm.nnodes)
        replicas = gpus // tp // max(members, 1)
        if replicas < 1:
            raise ConfigError(f"config field 'reward_model.n_gpus_per_node': {rm.n_gpus_per_node} x nnodes {rm.nnodes} "
                              f"GPUs hold no replica of {tp} GPUs for each of the {members} reward members "
                              f"(run.reward_members, verl's reward.num_workers)")
    else:
        replicas = dp
    reward.servers = [s for s in reward.servers if s.name != RM_ENTRY] + [ServerConfig(
        name=RM_ENTRY, model=rm.model_path, backend=engine, replicas=replicas, gpus_per_replica=tp,
        args=reward_model_flags(engine, ro), task="generate" if genrm else "classify")]
    if genrm:  # verl hands the function the router's address and the reward model's tokenizer
        reward.reward_router = RM_ENTRY
        reward.reward_model_tokenizer = reward.reward_model_tokenizer or rm.model_path
        return
    model.update(server=RM_ENTRY, model=rm.model_path)
    reward.scorers[RM_ENTRY] = ScorerSpec(type="model", data_sources=["*"], model=model)
