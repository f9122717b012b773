"""The whole pipeline's config: ``PipelineConfig`` composes every stage's section, and
``load_config`` reads it (defaults <- YAML <- ``key.path=value`` overrides).

It sits above the stages' own sections (``learner/config.py``, ``reward/config.py``,
``rollout/config.py``, ``archive/config.py``) and the shared ones of ``streamrl.config``, which
import nothing of it: a section knows its stage, the pipeline knows every section. The stages
take a ``PipelineConfig`` in ``from_config`` (the runtime hands it to them), naming it for type
checkers only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from streamrl.archive.config import ArchiveConfig
from streamrl.config import BusConfig, MetricsConfig, RunConfig, TopicsConfig, apply_override, config_errors, override_tree
from streamrl.distillation.config import DistillationConfig, TeacherConfig
from streamrl.errors import ConfigError, StreamrlError
from streamrl.evaluation.config import EvalConfig
from streamrl.learner.config import LearnerConfig
from streamrl.reward.config import (CustomRewardFunctionConfig, RewardConfig, RewardModelConfig,
                                    apply_verl_keys)
from streamrl.feed.config import FeedConfig
from streamrl.rollout.config import RolloutConfig
from streamrl.tracking.config import TrackingConfig
from streamrl.verl import MAPPED, KeyOutcome, is_verl_key, problem_lines, read_command_line, read_verl_keys, show

__all__ = ["PipelineConfig", "Resolution", "load_config", "resolve_config"]


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
    # on-policy distillation (verl's section and names; the learner reads it as learner.distillation)
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)  # the teacher stage (streamrl teacher)


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> PipelineConfig:
    """Defaults <- YAML file <- ``key.path=value`` overrides, checked against ``PipelineConfig``.
    Every problem fails at once, one line each, naming its field and where it came from: the
    file, or the command line (a verl key as it was typed). ``path`` is a file, or the name of a
    packaged config (``local.yaml``)."""
    return resolve_config(path, overrides).config()


@dataclass
class Resolution:
    """A config as resolved from a file and overrides: the config (None when it cannot be
    built), what each verl key given became (``streamrl.verl``), and every problem found,
    one line each."""

    cfg: Optional[PipelineConfig]
    verl: list[KeyOutcome] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    # streamrl key -> the verl key (as typed, with its value) that set it: a check that fails on
    # the streamrl key names the key the user typed
    origin: dict[str, str] = field(default_factory=dict)

    def blame(self, message: str) -> str:
        """``message`` with the verl key (as typed) that set each field it names."""
        named = [key for key in self.origin if re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", message)]
        named = [k for k in named if not any(k != o and k in o for o in named)]  # the longest names only
        if not named:
            return message
        return f"{message} [from verl's {', '.join(dict.fromkeys(self.origin[k] for k in named))}]"

    def check(self, what: Callable[[], Any]) -> Any:
        """Run one check; a ``StreamrlError`` becomes a problem (blamed), not an exception."""
        try:
            return what()
        except StreamrlError as exc:
            self.problems.append(self.blame(str(exc)))
            return None

    def error(self) -> Optional[ConfigError]:
        if not self.problems:
            return None
        if len(self.problems) == 1:
            return ConfigError(self.problems[0])
        return ConfigError(f"{len(self.problems)} problems in the config:\n  " + "\n  ".join(self.problems))

    def config(self) -> PipelineConfig:
        """The config, or ``ConfigError`` listing every problem."""
        error = self.error()
        if error is not None:
            raise error
        assert self.cfg is not None
        return self.cfg


_VERL_FILE_SECTIONS = ("algorithm", "actor_rollout_ref", "data", "trainer", "critic")


def resolve_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Resolution:
    """``load_config``'s work, collecting every problem instead of stopping at the first (see
    ``Resolution``): verl's keys first (a verl config's sections in the file, then the command
    line's, through ``streamrl.verl.VERL_TABLE``), then streamrl's own overrides."""
    out = Resolution(None)
    merged = OmegaConf.structured(PipelineConfig)
    given: list[tuple[str, Any]] = []
    file_sets_compat = False
    if path:
        from streamrl.packaged import resolve_config as packaged

        path = packaged(str(path))
        try:
            with config_errors(f" in {path}"):
                raw = OmegaConf.load(path)
                file_sets_compat = OmegaConf.select(raw, "reward.verl_compat", default=None) is not None
                for top in _VERL_FILE_SECTIONS:
                    if top in raw:
                        given += _flatten(OmegaConf.to_container(raw.pop(top)), top)
                merged = OmegaConf.merge(merged, raw)
        except ConfigError as exc:
            out.problems.append(str(exc))
            return out
    rest = []
    entry = _verl_entry(merged, overrides)  # a recipe's entry module: its config's defaults come first
    if entry:
        from streamrl.verl.entries import entry_keys

        defaults, problem = entry_keys(entry)
        if problem:
            out.problems.append(problem)
        overrides = [*defaults, *overrides]
    for override in overrides:
        key, _, value = override.partition("=")
        if is_verl_key(key.strip()):  # Hydra's grammar, as verl reads it (streamrl.verl.overrides)
            pairs, problem = read_command_line(override)
            given += pairs
            if problem:
                out.problems.append(problem)
        else:
            rest.append(override)
    out.verl = read_verl_keys(given)
    out.problems += problem_lines(out.verl)
    for outcome in out.verl:
        if outcome.kind != MAPPED:
            continue
        for key, value in outcome.sets.items():
            out.origin[key] = f"{outcome.typed}={show(outcome.value)}"
            try:
                with config_errors(""):
                    OmegaConf.update(merged, key, value, merge=True)
            except ConfigError as exc:
                out.problems.append(f"{outcome.typed}={show(outcome.value)}: {str(exc).split(': ', 1)[-1]} "
                                    f"(as {key})")
    before = _scorer_identities(merged)
    for override in rest:
        try:
            with config_errors(f" on the command line ({override})"):
                merged = apply_override(merged, override)
        except ConfigError as exc:
            out.problems.append(str(exc))
    merged = _drop_stale_kwargs(merged, before, rest)
    _derive(merged, out.verl, rest)
    _verl_scoring(merged, out.verl, rest, file_sets_compat)
    try:
        with config_errors(f" in {path}" if path else ""):
            cfg = OmegaConf.to_object(merged)
    except ConfigError as exc:
        out.problems.append(out.blame(str(exc)))
        return out
    out.cfg = cfg  # type: ignore[assignment]
    if entry:  # what the recipe's trainer trains alone (its own loss selected by the script's keys)
        from streamrl.verl.entries import entry_problems

        out.problems += entry_problems(entry, cfg)
    out.check(lambda: apply_verl_keys(cfg.reward, cfg.custom_reward_function, cfg.reward_model,  # type: ignore[attr-defined]
                                      policy=cfg.rollout.policy, experiment=cfg.tracking.experiment,  # type: ignore[attr-defined]
                                      members=cfg.run.reward_members))  # type: ignore[attr-defined]
    _reward_model_placement(cfg)
    out.check(cfg.topics.validate)  # type: ignore[attr-defined]
    out.check(cfg.eval.validate)  # type: ignore[attr-defined]
    out.check(cfg.tracking.validate)  # type: ignore[attr-defined]
    out.check(cfg.distillation.validate)  # type: ignore[attr-defined]
    if cfg.distillation.enabled:  # type: ignore[attr-defined]  # each teacher: its entry over teacher:
        out.check(lambda: cfg.distillation.teachers(cfg.teacher))  # type: ignore[attr-defined]
    cfg.learner.distillation = cfg.distillation  # type: ignore[attr-defined]  # one object: the learner's view of it
    if cfg.rollout.group_size:  # type: ignore[attr-defined]  # the feed's groups are the size the workers sample
        cfg.feed.group_size = cfg.rollout.group_size  # type: ignore[attr-defined]  # (the learner counts them by it)
    if cfg.learner.adv_estimator == "remax" and not cfg.rollout.greedy_baseline:  # type: ignore[attr-defined]
        _greedy_baseline(cfg)
    if cfg.learner.router_replay == "R3":  # type: ignore[attr-defined]  # the routing it replays, recorded
        cfg.rollout.return_routed_experts = True  # type: ignore[attr-defined]
    if cfg.eval.enabled and cfg.eval.every and not cfg.learner.keep_every:  # type: ignore[attr-defined]
        cfg.learner.keep_every = cfg.eval.every  # type: ignore[attr-defined]  # the versions it will load
    if cfg.feed.max_prompt_length and not cfg.feed.tokenizer:  # type: ignore[attr-defined]
        cfg.feed.tokenizer = cfg.rollout.policy  # type: ignore[attr-defined]  # the policy's, as verl counts
    return out


def _reward_model_placement(cfg: Any) -> None:
    """verl's reward model on servers (``reward.servers`` entry ``reward_model``, from
    ``reward.reward_model.*``): each reward member's Ray actor asks for its replicas' GPUs, so the
    GPUs it sees (CUDA_VISIBLE_DEVICES) are its servers' own, unless ``run.ray.resources.reward``
    says otherwise."""
    from streamrl.reward.config import RM_ENTRY

    if not cfg.reward_model.enable or "reward" in cfg.run.ray.resources:
        return
    for server in cfg.reward.servers:
        if server.name == RM_ENTRY and server.gpus_per_replica:
            cfg.run.ray.resources["reward"] = {"num_gpus": float(server.replicas * server.gpus_per_replica)}


def _verl_entry(merged: Any, overrides: Sequence[str]) -> str:
    """``run.verl_entry`` as the command line (its last) or the file gives it."""
    for override in reversed(list(overrides)):
        key, _, value = override.partition("=")
        if key.strip().lstrip("+") == "run.verl_entry":
            return value.strip()
    return str(OmegaConf.select(merged, "run.verl_entry") or "")


def _greedy_baseline(cfg: PipelineConfig) -> None:
    """ReMax (``learner.adv_estimator: remax``): the rollout workers add a greedy response to each
    group, and the staleness gate, which counts trajectories, counts it (one more a group) so that
    a version's groups still fit under its bound."""
    cfg.rollout.greedy_baseline = True
    n = cfg.rollout.group_size or cfg.feed.group_size
    if cfg.rollout.trajectories_per_version and n:
        cfg.rollout.trajectories_per_version += cfg.rollout.trajectories_per_version // n


def _verl_scoring(merged: DictConfig, verl: list[KeyOutcome], rest: Sequence[str], file_sets_it: bool) -> None:
    """A verl launch script (any of verl's keys given) scores verl's data sources as verl does
    (``reward.verl_compat``, ``streamrl.scorers.rules.verl_compat``), unless the config file or
    the command line sets ``reward.verl_compat`` itself."""
    if not verl or file_sets_it or any(o.split("=", 1)[0].strip().lstrip("+") == "reward.verl_compat" for o in rest):
        return
    merged.reward.verl_compat = True


def _derive(merged: DictConfig, verl: list[KeyOutcome], rest: Sequence[str]) -> None:
    """What verl's batch keys imply beside the keys they set: the rollout workers' staleness
    gate counts a version's trajectories (prompts per version x samples per prompt), unless the
    command line sets it."""
    batch = {"data.train_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.rollout.n"}
    if not any(o.key in batch and o.kind == MAPPED for o in verl):
        return
    if any(o.split("=", 1)[0].strip() == "rollout.trajectories_per_version" for o in rest):
        return
    try:
        learner, feed = merged.learner, merged.feed
        per_version = int(learner.groups_per_mini_batch) * int(learner.mini_batches_per_version) * int(feed.group_size)
    except (OmegaConfBaseException, TypeError, ValueError):
        return  # a bad value, reported where it was set
    if int(merged.rollout.trajectories_per_version or 0):  # the gate is on: it follows the batch
        merged.rollout.trajectories_per_version = per_version


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
                given = OmegaConf.select(override_tree(override), target, default=None)
                if given is not None:
                    merged.reward.scorers[name].kwargs = given
    return merged
