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
from streamrl.errors import ConfigError
from streamrl.evaluation.config import EvalConfig
from streamrl.learner.config import VERL_PREFIXES, LearnerConfig, verl_overrides
from streamrl.reward.config import (CustomRewardFunctionConfig, RewardConfig, RewardModelConfig,
                                    apply_verl_keys)
from streamrl.rollout.config import FeedConfig, RolloutConfig
from streamrl.tracking.config import TrackingConfig

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
    eval: EvalConfig = field(default_factory=EvalConfig)  # validation while training (streamrl eval)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)  # TensorBoard, MLflow, W&B


#: verl's trainer, data and validation keys -> this config's (the objective's are the learner's:
#: ``streamrl.learner.config.VERL_KEYS``); any other key under these prefixes is refused, named
_VAL = "actor_rollout_ref.rollout.val_kwargs."
PIPELINE_VERL_KEYS = {
    "data.train_files": "feed.dataset",
    "data.val_files": "eval.dataset",
    "trainer.test_freq": "eval.every",
    "trainer.val_before_train": "eval.before_train",
    **{_VAL + k: f"eval.{k}" for k in ("n", "do_sample", "temperature", "top_p")},
    "trainer.logger": "tracking.loggers",
    "trainer.project_name": "tracking.project",
    "trainer.experiment_name": "tracking.experiment",
    "trainer.total_training_steps": "learner.versions",
    "trainer.total_epochs": "feed.epochs",
    "trainer.save_freq": "learner.checkpoint_every",
}
PIPELINE_VERL_PREFIXES = ("data.", "trainer.", _VAL)


def _verl_value(key: str, value: Any) -> Any:
    """A verl value in this config's terms: ``test_freq``/``save_freq`` -1 (off) is 0, a logger
    given as one name is a list, and a list of one file is that file."""
    if key in ("trainer.test_freq", "trainer.save_freq") and isinstance(value, int) and value < 0:
        return 0
    if key == "trainer.logger" and isinstance(value, str):
        return [value]
    if key in ("data.train_files", "data.val_files") and isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ConfigError(f"config field {key!r}: streamrl reads one file per dataset (got {len(value)}); "
                              f"put the data sources' rows in one file (each row keeps its data_source)")
        return value[0]
    return value


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
            for top in ("algorithm", "actor_rollout_ref", "data", "trainer"):  # verl's: _apply_verl_objective
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
    cfg.eval.validate()  # type: ignore[attr-defined]
    cfg.tracking.validate()  # type: ignore[attr-defined]
    if cfg.learner.adv_estimator == "remax":  # type: ignore[attr-defined]  # ReMax's greedy baseline per group
        cfg.rollout.greedy_baseline = True  # type: ignore[attr-defined]
    if cfg.eval.enabled and cfg.eval.every and not cfg.learner.keep_every:  # type: ignore[attr-defined]
        cfg.learner.keep_every = cfg.eval.every  # type: ignore[attr-defined]  # the versions it will load
    return cfg  # type: ignore[return-value]


def _apply_verl_objective(merged: DictConfig, overrides: Sequence[str], path: Any) -> tuple[DictConfig, list[str]]:
    """A verl config's keys (in the file, then on the command line): the objective's
    (``algorithm.*``, ``actor_rollout_ref.actor.*``) onto ``learner``
    (``streamrl.learner.config.VERL_KEYS``), the trainer's, data's and validation's onto their
    sections (``PIPELINE_VERL_KEYS``); returns the config and the overrides that are not verl's."""
    given: list[tuple[str, Any]] = []
    if path:
        raw = OmegaConf.load(path)
        for top in ("algorithm", "actor_rollout_ref", "data", "trainer"):
            if top in raw:
                given += _flatten(OmegaConf.to_container(raw[top]), top)
    rest = []
    for override in overrides:
        key = override.split("=", 1)[0].strip()
        if key.startswith(VERL_PREFIXES + PIPELINE_VERL_PREFIXES):
            given += _flatten(OmegaConf.to_container(OmegaConf.from_dotlist([override])), "")
        else:
            rest.append(override)
    objective = []
    for verl_key, value in given:
        if verl_key in PIPELINE_VERL_KEYS:
            with config_errors(f" (from verl's {verl_key})"):
                OmegaConf.update(merged, PIPELINE_VERL_KEYS[verl_key], _verl_value(verl_key, value), merge=False)
        elif verl_key.startswith(PIPELINE_VERL_PREFIXES):
            raise ConfigError(f"config field {verl_key!r}: not one of the verl keys streamrl maps (README, "
                              f"'Coming from verl', lists them)")
        else:
            objective.append((verl_key, value))
    for verl_key, key, value in verl_overrides(objective):
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
