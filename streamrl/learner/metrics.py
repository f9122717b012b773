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
    worst = 0
    for r in records:
        metrics.LEARNER_STALENESS.observe(max(0, version - r.policy_version))
        metrics.LEARNER_SPAN.observe(r.versions().span)
        worst = max(worst, version - r.policy_version)
        gen = generation_seconds(r)
        if gen is not None:
            metrics.LEARNER_STALENESS_SECONDS.labels("generation").observe(gen)
        metrics.LEARNER_STALENESS_SECONDS.labels("reward").observe(max(0.0, r.scored_at - r.created_at))
        metrics.LEARNER_STALENESS_SECONDS.labels("learner").observe(max(0.0, now - r.scored_at))
    if records:
        metrics.LEARNER_WORST_STALENESS.set(worst)


def observe_update(out: dict[str, float], n: int) -> None:
    """One update's figures (``Trainer.step``'s output) on ``n`` records. An update of the critic
    alone (``learner.critic_warmup``) has no policy figures: their gauges keep the last ones."""
    metrics.LEARNER_RECORDS.labels("trained").inc(n)
    metrics.LEARNER_STEP_SECONDS.observe(out["step_seconds"])
    metrics.LEARNER_TOKENS.inc(out["tokens"])
    for part in ("loss", "pg_loss", "kl", "distillation/loss"):
        if part in out:
            metrics.LEARNER_LOSS.labels(part.replace("/", "_")).set(out[part])  # distillation_loss
    metrics.LEARNER_REWARD.labels("mean").set(out["reward_mean"])
    metrics.LEARNER_REWARD.labels("std").set(out["reward_std"])
    for key, gauge in (("kl", metrics.LEARNER_KL.labels("ref")), ("ppo_kl", metrics.LEARNER_KL.labels("ppo")),
                       ("entropy", metrics.LEARNER_ENTROPY), ("clip_fraction", metrics.LEARNER_CLIP_FRACTION)):
        if key in out:
            gauge.set(out[key])
    if not out.get("critic_warmup"):  # (0.0 while the actor's update is skipped)
        metrics.LEARNER_GRAD_NORM.set(out["grad_norm"])


def generation_seconds(r: Rewarded) -> float | None:
    """How long the record's generation took, from its timings (None when it has none)."""
    t = r.timings or {}
    if "generation_s" in t:
        return float(t["generation_s"])
    if "generation_started_at" in t:
        return max(0.0, r.created_at - float(t["generation_started_at"]))
    return None


def record_figures(records: list[Rewarded], version: int, now: float | None = None) -> dict[str, float]:
    """What a mini-batch's records say, under the names the trackers map to verl's
    (``streamrl.tracking.VERL_NAMES``): scores (``critic/score``; ``critic/rewards`` are the same
    unless the KL is in the reward, which the trainer reports apart), response and prompt
    lengths in tokens (the clip ratio: responses that ended at the length limit), how many
    versions behind they were (counted from each record's oldest token; ``staleness_worst``, the
    mini-batch's oldest token, is a version summary's worst mini-batch), how many versions their
    tokens span (partial rollouts: ``span_mean``, ``span_max``; 1 for a response of one version),
    and how long the reward stage took (created -> scored)."""
    if not records:
        return {}
    now = time.time() if now is None else now
    scores = [float(r.reward) for r in records]
    responses = [_length(r, "response_ids", r.response) for r in records]
    prompts = [_length(r, "prompt_ids", r.prompt) for r in records]
    staleness = [max(0, version - r.policy_version) for r in records]  # policy_version: the oldest token's
    spans = [r.versions().span for r in records]
    clipped = [(r.extra_info or {}).get("finish_reason") == "length" for r in records]
    out = {}
    for name, vals in (("score", scores), ("rewards", scores), ("response_length", responses),
                       ("prompt_length", prompts)):
        out.update({f"{name}_mean": sum(vals) / len(vals), f"{name}_max": max(vals), f"{name}_min": min(vals)})
    out.update(response_length_clip_ratio=sum(clipped) / len(records), staleness_mean=sum(staleness) / len(records),
               staleness_max=float(max(staleness)), staleness_worst=float(max(staleness)),
               span_mean=sum(spans) / len(spans), span_max=float(max(spans)),
               total_tokens=float(sum(responses) + sum(prompts)),
               reward_lag_s=sum(max(0.0, r.scored_at - r.created_at) for r in records) / len(records))
    return {k: float(v) for k, v in out.items()}


def _length(record: Rewarded, name: str, text: object) -> int:
    ids = record.array(name)
    return len(ids) if ids is not None else len(str(text))


#: summed over a version's updates (counts); ``*_max`` / ``*_min`` take the extreme; the rest the mean
SUMMED = ("tokens", "sequences", "total_tokens")


def mean_metrics(items: list[dict[str, float]]) -> dict[str, float]:
    """A version's summary of its updates: means of the finite values, sums of the counts,
    extremes of the maxima and minima."""
    keys = {k for m in items for k in m}
    out = {}
    for k in sorted(keys):
        vals = [m[k] for m in items if k in m and math.isfinite(m[k])]
        if not vals:
            continue
        if k in SUMMED:
            out[k] = float(sum(vals))
        elif k.endswith(("_max", "_worst")):
            out[k] = float(max(vals))
        elif k.endswith("_min"):
            out[k] = float(min(vals))
        else:
            out[k] = float(sum(vals) / len(vals))
    return out
