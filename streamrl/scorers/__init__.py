"""Scorers, and the one dispatch table from ``data_source`` to the scorer that scores it.

As in verl's ``reward_score`` package, each built-in rule is a small module with verl's scorer
signature (``gsm8k``, ``math_verify``), and ``default_compute_score`` dispatches one call to
them by data source. The reward stage uses ``ScorerTable``: the same built-ins (the defaults of
``RewardConfig.scorers``) extended by the config with user functions, LLM judges, reward models
and hybrids, each entry serving the data sources it lists. ``build_table`` checks everything it
can when the stage starts (references resolve, signatures fit, sections are valid), so a bad
config fails then, naming the field, and not on the first record.

This package imports nothing heavy at import time: judge, model and math modules load when an
entry needs them.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from streamrl.scorers.base import ScoreError, ScorerUnavailable

if TYPE_CHECKING:
    from streamrl.reward.config import RewardConfig, ScorerSpec

log = logging.getLogger(__name__)

__all__ = ["RULES", "Rule", "ScoreError", "ScorerUnavailable", "ScorerTable", "Entry",
           "build_table", "default_compute_score", "split_result"]


@dataclass(frozen=True)
class Rule:
    """A built-in rule scorer: its function, where it runs by default, what it serves."""

    ref: str
    executor: str  # inline: microseconds of regex; process: CPU-heavy (SymPy)
    data_sources: tuple[str, ...]


RULES: dict[str, Rule] = {
    "gsm8k": Rule("streamrl.scorers.gsm8k:compute_score", "inline", ("gsm8k", "openai/gsm8k")),
    "math": Rule("streamrl.scorers.math_verify:compute_score", "process",
                 ("math", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval",
                  "HuggingFaceH4/MATH-500")),
}


def _resolve(ref: str) -> Callable[..., Any]:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def default_compute_score(data_source: str, solution_str: str, ground_truth: str | None,
                          extra_info: dict[str, Any] | None = None, **kwargs: Any) -> float | dict:
    """verl's ``default_compute_score``: one call, dispatched to the built-in rule that serves
    ``data_source``, run right here (no worker process, no timeout)."""
    for rule in RULES.values():
        if data_source in rule.data_sources:
            return _resolve(rule.ref)(data_source, solution_str, ground_truth, extra_info, **kwargs)
    raise ScoreError("unknown_data_source", f"no built-in scorer for data_source {data_source!r}")


def split_result(result: Any, name: str = "scorer") -> tuple[float, dict[str, Any]]:
    """A scorer's result (a number, or a dict with ``score`` and extra fields) as
    ``(score, extras)``. Anything else is the scorer's error, not a reward."""
    if isinstance(result, dict):
        if "score" not in result:
            raise ScoreError("bad_score", f"{name} returned a dict without 'score': {sorted(result)[:10]}")
        extras = {k: v for k, v in result.items() if k != "score"}
        result = result["score"]
    else:
        extras = {}
    if isinstance(result, (list, tuple)) and len(result) == 1:  # verl accepts res[0]
        result = result[0]
    try:
        score = float(result)
    except (TypeError, ValueError):
        raise ScoreError("bad_score", f"{name} returned {type(result).__name__}, not a number") from None
    return score, extras


@dataclass
class Entry:
    """One row of the table: the scorer (an async callable with verl's signature and
    ``start`` / ``close`` / ``set_share``) and what the stage needs to know about it."""

    name: str
    scorer: Any
    version: str
    data_sources: list[str]
    fallbacks: dict[str, float] = field(default_factory=dict)

    @property
    def label(self) -> dict[str, str]:
        return {"name": self.name, "version": self.version}


class ScorerTable:
    """``data_source`` -> ``Entry``. Built by ``build_table``; ``start`` before use."""

    def __init__(self, entries: dict[str, Entry], runner: Any, reward_router: str = ""):
        self.entries, self.runner, self.reward_router = entries, runner, reward_router
        self.routes: dict[str, Entry] = {}
        for entry in entries.values():
            for ds in entry.data_sources:
                if ds in self.routes:
                    from streamrl.errors import ConfigError
                    raise ConfigError(f"config field 'reward.scorers.{entry.name}.data_sources': "
                                      f"{ds!r} is already served by {self.routes[ds].name!r}")
                self.routes[ds] = entry

    def lookup(self, data_source: str) -> Entry | None:
        return self.routes.get(data_source)

    async def start(self) -> None:
        for entry in self.entries.values():
            await entry.scorer.start()
        address = await self._router_address()
        if address:
            from streamrl.scorers.loader import FunctionScorer
            for entry in self.entries.values():
                if isinstance(entry.scorer, FunctionScorer):
                    entry.scorer.available["reward_router_address"] = address

    async def _router_address(self) -> str:
        if not self.reward_router:
            return ""
        entry = self.entries.get(self.reward_router)
        if entry is None:
            return self.reward_router  # a literal HOST:PORT
        return await entry.scorer.router_address()

    async def close(self) -> None:
        for entry in self.entries.values():
            try:
                await entry.scorer.close()
            except Exception:  # noqa: BLE001 - close the others regardless
                log.exception("closing scorer %s failed", entry.name)
        if self.runner is not None:
            self.runner.close()

    def set_share(self, fraction: float) -> None:
        for entry in self.entries.values():
            entry.scorer.set_share(fraction)


def build_table(cfg: "RewardConfig") -> ScorerTable:
    """The table for a reward config. Raises ``ConfigError`` naming the field."""
    from streamrl.errors import ConfigError
    from streamrl.reward.config import EXECUTORS, SCORER_TYPES
    from streamrl.scorers.loader import ProcessRunner

    runner = ProcessRunner(cfg.process_workers)
    router = cfg.reward_router
    if router and router not in cfg.scorers and ":" not in router:
        raise ConfigError(f"config field 'reward.reward_router': {router!r} is neither a scorer "
                          f"entry nor HOST:PORT")
    if router in cfg.scorers and cfg.scorers[router].type != "judge":
        raise ConfigError(f"config field 'reward.reward_router': entry {router!r} is a "
                          f"{cfg.scorers[router].type} scorer; only a judge has a router")
    available: dict[str, Any] = {
        # the real address is filled in at start; the signature check only needs to know
        # whether there will be one
        "reward_router_address": "pending" if router else None,
        "reward_model_tokenizer": None,  # loaded below when configured
        "prompt": "",  # every record offers its prompt
    }
    if cfg.reward_model_tokenizer:
        from streamrl.scorers.loader import load_tokenizer

        try:
            available["reward_model_tokenizer"] = load_tokenizer(cfg.reward_model_tokenizer)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"config field 'reward.reward_model_tokenizer': cannot load "
                              f"{cfg.reward_model_tokenizer!r}: {exc}") from None
    entries: dict[str, Entry] = {}
    hybrids = []
    for name, spec in cfg.scorers.items():
        where = f"config field 'reward.scorers.{name}"
        if spec.type not in SCORER_TYPES:
            raise ConfigError(f"{where}.type': {spec.type!r} is not one of {SCORER_TYPES}")
        if spec.executor not in EXECUTORS:
            raise ConfigError(f"{where}.executor': {spec.executor!r} is not one of {EXECUTORS}")
        data_sources = [name] if spec.data_sources is None else list(spec.data_sources)
        if spec.type == "hybrid":
            hybrids.append((name, spec, data_sources))
            continue
        scorer = _build_scorer(name, spec, available, runner, cfg.reward_model_tokenizer)
        entries[name] = Entry(name, scorer, spec.version or str(getattr(scorer, "version", "0")),
                              data_sources, dict(spec.fallbacks))
    for name, spec, data_sources in hybrids:
        from streamrl.scorers.hybrid import HybridScorer

        parts = {}
        for part, weight in spec.parts.items():
            if part not in entries:
                raise ConfigError(f"config field 'reward.scorers.{name}.parts': {part!r} is not a "
                                  f"non-hybrid entry of reward.scorers")
            parts[part] = (entries[part].scorer, float(weight))
        try:
            scorer = HybridScorer(name, parts)
        except ValueError as exc:
            raise ConfigError(f"config field 'reward.scorers.{name}.parts': {exc}") from None
        entries[name] = Entry(name, scorer, spec.version or scorer.version, data_sources,
                              dict(spec.fallbacks))
    return ScorerTable(entries, runner, router)


def _build_scorer(name: str, spec: "ScorerSpec", available: dict[str, Any], runner: Any,
                  tokenizer_name: str) -> Any:
    from streamrl.errors import ConfigError
    from streamrl.scorers.loader import FunctionScorer

    where = f"config field 'reward.scorers.{name}"
    if spec.type in ("rule", "function"):
        if spec.type == "rule":
            rule = RULES.get(spec.rule or name)
            if rule is None:
                raise ConfigError(f"{where}.rule': {spec.rule or name!r} is not a built-in rule "
                                  f"({sorted(RULES)}); use type: function for your own")
            ref, executor = rule.ref, (rule.executor if spec.executor == "auto" else spec.executor)
        else:
            if not spec.path:
                raise ConfigError(f"{where}.path': a function scorer needs 'file.py:name' or 'module:name'")
            ref, executor = spec.path, spec.executor
        return FunctionScorer(ref, name=name, kwargs=dict(spec.kwargs), executor=executor,
                              timeout_s=spec.timeout_s, available=available, runner=runner,
                              version=spec.version, tokenizer_name=tokenizer_name)
    section = f"reward.scorers.{name}.{spec.type}"
    try:
        if spec.type == "judge":
            from streamrl.scorers.judge import JudgeConfig, JudgeScorer

            return JudgeScorer(_section(JudgeConfig, spec.judge, section), name=name)
        from streamrl.scorers.model import ModelScorer, ModelScorerConfig

        return ModelScorer(_section(ModelScorerConfig, spec.model, section), name=name)
    except ConfigError as exc:  # their checks name the field after the entry: give the full path
        raise ConfigError(str(exc).replace(f"'{name}.", f"'{section}.", 1)) from None


def _section(schema: type, values: dict[str, Any], where: str) -> Any:
    """A free-form config section checked against its dataclass, naming the field."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from streamrl.errors import ConfigError

    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), values))
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        raise ConfigError(f"config field '{where}.{key}': {str(exc).splitlines()[0]}") from None
