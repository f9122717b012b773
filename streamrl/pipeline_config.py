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
from streamrl.learner.config import LearnerConfig
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
            merged = OmegaConf.merge(merged, OmegaConf.load(path))
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
