"""The learner's Prometheus metrics: each update's loss parts and statistics, the staleness of
what it trained on (in versions and in seconds per stage), and a version's summary."""

from __future__ import annotations

import math
import time

from streamrl import metrics
from streamrl.records import Rewarded


def observe_staleness(records: list[Rewarded], version: int) -> None:
    """How old each trained record is: versions behind ``version``, and the seconds it spent in
    generation, in the reward stage and waiting for the learner."""
    now = time.time()
    for r in records:
        metrics.LEARNER_STALENESS.observe(max(0, version - r.policy_version))
        gen = generation_seconds(r)
        if gen is not None:
            metrics.LEARNER_STALENESS_SECONDS.labels("generation").observe(gen)
        metrics.LEARNER_STALENESS_SECONDS.labels("reward").observe(max(0.0, r.scored_at - r.created_at))
        metrics.LEARNER_STALENESS_SECONDS.labels("learner").observe(max(0.0, now - r.scored_at))


def observe_update(out: dict[str, float], n: int) -> None:
    """One update's figures (``Trainer.step``'s output) on ``n`` records."""
    metrics.LEARNER_RECORDS.labels("trained").inc(n)
    metrics.LEARNER_STEP_SECONDS.observe(out["step_seconds"])
    metrics.LEARNER_TOKENS.inc(out["tokens"])
    for part in ("loss", "pg_loss", "kl"):
        if part in out:
            metrics.LEARNER_LOSS.labels(part).set(out[part])
    metrics.LEARNER_REWARD.labels("mean").set(out["reward_mean"])
    metrics.LEARNER_REWARD.labels("std").set(out["reward_std"])
    if "kl" in out:
        metrics.LEARNER_KL.labels("ref").set(out["kl"])
    metrics.LEARNER_KL.labels("ppo").set(out["ppo_kl"])
    metrics.LEARNER_ENTROPY.set(out["entropy"])
    metrics.LEARNER_GRAD_NORM.set(out["grad_norm"])
    metrics.LEARNER_CLIP_FRACTION.set(out["clip_fraction"])


def generation_seconds(r: Rewarded) -> float | None:
    """How long the record's generation took, from its timings (None when it has none)."""
    t = r.timings or {}
    if "generation_s" in t:
        return float(t["generation_s"])
    if "generation_started_at" in t:
        return max(0.0, r.created_at - float(t["generation_started_at"]))
    return None


def mean_metrics(items: list[dict[str, float]]) -> dict[str, float]:
    """A version's summary of its updates: means of the finite values, sums of the counts."""
    keys = {k for m in items for k in m}
    out = {}
    for k in sorted(keys):
        vals = [m[k] for m in items if k in m and math.isfinite(m[k])]
        if vals:
            out[k] = float(sum(vals) / len(vals)) if k not in ("tokens", "sequences") else float(sum(vals))
    return out
