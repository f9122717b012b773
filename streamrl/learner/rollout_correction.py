"""Rollout correction (verl's ``algorithm.rollout_correction``, its ``docs/algo/rollout_corr.md``):
importance weights between the policy being trained and the one that generated the data
(``rollout_is``: per token or per sequence, truncated at ``rollout_is_threshold``, or zeroed
outside ``"lower_upper"`` (IcePop), optionally normalised to mean 1 over the mini-batch),
rejection of tokens or sequences whose divergence estimate is out of bounds (``rollout_rs``,
e.g. ``token_k1``, ``seq_mean_k3``, several joined by commas), and the training-inference
mismatch figures verl logs as ``rollout_corr/*``.

Why it matters here more than in verl: every streamed record is off-policy by its staleness,
and the rollout engine never computes exactly the learner's log-probs. Two modes, as verl's:

- **decoupled** (``bypass_mode: false``): the learner recomputes the log-probs of the policy at
  the mini-batch's start (``pi_old``, as ``learner.decoupled`` does), the loss clips around it,
  and the weights ``pi_old / pi_rollout`` multiply the per-token loss;
- **bypass** (``bypass_mode: true``): no recomputation; the behaviour log-probs stand in for
  ``pi_old``, and ``loss_type`` is ``ppo_clip`` (the ratio already is the weight: none is
  applied, the rejection mask is) or ``reinforce`` (``-w A log pi``, ``w`` from the live
  ``pi / pi_rollout``, no gradient through it).

One function per ``rollout_is`` level (``IS_LEVELS``) and per ``rollout_rs`` option
(``RS_OPTIONS``), from the maths of verl 0.9.1's ``rollout_corr_helper``;
``tests/learner/test_learner_parity_extra.py`` compares the weights, masks, metrics and both bypass
losses with verl's own functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from streamrl.learner.config import RolloutCorrectionConfig, parse_is_threshold, parse_rs

if TYPE_CHECKING:
    from streamrl.learner.losses import PolicyLoss

#: exp() bound of every log ratio, as verl's (exp(20) ~ 4.9e8)
SAFETY_BOUND = 20.0


def _msum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    values = torch.where(mask.bool(), values, torch.zeros_like(values))
    return values.sum() if axis is None else values.sum(axis)


def _mmean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    return _msum(values, mask, axis) / ((mask.sum() if axis is None else mask.sum(axis)) + 1e-8)


# -- importance weights ------------------------------------------------------------------------

#: a level: ``(log_ratio, mask) -> (raw weights [B, T] zero on padding, log ratio its metrics read)``
ISLevel = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
IS_LEVELS: dict[str, ISLevel] = {}


def _is_level(name: str) -> Callable[[ISLevel], ISLevel]:
    def register(fn: ISLevel) -> ISLevel:
        IS_LEVELS[name] = fn
        return fn
    return register


@_is_level("token")
def token_is(log_ratio: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's own ratio ``pi / pi_rollout`` (biased, low variance)."""
    return torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)) * mask, log_ratio


@_is_level("sequence")
def sequence_is(log_ratio: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequence's product of ratios on each of its tokens (unbiased, high variance)."""
    total = _msum(log_ratio, mask, -1).unsqueeze(-1)
    return torch.exp(total.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio) * mask, total


def is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, threshold: str | float,
               batch_normalize: bool = False, norm: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's ``compute_rollout_correction_weights``: the weights (no gradient, 0 on padding)
    and their ``rollout_is_*`` figures. ``batch_normalize``: divided by their mean over the
    tokens (``token``) or sequences (``sequence``) of what is passed, or by ``norm`` when given
    (a mean computed over a larger batch)."""
    upper, lower = parse_is_threshold(threshold)
    raw, for_metrics = IS_LEVELS[level](log_ratio, mask)
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    metrics = is_metrics(weights, raw, for_metrics, mask, level, upper, lower)
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = float(_mmean(((raw < lower) | (raw > upper)).float(), mask))
    weights = weights.detach()
    if batch_normalize:
        mean = is_weight_mean(weights, mask, level) if norm is None else norm
        if mean > 1e-8:
            weights = weights / mean
            metrics["rollout_is_batch_norm_factor"] = float(mean)
        else:
            metrics["rollout_is_batch_norm_factor"] = 1.0
    return weights, metrics


def is_weight_mean(weights: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """The batch normaliser: the mean weight over tokens (``token``) or sequences (``sequence``)."""
    if level == "token":
        return _mmean(weights, mask)
    seq = _mmean(weights, mask, -1)
    seqs = (mask.sum(-1) > 0).to(weights.dtype)
    return (seq * seqs).sum() / seqs.sum().clamp_min(1e-8)


def is_metrics(weights: torch.Tensor, raw: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor,
               level: str, upper: float, lower: float | None) -> dict[str, float]:
    """verl's ``compute_is_metrics`` (names without the ``rollout_corr/`` prefix)."""
    out: dict[str, float] = {}
    low = 1.0 / upper if lower is None else lower
    log_up, log_low = math.log(upper), math.log(low)
    valid = mask.bool()
    if level == "sequence":
        out["rollout_is_max"] = float(torch.exp(log_ratio.max().clamp(max=SAFETY_BOUND)))
        out["rollout_is_min"] = float(torch.exp(log_ratio.min()))
        out["rollout_is_mean"] = float(_mmean(weights, mask))
        out["rollout_is_ratio_fraction_high"] = float((log_ratio > log_up).float().mean())
        out["rollout_is_ratio_fraction_low"] = float((log_ratio < log_low).float().mean())
    else:
        out["rollout_is_mean"] = float(_mmean(weights, mask))
        out["rollout_is_ratio_fraction_high"] = float(_mmean((raw > upper).float(), mask))
        out["rollout_is_ratio_fraction_low"] = float(_mmean((raw < low).float(), mask))
        out["rollout_is_max"] = float(weights.masked_fill(~valid, float("-inf")).max())
        out["rollout_is_min"] = float(weights.masked_fill(~valid, float("inf")).min())
    bounded = weights.clamp(min=0.0, max=upper)
    mean = _mmean(bounded, mask)
    if mask.sum() > 1:
        out["rollout_is_std"] = float(torch.sqrt((_mmean(bounded.square(), mask) - mean.square()).clamp(min=0.0)))
    else:
        out["rollout_is_std"] = 0.0
    out["rollout_is_eff_sample_size"] = 1.0 / float(_mmean((bounded / (mean + 1e-8)).square(), mask))
    seq = _mmean(weights, mask, -1)
    out["rollout_is_seq_mean"] = float(seq.mean())
    out["rollout_is_seq_std"] = float(seq.std()) if seq.numel() > 1 else 0.0
    out["rollout_is_seq_max"] = float(seq.max())
    out["rollout_is_seq_min"] = float(seq.min())
    out["rollout_is_seq_max_deviation"] = float((seq - 1.0).abs().max())
    raw_seq = _mmean(raw, mask, -1)
    out["rollout_is_seq_fraction_high"] = float((raw_seq > upper).float().mean())
    out["rollout_is_seq_fraction_low"] = float((raw_seq < low).float().mean())
    return out


# -- rejection -----------------------------------------------------------------------------------

#: an option: ``(log_ratio, mask) -> (statistic per token [B, T], per sequence [B] or None)``
RSOption = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, "torch.Tensor | None"]]
RS_OPTIONS: dict[str, RSOption] = {}


def _k(log_ratio: torch.Tensor, k: str) -> torch.Tensor:
    """Schulman's estimators of KL(pi_rollout || pi) per token: k1 ``-log r``, k2 ``(log r)^2 / 2``,
    k3 ``r - 1 - log r`` (``r = pi / pi_rollout``)."""
    lr = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {"k1": -lr, "k2": 0.5 * lr ** 2, "k3": torch.exp(lr) - 1.0 - lr}[k]


def _seq_max(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    top = values.masked_fill(~mask.bool(), float("-inf")).max(-1).values
    return torch.where(top == float("-inf"), torch.zeros_like(top), top)


def _rs_option(name: str, k: str, reduce: str | None) -> None:
    def option(log_ratio: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        stat = _k(log_ratio, k)
        if reduce is None:
            return stat, None
        seq = {"sum": lambda: _msum(stat, mask, -1), "mean": lambda: _mmean(stat, mask, -1),
               "max": lambda: _seq_max(stat, mask)}[reduce]()
        return seq.unsqueeze(-1).expand_as(mask), seq

    option.__name__ = option.__qualname__ = f"rs_{name}"
    option.__doc__ = (f"``{k}`` per token" if reduce is None else f"the {reduce} of ``{k}`` over the sequence's tokens, "
                      "on each of them")
    RS_OPTIONS[name] = option


for _k_name in ("k1", "k2", "k3"):  # (in config.RS_OPTION_NAMES's order)
    _rs_option(f"token_{_k_name}", _k_name, None)
    _rs_option(f"seq_sum_{_k_name}", _k_name, "sum")
    _rs_option(f"seq_mean_{_k_name}", _k_name, "mean")
for _k_name in ("k2", "k3"):
    _rs_option(f"seq_max_{_k_name}", _k_name, "max")


def rejection_mask(log_ratio: torch.Tensor, mask: torch.Tensor, options: str,
                   threshold: str | float | None) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's ``compute_rollout_rejection_mask``: ``mask`` with the tokens (token options) or
    whole sequences (``seq_*``) whose statistic is out of bounds set to 0 (every option must
    pass), and the ``rollout_rs_*`` figures. k1's bounds are on ``log`` of the ratio bounds."""
    combined = torch.ones_like(mask, dtype=log_ratio.dtype)
    valid, seq_valid = mask.bool(), mask.sum(-1) > 0
    metrics: dict[str, float] = {}
    for name, (low, up) in parse_rs(options, threshold).items():
        stat, seq = RS_OPTIONS[name](log_ratio, mask)
        k1 = name.endswith("k1")
        hi = math.log(up) if k1 else up
        lo = math.log(low) if k1 and low is not None else 0.0
        judged = stat if seq is None else seq
        keep = judged <= hi
        if k1:
            keep = keep & (judged >= lo)
        keep = keep if seq is None else keep.unsqueeze(-1).expand_as(valid)
        keep_f = keep.to(log_ratio.dtype)
        combined = combined * keep_f
        metrics.update(rs_metrics(name, stat, mask, seq_valid, seq, hi, lo, k1))
        metrics[f"rollout_rs_{name}_masked_fraction"] = float(_mmean(1 - keep_f, mask))
        seq_keep = (~((~keep) & valid)).all(-1)
        n_seq = seq_valid.float().sum()
        metrics[f"rollout_rs_{name}_seq_masked_fraction"] = (
            float(((1.0 - seq_keep.to(log_ratio.dtype)) * seq_valid.float()).sum() / n_seq) if n_seq > 0 else 0.0)
    metrics["rollout_rs_masked_fraction"] = float(_mmean(1 - combined, mask))
    kept = (combined > 0.5) & valid
    metrics["rollout_rs_seq_masked_fraction"] = float((~kept & valid).any(-1).float().mean())
    return (mask * combined).to(mask.dtype), metrics


def rs_metrics(name: str, stat: torch.Tensor, mask: torch.Tensor, seq_valid: torch.Tensor,
               per_seq: torch.Tensor | None, upper: float, lower: float, k1: bool) -> dict[str, float]:
    """verl's ``compute_rs_metrics`` for one option."""
    p = f"rollout_rs_{name}"
    valid = mask.bool()
    seq = (per_seq if per_seq is not None else _mmean(stat, mask, -1))[seq_valid]
    sequence_level = per_seq is not None and seq.numel() > 0
    out = {f"{p}_mean": float(_mmean(stat, mask))}
    if sequence_level:
        out[f"{p}_max"], out[f"{p}_min"] = float(seq.max()), float(seq.min())
        out[f"{p}_fraction_high"] = float((seq > upper).float().mean())
        out[f"{p}_fraction_low"] = float((seq < lower).float().mean()) if k1 else 0.0
    else:
        out[f"{p}_max"] = float(stat.masked_fill(~valid, float("-inf")).max())
        out[f"{p}_min"] = float(stat.masked_fill(~valid, float("inf")).min())
        out[f"{p}_fraction_high"] = float(_mmean((stat > upper).float(), mask))
        out[f"{p}_fraction_low"] = float(_mmean((stat < lower).float(), mask)) if k1 else 0.0
    if mask.sum() > 1:
        bounded = stat.clamp(min=lower if k1 else 0.0, max=upper)
        mean = _mmean(bounded, mask)
        out[f"{p}_std"] = float(torch.sqrt((_mmean(bounded.square(), mask) - mean.square()).clamp(min=0.0)))
    else:
        out[f"{p}_std"] = 0.0
    if seq.numel() > 0:
        out.update({f"{p}_seq_mean": float(seq.mean()), f"{p}_seq_std": float(seq.std()) if seq.numel() > 1 else 0.0,
                    f"{p}_seq_max": float(seq.max()), f"{p}_seq_min": float(seq.min()),
                    f"{p}_seq_max_deviation": float(seq.abs().max()),
                    f"{p}_seq_fraction_high": float((seq > upper).float().mean())})
        if k1:
            out[f"{p}_seq_fraction_low"] = float((seq < lower).float().mean())
    else:
        out.update({f"{p}_seq_{s}": 0.0 for s in ("mean", "std", "max", "min", "max_deviation", "fraction_high",
                                                  "fraction_low")})
    return out


# -- the mismatch figures ------------------------------------------------------------------------

def offpolicy_metrics(logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """verl's ``compute_offpolicy_metrics``: KL (k1, k3), perplexities, chi-squared, of the
    training policy's log-probs against the rollout's."""
    seq_train = _mmean(logp, mask, -1)
    seq_roll = _mmean(rollout_logp, mask, -1)
    log_ratio = logp - rollout_logp
    diff = seq_roll - seq_train
    safe = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    seq_sum = _msum(log_ratio, mask, -1).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    return {"training_ppl": float(torch.exp(-seq_train).mean()), "training_log_ppl": float((-seq_train).mean()),
            "kl": float(_mmean(rollout_logp - logp, mask)),
            "k3_kl": float(_mmean(torch.exp(log_ratio) - log_ratio - 1, mask)),
            "rollout_ppl": float(torch.exp(-seq_roll).mean()), "rollout_log_ppl": float((-seq_roll).mean()),
            "log_ppl_diff": float(diff.mean()), "log_ppl_abs_diff": float(diff.abs().mean()),
            "log_ppl_diff_max": float(diff.max()), "log_ppl_diff_min": float(diff.min()),
            "ppl_ratio": float(torch.exp(diff).mean()),
            "chi2_token": float(_mmean(torch.exp(safe).square(), mask) - 1.0),
            "chi2_seq": float(torch.exp(2.0 * seq_sum).mean() - 1.0)}


@dataclass
class Correction:
    """What a mini-batch trains with: the weights (None without ``rollout_is``), the mask
    (rejected tokens 0) and the ``rollout_corr/*`` figures."""

    weights: torch.Tensor | None
    mask: torch.Tensor
    metrics: dict[str, float]


def correct(logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
            cfg: RolloutCorrectionConfig, is_norm: torch.Tensor | None = None) -> Correction:
    """verl's ``compute_rollout_correction_and_rejection_mask`` on ``[B, T]`` tensors: ``logp``
    the training policy's (no gradient), ``rollout_logp`` the behaviour policy's."""
    log_ratio = (logp - rollout_logp).detach()
    metrics: dict[str, float] = {}
    weights = None
    if cfg.rollout_is:
        weights, m = is_weights(log_ratio, mask, cfg.rollout_is, cfg.rollout_is_threshold,
                                cfg.rollout_is_batch_normalize, is_norm)
        metrics.update(m)
    out_mask = mask.clone()
    if cfg.rollout_rs:
        out_mask, m = rejection_mask(log_ratio, mask, cfg.rollout_rs, cfg.rollout_rs_threshold)
        metrics.update(m)
    metrics.update(offpolicy_metrics(logp.detach(), rollout_logp, mask))
    return Correction(weights, out_mask, {f"rollout_corr/{k}": v for k, v in metrics.items()})


def bypass_loss(rollout_logp: torch.Tensor, logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                cfg: RolloutCorrectionConfig, clip_low: float = 0.2, clip_high: float = 0.2,
                clip_c: float = 3.0, is_norm: torch.Tensor | None = None) -> tuple["PolicyLoss", torch.Tensor]:
    """verl's ``bypass_mode`` loss per token, and the mask to aggregate it with (rejected tokens
    0). The weights and the rejection are of the live ``pi / pi_rollout`` (no gradient):
    ``ppo_clip`` is PPO-clip with ``pi_rollout`` as the old policy and no weight (the ratio is
    it); ``reinforce`` is ``-w A log pi``. ``is_norm``: the batch normaliser, the mini-batch's
    (``rollout_is_batch_normalize``; without it, this call's tensors')."""
    from streamrl.learner import losses

    with torch.no_grad():
        corr = correct(logp.detach(), rollout_logp, mask, cfg, is_norm)
    if cfg.loss_type == "reinforce":
        w = corr.weights if corr.weights is not None else torch.ones_like(logp)
        return losses.PolicyLoss(loss=-advantages * logp * w, clipped=torch.zeros_like(logp),
                                 approx_kl=(rollout_logp - logp).detach(), is_weight=w), corr.mask
    return losses.ppo_clip_loss(rollout_logp, logp, advantages, clip_low=clip_low, clip_high=clip_high,
                                clip_c=clip_c), corr.mask
