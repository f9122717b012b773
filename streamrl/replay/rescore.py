"""Re-scoring through the reward stage's own scoring path.

A replay does not score records its own way: it scores them through ``reward.scoring.Scoring``,
the reward stage's own path (no bus involved), so a replay gets exactly the stage's scorers
(rules, user functions, judges, reward models, hybrids), retries and fallbacks, its reward
router, and its hold-while-unavailable (a judge that is down stalls a replay; it
never turns into 0). ``reward.max_in_flight`` records are scored at once, as in one member.

What ``--scorer`` names (``resolve_scorer``):

- ``NAME``: a built-in scorer (``gsm8k``, ``math``) or an entry of the ``reward.scorers`` table of
  ``--config``; that entry scores *every* record, whatever its ``data_source``;
- ``FILE.yaml``: a scorer configuration in the reward config's format: a pipeline YAML with a
  ``reward:`` section, or the section itself (``scorers:``, ``max_attempts:``, ...). It replaces
  the reward section of ``--config``; records are routed by ``data_source`` as the stage does;
- ``FILE.py:FUNCTION`` or ``MODULE:FUNCTION``: a function with verl's scorer signature; it scores
  every record (the reward config's concurrency, retries and executor rules apply).

Group hooks are not applied: a replay compares scorers, so both sides are the scorer's own
reward (see ``report.old_reward``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from streamrl import metrics
from streamrl.config import load_section
from streamrl.errors import ConfigError, Failure
from streamrl.records import Trajectory
from streamrl.reward.config import (CustomRewardFunctionConfig, RewardConfig, RewardModelConfig, ScorerSpec,
                                    apply_verl_keys)
from streamrl.reward.scoring import Scoring



@dataclass
class ScorerChoice:
    spec: str  # what the user gave
    reward: RewardConfig  # the reward config to score with
    entry: str | None  # the entry that scores every record; None: route by data_source


@dataclass
class Scored:
    """One record's outcome: a reward and its ``reward_info``, or the reason it failed."""

    scorer: str | None  # the entry that scored it
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)
    version: str = ""
    reason: str | None = None
    detail: str = ""


def resolve_scorer(spec: str, base: RewardConfig) -> ScorerChoice:
    """The reward config and entry ``spec`` stands for (see the module docstring); a bad
    ``spec`` raises ``ConfigError`` saying what is accepted."""
    if spec.endswith((".yaml", ".yml")):
        return ScorerChoice(spec, load_reward_config(spec), None)
    if ":" in spec:
        name = spec.rpartition(":")[2] or "function"
        rc = dataclasses.replace(base, scorers={**base.scorers, name: ScorerSpec(
            type="function", path=spec, data_sources=[])})
        return ScorerChoice(spec, _only(rc, name), name)
    if spec in base.scorers:
        return ScorerChoice(spec, _only(base, spec), spec)
    raise ConfigError(f"--scorer {spec!r}: not a built-in scorer or an entry of reward.scorers "
                      f"({', '.join(sorted(base.scorers))}); give a scorer config file (.yaml) or "
                      f"file.py:function")


def load_reward_config(path: str | Path) -> RewardConfig:
    """A reward config from a YAML file: a pipeline config's ``reward:`` section (with verl's
    ``custom_reward_function`` / ``reward_model`` keys folded in, as ``load_config`` does), or
    the section alone. Other sections of a pipeline config are ignored."""
    from omegaconf import OmegaConf

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--scorer {str(path)!r}: no such file")
    doc = OmegaConf.load(path)
    section = doc.get("reward", doc) if OmegaConf.is_dict(doc) else doc
    rc = load_section(RewardConfig, section, "reward", str(path))
    if OmegaConf.is_dict(doc) and ("custom_reward_function" in doc or "reward_model" in doc):
        apply_verl_keys(rc, load_section(CustomRewardFunctionConfig, doc.get("custom_reward_function") or {},
                                         "custom_reward_function", str(path)),
                        load_section(RewardModelConfig, doc.get("reward_model") or {}, "reward_model", str(path)))
    return rc


def _only(rc: RewardConfig, name: str) -> RewardConfig:
    """``rc`` with only the entries ``name`` needs (itself, a hybrid's parts, the router's
    judge), each serving no data source: nothing else is started (a reward model loads at
    start), and routes cannot clash."""
    keep = {name, *rc.scorers[name].parts}
    if rc.reward_router in rc.scorers:
        keep.add(rc.reward_router)
    scorers = {k: dataclasses.replace(v, data_sources=[]) for k, v in rc.scorers.items() if k in keep}
    return dataclasses.replace(rc, scorers=scorers)


class Rescorer:
    """``async with Rescorer(choice) as r: scored = await r.score_all(records)``.
    Raises ``ConfigError`` at construction for a bad scorer configuration."""

    def __init__(self, choice: ScorerChoice):
        self.choice = choice
        self.scoring = Scoring(choice.reward, group_hook=False)
        self.table = self.scoring.table
        self.max_in_flight = choice.reward.max_in_flight

    async def __aenter__(self) -> "Rescorer":
        await self.scoring.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.scoring.close()

    def versions(self) -> dict[str, str]:
        return {name: e.version for name, e in sorted(self.table.entries.items())}

    async def score(self, record: Trajectory) -> Scored:
        name = self.choice.entry
        entry = self.table.entries[name] if name else self.table.lookup(record.data_source)
        if entry is None:
            return Scored(None, reason="unknown_data_source",
                          detail=f"no scorer serves data_source {record.data_source!r}")
        try:
            reward, info = await self.scoring.score(entry, record)
        except Failure as exc:
            return Scored(entry.name, version=entry.version, reason=exc.reason, detail=exc.detail)
        # fp32, as the stage publishes it (Rewarded.from_trajectory)
        return Scored(entry.name, float(np.float32(reward)), info, entry.version)

    async def score_all(self, records: Sequence[Trajectory], progress: Any = None) -> list[Scored]:
        """Every record's outcome, in order; ``reward.max_in_flight`` at a time."""
        out: list[Scored | None] = [None] * len(records)
        todo = iter(range(len(records)))

        async def worker() -> None:
            for i in todo:
                out[i] = scored = await self.score(records[i])
                metrics.REPLAY_RECORDS.labels("scored" if scored.reason is None else "score_failed").inc()
                if progress is not None:
                    progress.update(1)

        workers = min(self.max_in_flight, len(records))
        await asyncio.gather(*(worker() for _ in range(workers)))
        return out  # type: ignore[return-value]
