"""The learning-rate schedule (verl's ``actor.optim.lr_scheduler_type`` and its warm-up), as a
pure function of the policy version: a version is verl's training step (one scheduler step per
step, the first update at step 0), so the rate at version ``v`` is verl's after ``v`` scheduler
steps. Being a function of the version alone, it carries across a resume (the version is in
every checkpoint) and across rank counts with nothing more to save.

``tests/learner/test_learner_parity_extra.py`` compares it with verl 0.9.1's
``get_constant_schedule_with_warmup`` / ``get_cosine_schedule_with_warmup`` at every version.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from streamrl.learner.config import LearnerConfig

LR_SCHEDULERS = ("constant", "cosine")


def warmup_versions(cfg: "LearnerConfig") -> int:
    """verl's rule: ``lr_warmup_steps`` when > 0, else ``int(lr_warmup_steps_ratio * total)``."""
    if cfg.lr_warmup_steps > 0:
        return int(cfg.lr_warmup_steps)
    return int(cfg.lr_warmup_steps_ratio * cfg.versions)


def lr_factor(cfg: "LearnerConfig", version: int) -> float:
    """The multiple of ``cfg.lr`` the update towards version ``version + 1`` uses."""
    warmup = warmup_versions(cfg)
    if cfg.lr_scheduler_type == "constant":
        return float(version) / float(max(1.0, warmup)) if version < warmup else 1.0
    if version < warmup:  # cosine: linear warm-up from 0 (verl's init_lr_ratio 0)
        return float(version) / float(max(1, warmup))
    progress = float(version - warmup) / float(max(1, cfg.versions - warmup))
    low = cfg.min_lr_ratio
    x = math.cos(math.pi * float(cfg.num_cycles) * 2.0 * progress)
    return max(low, x * (1 - low) * 0.5 + (1 + low) * 0.5)


def lr_at(cfg: "LearnerConfig", version: int) -> float:
    return cfg.lr * lr_factor(cfg, version)
