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

SCORER_TYPES = ("rule", "function", "class", "judge", "model", "hybrid")
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
    # ``scorers`` (its router's local proxy is passed) or a literal HOST:PORT. Empty: none, and
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
    # Route data sources as verl's default_compute_score does where streamrl's defaults differ
    # (openai/gsm8k strict, "math" to DAPO's scorer): streamrl.scorers.rules.verl_compat.
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

REWARD_MANAGERS = ("naive", "batch", "dapo", "prime")
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
    reward_manager: str = "naive"  # naive | batch | dapo | prime
    reward_kwargs: dict[str, Any] = field(default_factory=dict)  # what the reward manager takes (above)


def apply_verl_keys(reward: RewardConfig, crf: CustomRewardFunctionConfig, rm: RewardModelConfig) -> None:
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

    A bad value is a ``ConfigError`` naming the verl key."""
    manager, extra = rm.reward_manager, dict(rm.reward_kwargs)
    if manager not in REWARD_MANAGERS:
        raise ConfigError(f"config field 'reward_model.reward_manager': {manager!r} is not one of "
                          f"{REWARD_MANAGERS}")
    if rm.enable:
        raise ConfigError("config field 'reward_model.enable': a reward model is a reward.scorers entry "
                          "here (type: model, see configs/reward.example.yaml)")
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
        return spec

    if crf.path:
        reward.scorers[CUSTOM_ENTRY] = shaped(ScorerSpec(
            type="function", path=_reference(crf.path, crf.name), kwargs=dict(crf.reward_kwargs),
            data_sources=["*"]))
    elif manager == "batch":
        raise ConfigError("config field 'reward_model.reward_manager': batch needs a batch function in "
                          "custom_reward_function.path (verl's default_compute_score scores one record)")
    elif manager != "naive":
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
