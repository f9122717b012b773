"""The whole pipeline's config: ``PipelineConfig`` composes every stage's section, and
``load_config`` reads it (defaults <- YAML <- ``key.path=value`` overrides).

It sits above the stages' own sections (``learner/config.py``, ``reward/config.py``,
``rollout/config.py``, ``archive/config.py``) and the shared ones of ``streamrl.config``, which
import nothing of it: a section knows its stage, the pipeline knows every section. The stages
take a ``PipelineConfig`` in ``from_config`` (the runtime hands it to them), naming it for type
checkers only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf

from streamrl.archive.config import ArchiveConfig
from streamrl.config import BusConfig, MetricsConfig, RunConfig, TopicsConfig, apply_override, config_errors
from streamrl.learner.config import VERL_PREFIXES, LearnerConfig, verl_overrides
from streamrl.reward.config import (CustomRewardFunctionConfig, RewardConfig, RewardModelConfig,
                                    apply_verl_keys)
from streamrl.rollout.config import FeedConfig, RolloutConfig

__all__ = ["PipelineConfig", "load_config"]


@dataclass
class PipelineConfig:
    bus: BusConfig = field(default_factory=BusConfig)
    topics: TopicsConfig = field(default_factory=TopicsConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    run: RunConfig = field(default_factory=RunConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    feed: FeedConfig = field(default_factory=FeedConfig)
    # verl's keys, with verl's meaning, folded into reward.scorers by load_config
    # (streamrl.reward.config.apply_verl_keys)
    custom_reward_function: CustomRewardFunctionConfig = field(default_factory=CustomRewardFunctionConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    archive: ArchiveConfig = field(default_factory=ArchiveConfig)


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> PipelineConfig:
    """Defaults <- YAML file <- ``key.path=value`` overrides, checked against ``PipelineConfig``.
    A bad value fails naming its field and where it came from: the file, or the command line.
    ``path`` is a file, or the name of a packaged config (``local.yaml``)."""
    merged = OmegaConf.structured(PipelineConfig)
    if path:
        from streamrl.packaged import resolve_config

        path = resolve_config(str(path))
        with config_errors(f" in {path}"):
            raw = OmegaConf.load(path)
            for top in ("algorithm", "actor_rollout_ref"):  # verl's objective keys: _apply_verl_objective
                raw.pop(top, None)
            merged = OmegaConf.merge(merged, raw)
    merged, overrides = _apply_verl_objective(merged, overrides, path)
    before = _scorer_identities(merged)
    for override in overrides:
        with config_errors(f" on the command line ({override})"):
            merged = apply_override(merged, override)
    merged = _drop_stale_kwargs(merged, before, overrides)
    with config_errors(f" in {path}" if path else ""):
        cfg = OmegaConf.to_object(merged)
    apply_verl_keys(cfg.reward, cfg.custom_reward_function, cfg.reward_model)  # type: ignore[attr-defined]
    cfg.topics.validate()  # type: ignore[attr-defined]
    return cfg  # type: ignore[return-value]


def _apply_verl_objective(merged: DictConfig, overrides: Sequence[str], path: Any) -> tuple[DictConfig, list[str]]:
    """A verl config's objective keys (``algorithm.*``, ``actor_rollout_ref.actor.*``; in the
    file, then on the command line) onto ``learner`` (``streamrl.learner.config.VERL_KEYS``);
    returns the config and the overrides that are not verl's."""
    given: list[tuple[str, Any]] = []
    if path:
        raw = OmegaConf.load(path)
        for top in ("algorithm", "actor_rollout_ref"):
            if top in raw:
                given += _flatten(OmegaConf.to_container(raw[top]), top)
    rest = []
    for override in overrides:
        key = override.split("=", 1)[0].strip()
        if key.startswith(VERL_PREFIXES):
            given += _flatten(OmegaConf.to_container(OmegaConf.from_dotlist([override])), "")
        else:
            rest.append(override)
    for verl_key, key, value in verl_overrides(given):
        with config_errors(f" (from verl's {verl_key})"):
            OmegaConf.update(merged, f"learner.{key}", value, merge=True)
    return merged, rest


def _flatten(tree: Any, prefix: str) -> list[tuple[str, Any]]:
    if not isinstance(tree, dict):
        return [(prefix, tree)]
    out = []
    for k, v in tree.items():
        out += _flatten(v, f"{prefix}.{k}" if prefix else str(k))
    return out


def _scorer_identities(merged: DictConfig) -> dict[str, tuple[Any, ...]]:
    scorers = OmegaConf.select(merged, "reward.scorers", default=None)
    return {str(k): (v.type, v.rule, v.path) for k, v in scorers.items()} if scorers is not None else {}


def _drop_stale_kwargs(merged: DictConfig, before: dict[str, tuple[Any, ...]], overrides: Sequence[str]) -> DictConfig:
    """``kwargs`` belong to the function they were written for: when the command line changes an
    entry's ``type``, ``rule`` or ``path``, the ``kwargs`` the config file gave it are dropped
    (``local.yaml``'s ``method: flexible`` is no argument of your function); those the command
    line gives it stay."""
    keyed = [(o.split("=", 1)[0].strip(), o) for o in overrides]
    for name, identity in _scorer_identities(merged).items():
        if name not in before or identity == before[name]:
            continue
        target = f"reward.scorers.{name}.kwargs"
        merged.reward.scorers[name].kwargs = {}
        for key, override in keyed:  # in order, as given
            if key == target or key.startswith(target + "."):
                merged = apply_override(merged, override)
            elif target.startswith(key + "."):  # the entry (or the table) given whole
                given = OmegaConf.select(OmegaConf.from_dotlist([override]), target, default=None)
                if given is not None:
                    merged.reward.scorers[name].kwargs = given
    return merged
