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

from dataclasses import dataclass, field
from typing import Any, Optional

SCORER_TYPES = ("rule", "function", "judge", "model", "hybrid")
EXECUTORS = ("auto", "inline", "thread", "process")


@dataclass
class ScorerSpec:
    """One entry of the scorer table."""

    type: str = "rule"  # rule | function | judge | model | hybrid
    rule: str = ""  # type rule: a built-in rule scorer (streamrl.scorers.RULES); default: the entry's name
    path: str = ""  # type function: "file.py:name" or "package.module:name", verl's signature
    kwargs: dict[str, Any] = field(default_factory=dict)  # extra keyword arguments for the function
    # Which data_source values this entry serves. None: its own name; []: none (a hybrid part).
    data_sources: Optional[list[str]] = None
    # Where a sync function runs: inline (on the event loop: cheap rules only), thread, or
    # process (a worker process, killed at timeout_s: CPU-heavy work such as math equivalence or
    # code checks). auto: process for functions and the math rule, inline for the other rules.
    executor: str = "auto"
    timeout_s: float = 30.0  # per record, for rule / function / hybrid parts of those types
    version: str = ""  # reported in Rewarded.scorer.version; default: the module's VERSION or "0"
    # Failure reason -> score this config accepts instead of a dead letter, once retries are
    # spent, e.g. {timeout: 0.0}. The record says so: reward_info.status = "fallback:timeout".
    # A backend outage (ScorerUnavailable) never falls back: the stage holds the record.
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
    kwargs: dict[str, Any] = field(default_factory=dict)
    timeout_s: float = 120.0  # a group not complete by then is published unadjusted, marked so
    data_sources: list[str] = field(default_factory=list)  # only these; empty: every data source


def _default_scorers() -> dict[str, ScorerSpec]:
    """The built-in rules, each serving its usual data sources (``streamrl.scorers.RULES``)."""
    from streamrl.scorers import RULES

    return {name: ScorerSpec(type="rule", rule=name, data_sources=list(rule.data_sources))
            for name, rule in RULES.items()}


@dataclass
class RewardConfig:
    group: str = "streamrl-reward"  # the consumer group id (--group overrides)
    max_in_flight: int = 256  # records being scored at once per member (back-pressure above)
    max_attempts: int = 3  # tries of a failing scorer before the record is dead-lettered
    retry_backoff_s: float = 0.2  # first retry's wait; doubles each time, with jitter
    # A scorer whose backend is down (ScorerUnavailable) is retried without end, waiting up to
    # this long between tries: the record is held, never scored 0.
    unavailable_backoff_max_s: float = 30.0
    process_workers: int = 0  # worker processes for executor=process; 0: the CPU count
    # verl's reward_router_address for async user functions: the name of a judge entry in
    # ``scorers`` (its router's local proxy is passed) or a literal HOST:PORT. Empty: none, and
    # a function that requires one fails at start.
    reward_router: str = ""
    reward_model_tokenizer: str = ""  # HF name or path passed (loaded) to functions that take it
    drain_timeout_s: float = 30.0  # on stop: how long in-flight records may finish
    scorers: dict[str, ScorerSpec] = field(default_factory=_default_scorers)
    group_hook: GroupHookConfig = field(default_factory=GroupHookConfig)
