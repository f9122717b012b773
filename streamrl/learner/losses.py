"""The objective, as pure tensor functions: advantages, the PPO-clip policy loss (plain or
decoupled), KL to a reference, entropy, and verl's loss aggregation.

Shapes: per-token tensors are ``[batch, response_len]`` with a 0/1 ``mask`` of the same shape
(padding and tokens the policy did not produce, e.g. tool output in multi-turn, are 0).
Formulas follow verl's ``core_algos`` (``compute_grpo_outcome_advantage``,
``compute_policy_loss`` with dual-clip, ``kl_penalty``, ``agg_loss``) and AReaL's decoupled PPO
loss, so results compare with theirs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

#: log-ratio clamp before exp(), as verl does, so one wild token cannot overflow.
_LOG_RATIO_CLAMP = 20.0


def grpo_advantages(rewards: torch.Tensor, group_ids: Sequence[str], *, norm_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """One advantage per sequence: ``(r - mean_group) / (std_group + eps)``. The std is the
    unbiased one (``torch.std``) as in verl; a group of one has mean 0 and std 1 there, so its
    advantage is its reward (kept for parity)."""
    rewards = rewards.float()
    out = torch.empty_like(rewards)
    index: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        index.setdefault(g, []).append(i)
    for members in index.values():
        r = rewards[members]
        if len(members) == 1:
            mean, std = torch.tensor(0.0), torch.tensor(1.0)
        else:
            mean, std = r.mean(), r.std()
        out[members] = (r - mean) / (std + eps) if norm_by_std else r - mean
    return out


def whitened_advantages(rewards: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Critic-free PPO advantages: rewards whitened over the mini-batch (verl's
    REINFORCE++ baseline); what ``algorithm: ppo`` trains on."""
    rewards = rewards.float()
    if rewards.numel() < 2:
        return rewards - rewards.mean()
    return (rewards - rewards.mean()) / (rewards.std() + eps)


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, *,
              total_tokens: float | None = None, total_seqs: float | None = None) -> torch.Tensor:
    """verl's ``agg_loss``. ``token-mean``: every token of the mini-batch weighs the same (long
    responses weigh more). ``seq-mean-token-mean``: each sequence's token mean, then the mean
    over sequences (every sequence weighs the same). ``total_tokens`` / ``total_seqs`` are the
    mini-batch's totals when ``values`` is one micro-batch of it, so accumulated gradients equal
    the whole mini-batch's."""
    mask = mask.to(values.dtype)
    if mode == "token-mean":
        denom = total_tokens if total_tokens is not None else mask.sum().clamp(min=1.0)
        return (values * mask).sum() / denom
    if mode == "seq-mean-token-mean":
        per_seq_tokens = mask.sum(-1)
        seq_mean = (values * mask).sum(-1) / per_seq_tokens.clamp(min=1.0)
        denom = total_seqs if total_seqs is not None else (per_seq_tokens > 0).sum().clamp(min=1)
        return seq_mean.sum() / denom
    raise ValueError(f"loss_agg_mode {mode!r}: token-mean or seq-mean-token-mean")


@dataclass
class PolicyLoss:
    """Per-token policy loss and what the metrics report about it (each ``[B, T]``)."""

    loss: torch.Tensor  # per token, before aggregation
    clipped: torch.Tensor  # 1 where the clip (or dual clip) decided the token's loss
    approx_kl: torch.Tensor  # log pi_old - log pi (verl's ppo_kl per token)
    is_weight: torch.Tensor  # the importance weight applied (1 without the decoupled objective)


def ppo_clip_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, *,
                  clip_low: float = 0.2, clip_high: float = 0.2, clip_c: float = 3.0,
                  is_weight: torch.Tensor | None = None) -> PolicyLoss:
    """PPO-clip with verl's dual clip. ``ratio = pi/pi_old``; the loss per token is
    ``max(-A r, -A clip(r, 1-low, 1+high))``, and for ``A < 0`` at most ``-A c`` (dual clip,
    ``clip_c > 1``; 0 turns it off), which truncates the ratio of stale data whose
    probability grew far past the old one. ``is_weight`` multiplies the per-token loss (the
    decoupled objective's behaviour correction); it carries no gradient."""
    advantages = advantages if advantages.dim() == logp.dim() else advantages.unsqueeze(-1)
    log_ratio = (logp - old_logp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    clipped_loss = torch.maximum(loss1, loss2)
    clipped = (loss2 > loss1).float()
    if clip_c:
        loss3 = -advantages * clip_c
        dual = torch.minimum(loss3, clipped_loss)
        clipped = torch.where((advantages < 0) & (loss3 < clipped_loss), torch.ones_like(clipped), clipped)
        clipped_loss = torch.where(advantages < 0, dual, clipped_loss)
    weight = torch.ones_like(logp) if is_weight is None else is_weight.detach()
    return PolicyLoss(loss=clipped_loss * weight, clipped=clipped, approx_kl=-log_ratio.detach(),
                      is_weight=weight)


def importance_weight(prox_logp: torch.Tensor, behav_logp: torch.Tensor, mask: torch.Tensor, *,
                      cap: float, mode: str = "truncate") -> tuple[torch.Tensor, torch.Tensor]:
    """``w = pi_prox / pi_behaviour`` per token and the mask to train with. ``truncate``:
    ``min(w, cap)`` (verl's truncated IS); ``mask``: tokens with ``w > cap`` are left out
    (AReaL's ``behav_imp_weight_cap``)."""
    w = torch.exp((prox_logp - behav_logp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)).detach()
    if mode == "truncate":
        return w.clamp(max=cap), mask
    if mode == "mask":
        keep = (w <= cap).to(mask.dtype)
        return w * keep, mask * keep
    raise ValueError(f"is_mode {mode!r}: truncate or mask")


def decoupled_ppo_loss(logp: torch.Tensor, prox_logp: torch.Tensor, behav_logp: torch.Tensor,
                       advantages: torch.Tensor, mask: torch.Tensor, *, cap: float,
                       mode: str = "truncate", clip_low: float = 0.2, clip_high: float = 0.2,
                       clip_c: float = 3.0) -> tuple[PolicyLoss, torch.Tensor]:
    """AReaL's decoupled PPO: the trust region is around the proximal policy (``prox_logp``,
    recent weights), and the behaviour policy that generated the data (``behav_logp``, maybe
    several versions old) enters only through the truncated weight ``pi_prox/pi_behaviour``.
    Returns the loss and the mask to aggregate with. With ``prox == behav`` it is PPO-clip."""
    weight, mask = importance_weight(prox_logp, behav_logp, mask, cap=cap, mode=mode)
    loss = ppo_clip_loss(logp, prox_logp, advantages, clip_low=clip_low, clip_high=clip_high,
                         clip_c=clip_c, is_weight=weight)
    return loss, mask


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL estimate of the policy from the reference (verl's ``kl_penalty``):
    ``kl`` is k1 (``log pi - log ref``); ``low_var_kl`` is k3 (``exp(ref-pi) - (ref-pi) - 1``,
    non-negative, clamped to [-10, 10] as verl does)."""
    if kind == "kl":
        return logp - ref_logp
    if kind == "low_var_kl":
        kl = (ref_logp - logp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        return (torch.exp(kl) - kl - 1).clamp(-10.0, 10.0)
    raise ValueError(f"kl_loss_type {kind!r}: low_var_kl or kl")


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the last axis, per position."""
    logz = torch.logsumexp(logits, dim=-1)
    return logz - (torch.softmax(logits, dim=-1) * logits).sum(-1)
