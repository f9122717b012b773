"""The objective, as pure tensor functions, behind verl's names: advantage estimators
(verl's ``algorithm.adv_estimator``), policy losses (verl's ``policy_loss.loss_mode``), the loss
aggregation modes, KL estimators, entropy, and AReaL's decoupled objective.

Estimators and losses sit in registries as verl's ``core_algos`` has them: ``register_adv_est``
/ ``get_adv_estimator_fn`` and ``register_policy_loss`` / ``get_policy_loss_fn`` (a name taken
twice is refused; an unknown one names the known ones). A policy loss takes verl's argument
order, ``(old_log_prob, log_prob, advantages, response_mask, options)``, so one ported from
verl keeps its signature.

Shapes: per-token tensors are ``[batch, response_len]`` with a 0/1 ``mask`` of the same shape
(padding and tokens the policy did not produce, e.g. tool output in multi-turn, are 0). An
estimator takes token-level rewards (the score on each response's last token, minus a KL
penalty on every token with ``use_kl_in_reward``) as verl's do, and returns per-token
advantages. Each function is written from the maths of verl's ``core_algos`` (verl 0.9.1);
``tests/learner/test_learner_parity.py`` holds the numbers verl's own functions give on the same
tensors, and these must match them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence, TypeVar

import torch

from streamrl.learner.objective_names import FIXED_AGG_MODES, KL_TYPES, LOSS_AGG_MODES

#: log-ratio clamp before exp(), as verl does, so one wild token cannot overflow.
_LOG_RATIO_CLAMP = 20.0


# -- advantage estimators --------------------------------------------------------------------

#: An estimator: ``(token_rewards [B, T], mask [B, T], group ids, options) -> advantages [B, T]``.
Estimator = Callable[[torch.Tensor, torch.Tensor, Sequence[str], "AdvantageOptions"], torch.Tensor]
#: name -> estimator (``register_adv_est``; verl's ``ADV_ESTIMATOR_REGISTRY``)
ADV_ESTIMATORS: dict[str, Estimator] = {}

_Entry = TypeVar("_Entry", bound=Callable)


def _register(registry: dict[str, _Entry], kind: str, name: str, fn: _Entry) -> _Entry:
    """``fn`` under ``name``; a name taken by another function is refused (the second would
    silently replace the first)."""
    taken = registry.get(name)
    if taken is not None and taken is not fn:
        raise ValueError(f"{kind} {name!r} is registered already ({taken.__module__}.{taken.__qualname__}); "
                         "choose another name")
    registry[name] = fn
    return fn


def _lookup(registry: dict[str, _Entry], kind: str, name: str) -> _Entry:
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}: one of {', '.join(sorted(registry))}")
    return registry[name]


def register_adv_est(name: str) -> Callable[[Estimator], Estimator]:
    """Decorator: the estimator under ``name`` (``learner.adv_estimator``). Refuses a name taken."""
    def register(fn: Estimator) -> Estimator:
        return _register(ADV_ESTIMATORS, "advantage estimator", name, fn)
    return register


def get_adv_estimator_fn(name: str) -> Estimator:
    """The estimator registered as ``name``; ``ValueError`` naming the known ones otherwise."""
    return _lookup(ADV_ESTIMATORS, "advantage estimator", name)


@dataclass
class AdvantageOptions:
    norm_adv_by_std_in_grpo: bool = True
    gamma: float = 1.0  # REINFORCE++'s discount
    eps: float = 1e-6
    # GDPO: each sample's reward components [B, K] (``gdpo_reward_keys`` read from reward_info)
    # and their weights (empty: 1 each); None: the reward alone
    reward_components: torch.Tensor | None = None
    gdpo_reward_weights: Sequence[float] = ()
    # ReMax: each sample's baseline [B], the reward of its group's greedy response
    reward_baselines: torch.Tensor | None = None
    # GAE: the critic's values [B, T] at the update, and lambda (verl's algorithm.lam)
    values: torch.Tensor | None = None
    lam: float = 1.0


def _groups(group_ids: Sequence[str]) -> list[list[int]]:
    index: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        index.setdefault(g, []).append(i)
    return list(index.values())


def _per_token(per_seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return per_seq.unsqueeze(-1) * mask


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (values * mask).sum() / (mask.sum() + 1e-8)


def masked_whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Whiten over the masked entries: mean 0, the unbiased variance 1 (verl's)."""
    mean = _masked_mean(values, mask)
    n = mask.sum()
    if n < 2:
        raise ValueError("whitening needs at least two unmasked tokens in the mini-batch")
    var = _masked_mean((values - mean) ** 2, mask) * n / (n - 1)
    return (values - mean) * torch.rsqrt(var + 1e-8)


@register_adv_est("grpo")
def grpo_estimator(rewards: torch.Tensor, mask: torch.Tensor, group_ids: Sequence[str],
                   opt: AdvantageOptions) -> torch.Tensor:
    """``(r - mean_group) / (std_group + eps)`` (Dr. GRPO without the std)."""
    return _per_token(grpo_advantages(rewards.sum(-1), group_ids, norm_by_std=opt.norm_adv_by_std_in_grpo,
                                      eps=opt.eps), mask)


@register_adv_est("rloo")
def rloo_estimator(rewards: torch.Tensor, mask: torch.Tensor, group_ids: Sequence[str],
                   opt: AdvantageOptions) -> torch.Tensor:
    """Leave-one-out baseline: ``r_i - mean_{j != i} r_j`` (a group of one keeps its reward)."""
    scores = rewards.sum(-1)
    out = scores.clone()
    for members in _groups(group_ids):
        n = len(members)
        if n > 1:
            r = scores[members]
            out[members] = (r * n - r.sum()) / (n - 1)
    return _per_token(out, mask)


@register_adv_est("opo")
def opo_estimator(rewards: torch.Tensor, mask: torch.Tensor, group_ids: Sequence[str],
                  opt: AdvantageOptions) -> torch.Tensor:
    """The length-weighted group baseline of OPO: ``r_i - sum_j(|y_j| r_j) / sum_j |y_j|``."""
    scores, lengths = rewards.sum(-1), mask.sum(-1)
    out = scores.clone()
    for members in _groups(group_ids):
        if len(members) > 1:
            out[members] = scores[members] - (lengths[members] * scores[members]).sum() / lengths[members].sum()
    return _per_token(out, mask)


@register_adv_est("grpo_passk")
def grpo_passk_estimator(rewards: torch.Tensor, mask: torch.Tensor, group_ids: Sequence[str],
                         opt: AdvantageOptions) -> torch.Tensor:
    """Pass@k: only the group's best response learns, by ``r_max - r_second`` (over the group's
    std with ``norm_adv_by_std_in_grpo``); the rest get 0. Ties go to the first best."""
    scores = rewards.sum(-1)
    out = torch.zeros_like(scores)
    for members in _groups(group_ids):
        if len(members) < 2:
            raise ValueError(f"grpo_passk needs at least 2 samples a group (group {group_ids[members[0]]!r} has 1)")
        r = scores[members]
        top, where = torch.topk(r, 2)
        adv = top[0] - top[1]
        if opt.norm_adv_by_std_in_grpo:
            adv = adv / (r.std() + opt.eps)
        out[members[int(where[0])]] = adv
    return _per_token(out, mask)


@register_adv_est("gpg")
def gpg_estimator(rewards: torch.Tensor, mask: torch.Tensor, group_ids: Sequence[str],
                  opt: AdvantageOptions) -> torch.Tensor:
    """GPG: ``alpha (r - mean_group)`` with ``alpha = B / #(r != 0)``, no std."""
    scores = rewards.sum(-1)
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)
    out = torch.empty_like(scores)
    for members in _groups(group_ids):
        r = scores[members]
        out[members] = alpha * (r - (r.mean() if len(members) > 1 else 0.0))
    return _per_token(out, mask)


@register_adv_est("reinforce_plus_plus")
def reinforce_pp_estimator(rewards: torch.Tensor, mask: torch.Tensor, group_ids: Sequence[str],
                           opt: AdvantageOptions) -> torch.Tensor:
    """REINFORCE++: discounted returns per token (a masked token passes the return through),
    whitened over every token of the mini-batch."""
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        new = rewards[:, t] + opt.gamma * running
        returns[:, t] = new * mask[:, t]
        running = new * mask[:, t] + running * (1 - mask[:, t])
    return masked_whiten(returns, mask) * mask


@register_adv_est("reinforce_plus_plus_baseline")
def reinforce_pp_baseline_estimator(rewards: torch.Tensor, mask: torch.Tensor, group_ids: Sequence[str],
                                    opt: AdvantageOptions) -> torch.Tensor:
    """REINFORCE++ with the group mean as baseline, then whitened over the mini-batch's tokens."""
    scores = rewards.sum(-1)
    out = scores.clone()
    for members in _groups(group_ids):
        if len(members) > 1:
            out[members] = scores[members] - scores[members].mean()
    return masked_whiten(_per_token(out, mask), mask) * mask


def grpo_advantages(rewards: torch.Tensor, group_ids: Sequence[str], *, norm_by_std: bool = True,
                    eps: float = 1e-6) -> torch.Tensor:
    """One advantage per sequence: ``(r - mean_group) / (std_group + eps)``. The std is the
    unbiased one (``torch.std``) as in verl; a group of one has mean 0 and std 1 there, so its
    advantage is its reward (kept for parity)."""
    out = torch.empty_like(rewards)
    for members in _groups(group_ids):
        r = rewards[members]
        if len(members) == 1:
            mean, std = torch.zeros((), dtype=r.dtype), torch.ones((), dtype=r.dtype)
        else:
            mean, std = r.mean(), r.std()
        out[members] = (r - mean) / (std + eps) if norm_by_std else r - mean
    return out


def whitened_advantages(rewards: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Critic-free PPO advantages: rewards whitened over the mini-batch, one per sequence
    (``adv_estimator: ppo``, streamrl's own: verl's REINFORCE++ whitens per token)."""
    rewards = rewards.float()
    if rewards.numel() < 2:
        return rewards - rewards.mean()
    return (rewards - rewards.mean()) / (rewards.std() + eps)


@register_adv_est("gdpo")
def gdpo_estimator(rewards: torch.Tensor, mask: torch.Tensor, group_ids: Sequence[str],
                   opt: AdvantageOptions) -> torch.Tensor:
    """GDPO: each reward component normalised within its group on its own (GRPO's advantage per
    component, so a dominant one cannot drown the others), their weighted sum, whitened over the
    mini-batch's tokens."""
    if opt.reward_components is not None:  # read in fp32, as verl reads them from the batch
        comps = opt.reward_components.to(device=rewards.device, dtype=torch.float32)
    else:
        comps = rewards.sum(-1, keepdim=True)
    weights = torch.tensor(list(opt.gdpo_reward_weights) or [1.0] * comps.shape[1], dtype=torch.float32)
    total = torch.zeros(comps.shape[0], dtype=comps.dtype, device=rewards.device)
    for k in range(comps.shape[1]):
        total = total + weights[k].to(comps.dtype) * grpo_advantages(
            comps[:, k], group_ids, norm_by_std=opt.norm_adv_by_std_in_grpo, eps=opt.eps)
    return masked_whiten(_per_token(total, mask), mask) * mask


@register_adv_est("remax")
def remax_estimator(rewards: torch.Tensor, mask: torch.Tensor, group_ids: Sequence[str],
                    opt: AdvantageOptions) -> torch.Tensor:
    """ReMax: the return to go less the reward of the group's greedy response (the baseline, a
    record of its own that is never trained on)."""
    if opt.reward_baselines is None:
        raise ValueError("remax needs each sample's baseline (the group's greedy response's reward)")
    returns = (rewards * mask).flip(-1).cumsum(-1).flip(-1)
    return returns - opt.reward_baselines.to(device=rewards.device, dtype=rewards.dtype).unsqueeze(-1) * mask


def gae_advantages_returns(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
                           lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (verl's ``compute_gae_advantage_return``): TD errors
    ``r_t + gamma V_{t+1} - V_t`` summed back with ``gamma lam``, skipping tokens the policy did
    not produce (their value and TD error are carried over); returns are advantages + values
    (the critic's targets); the advantages are then whitened over the mini-batch's tokens."""
    with torch.no_grad():
        next_value = torch.zeros_like(values[:, 0])
        last = torch.zeros_like(values[:, 0])
        out = []
        for t in reversed(range(rewards.shape[-1])):
            delta = rewards[:, t] + gamma * next_value - values[:, t]
            running = delta + gamma * lam * last
            next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
            last = running * mask[:, t] + (1 - mask[:, t]) * last
            out.append(last)
        advantages = torch.stack(out[::-1], dim=1)
        returns = advantages + values
        return masked_whiten(advantages, mask), returns


@register_adv_est("gae")
def gae_estimator(rewards: torch.Tensor, mask: torch.Tensor, group_ids: Sequence[str],
                  opt: AdvantageOptions) -> torch.Tensor:
    """PPO's estimator with a critic: GAE on the critic's values at the update (``opt.values``)."""
    if opt.values is None:
        raise ValueError("gae needs the critic's values")
    return gae_advantages_returns(rewards, opt.values.to(rewards.dtype), mask, opt.gamma, opt.lam)[0]


def value_loss(vpreds: torch.Tensor, returns: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
               cliprange_value: float, mode: str = "token-mean", **totals) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's ``compute_value_loss``: half the larger of the squared errors of the prediction and
    of the prediction clipped to ``values +- cliprange_value`` (the values at the update),
    aggregated by ``mode`` (``totals``: the mini-batch's, as ``aggregate`` takes them); and the
    tokens where the clipped one was larger (``vf_clipfrac``)."""
    clipped = torch.maximum(torch.minimum(vpreds, values + cliprange_value), values - cliprange_value)
    loss1, loss2 = (vpreds - returns) ** 2, (clipped - returns) ** 2
    return 0.5 * aggregate(torch.maximum(loss1, loss2), mask, mode, **totals), (loss2 > loss1).float()


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """verl's ``critic/vf_explained_var``: ``1 - var(returns - values) / var(returns)`` over the
    trained tokens."""
    keep = mask > 0
    v, r = values[keep], returns[keep]
    if r.numel() < 2:
        return float("nan")
    return float(1.0 - torch.var(r - v) / (torch.var(r) + 1e-5))


@register_adv_est("ppo")
def ppo_estimator(rewards: torch.Tensor, mask: torch.Tensor, group_ids: Sequence[str],
                  opt: AdvantageOptions) -> torch.Tensor:
    return _per_token(whitened_advantages(rewards.sum(-1)).to(rewards.dtype), mask)


def token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each score on its response's last token (verl's ``token_level_scores``)."""
    out = torch.zeros_like(mask, dtype=scores.dtype)
    lengths = (mask.shape[1] - 1 - torch.flip(mask, [1]).argmax(1)).clamp(min=0)
    out[torch.arange(len(scores)), lengths] = scores
    return out


# -- aggregation -----------------------------------------------------------------------------



def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str, *,
              total_tokens: float | None = None, total_seqs: float | None = None,
              scale: float | None = None) -> torch.Tensor:
    """verl's ``agg_loss``. ``token-mean``: every token of the mini-batch weighs the same (long
    responses weigh more). ``seq-mean-token-mean``: each sequence's token mean, then the mean
    over sequences. ``token-sum``: the sum over tokens. ``seq-mean-token-sum``: each sequence's
    token sum, then the mean over sequences; ``-norm`` divides that by a constant (``scale``:
    Dr. GRPO's, the longest response a mini-batch may hold). ``total_tokens`` / ``total_seqs``
    are the mini-batch's totals when ``values`` is one micro-batch of it, so accumulated
    gradients equal the whole mini-batch's on any number of micro-batches and ranks."""
    mask = mask.to(values.dtype)
    masked = values * mask
    if mode == "token-mean":
        denom = total_tokens if total_tokens is not None else mask.sum().clamp(min=1.0)
        return masked.sum() / denom
    if mode == "token-sum":
        return masked.sum()
    per_seq_tokens = mask.sum(-1)
    seqs = total_seqs if total_seqs is not None else (per_seq_tokens > 0).sum().clamp(min=1)
    if mode == "seq-mean-token-mean":
        return (masked.sum(-1) / (per_seq_tokens + 1e-8)).sum() / seqs
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        loss = masked.sum(-1).sum() / seqs
        if mode == "seq-mean-token-sum-norm":
            loss = loss / (scale if scale else mask.shape[-1])
        return loss
    raise ValueError(f"loss_agg_mode {mode!r}: one of {', '.join(LOSS_AGG_MODES)}")


# -- policy losses ---------------------------------------------------------------------------

@dataclass
class PolicyLoss:
    """Per-token policy loss and what the metrics report about it (each ``[B, T]``)."""

    loss: torch.Tensor  # per token, before aggregation
    clipped: torch.Tensor  # 1 where the clip (or dual clip) decided the token's loss
    approx_kl: torch.Tensor  # log pi_old - log pi (verl's ppo_kl per token)
    is_weight: torch.Tensor  # the importance weight applied (1 without the decoupled objective)
    agg_mode: str | None = None  # a loss that fixes its aggregation (sapo, geo_mean), else the config's


@dataclass
class LossOptions:
    """The knobs of the losses, verl's names (``actor.*`` and ``actor.policy_loss.*``)."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0  # vanilla's dual clip (0: off); dppo's ratio truncation
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    gvpo_beta: float = 0.1  # GVPO: the KL coefficient scaling the policy's log-ratio (the recipe's gvpo_beta)
    gvpo_scale: float = 1.0  # GVPO: the sequences a micro-batch of the recipe sums (learner.micro_batch_size)

    @classmethod
    def from_config(cls, cfg: Any) -> "LossOptions":
        """The knobs of ``cfg``, a ``LearnerConfig`` (``learner.*`` and ``learner.policy_loss.*``;
        not imported: the config looks names up in this module's registries)."""
        pl = cfg.policy_loss
        return cls(clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high, clip_ratio_c=cfg.clip_ratio_c,
                   clip_cov_ratio=pl.clip_cov_ratio, clip_cov_lb=pl.clip_cov_lb, clip_cov_ub=pl.clip_cov_ub,
                   kl_cov_ratio=pl.kl_cov_ratio, ppo_kl_coef=pl.ppo_kl_coef, tau_pos=cfg.tau_pos, tau_neg=cfg.tau_neg,
                   gvpo_beta=pl.gvpo_beta, gvpo_scale=float(max(1, cfg.micro_batch_size)))


#: A loss: ``(old_log_prob, log_prob, advantages, response_mask, options) -> PolicyLoss`` (all
#: ``[B, T]``), verl's argument order.
Loss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, LossOptions], PolicyLoss]
#: name -> loss (``register_policy_loss``; verl's ``POLICY_LOSS_REGISTRY``)
POLICY_LOSSES: dict[str, Loss] = {}


def register_policy_loss(name: str, *, sequence_weight: bool = False,
                         group_baseline: bool = False) -> Callable[[Loss], Loss]:
    """Decorator: the loss under ``name`` (``learner.policy_loss.loss_mode``). Refuses a name
    taken. ``sequence_weight``: the decoupled objective's importance weight applies per sequence,
    the geometric mean of its tokens' (a sequence-level loss), not per token (``policy_loss``).
    ``group_baseline``: the loss also takes its rows' ``GroupBaseline`` (keyword ``baseline``),
    statistics of each group over the whole mini-batch at the current weights, which the trainer
    computes before each epoch across the ranks (GVPO's group mean of the log-ratios)."""
    def register(fn: Loss) -> Loss:
        fn.sequence_weight = sequence_weight  # type: ignore[attr-defined]
        fn.group_baseline = group_baseline  # type: ignore[attr-defined]
        return _register(POLICY_LOSSES, "policy loss", name, fn)
    return register


def needs_group_baseline(name: str) -> bool:
    """Whether the loss registered as ``name`` takes a ``GroupBaseline`` (``register_policy_loss``)."""
    return bool(getattr(get_policy_loss_fn(name), "group_baseline", False))


def get_policy_loss_fn(name: str) -> Loss:
    """The loss registered as ``name``; ``ValueError`` naming the known ones otherwise."""
    return _lookup(POLICY_LOSSES, "policy loss", name)


def _log_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    return (logp - old_logp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)


def _result(loss: torch.Tensor, clipped: torch.Tensor | None, log_ratio: torch.Tensor,
            agg_mode: str | None = None) -> PolicyLoss:
    return PolicyLoss(loss=loss, clipped=torch.zeros_like(loss) if clipped is None else clipped.float(),
                      approx_kl=-log_ratio.detach(), is_weight=torch.ones_like(loss), agg_mode=agg_mode)


@register_policy_loss("vanilla")
def vanilla_loss(old_logp: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                 opt: LossOptions) -> PolicyLoss:
    return ppo_clip_loss(old_logp, logp, adv, clip_low=opt.clip_ratio_low, clip_high=opt.clip_ratio_high,
                         clip_c=opt.clip_ratio_c)


@register_policy_loss("gspo")
def gspo_loss(old_logp: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
              opt: LossOptions) -> PolicyLoss:
    """GSPO: one importance ratio per sequence, the geometric mean of its tokens' ratios, with the
    gradient of each token's own log-prob; clipped as PPO (no dual clip). Aggregated by
    ``loss_agg_mode`` as verl 0.9.1's is (the paper's objective is seq-mean-token-mean; an older
    verl forced it): a config that leaves the default is told so at start."""
    log_ratio = logp - old_logp
    seq = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    ratio = torch.exp((logp - logp.detach() + seq.detach().unsqueeze(-1)).clamp(max=10.0))
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1 - opt.clip_ratio_low, 1 + opt.clip_ratio_high)
    return _result(torch.maximum(loss1, loss2), loss2 > loss1, log_ratio)


@register_policy_loss("cispo")
def cispo_loss(old_logp: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
               opt: LossOptions) -> PolicyLoss:
    """CISPO: REINFORCE weighted by the clipped ratio, which carries no gradient: a clipped token
    still learns."""
    log_ratio = _log_ratio(logp, old_logp)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1 - opt.clip_ratio_low, 1 + opt.clip_ratio_high)
    return _result(-clipped.detach() * adv * logp, ratio != clipped, log_ratio)


@register_policy_loss("gpg")
def gpg_loss(old_logp: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
             opt: LossOptions) -> PolicyLoss:
    """GPG: plain policy gradient, ``-A log pi``."""
    return _result(-logp * adv, None, logp - old_logp)


@register_policy_loss("sapo")
def sapo_loss(old_logp: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
              opt: LossOptions) -> PolicyLoss:
    """SAPO: a smooth gate ``sigmoid(tau (r - 1)) 4 / tau`` instead of the clip, ``tau_pos`` for
    positive advantages and ``tau_neg`` otherwise; always aggregated seq-mean-token-mean."""
    log_ratio = _log_ratio(logp, old_logp)
    tau = torch.where(adv > 0, torch.as_tensor(opt.tau_pos, dtype=adv.dtype),
                      torch.as_tensor(opt.tau_neg, dtype=adv.dtype))
    gate = torch.sigmoid(tau * (torch.exp(log_ratio) - 1.0)) * (4.0 / tau)
    return _result(-gate * adv, None, log_ratio, agg_mode=FIXED_AGG_MODES["sapo"])


@register_policy_loss("geo_mean", sequence_weight=True)
def geo_mean_loss(old_logp: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                  opt: LossOptions) -> PolicyLoss:
    """GMPO: per sequence, the geometric mean of the token ratios clipped in log space by the
    advantage's sign, times the sequence's mean advantage; the mean over sequences (each
    sequence's loss stands on its tokens, aggregated seq-mean-token-mean)."""
    log_ratio = logp - old_logp
    sign = torch.sign(adv)
    clamped = log_ratio.clamp(-opt.clip_ratio_low, opt.clip_ratio_high)
    kept = sign * torch.minimum(sign * log_ratio, sign * clamped)
    n = mask.sum(-1)
    ratio = torch.exp((kept * mask).sum(-1) / (n + 1e-8))
    seq_adv = (adv * mask).sum(-1) / (n + 1e-8)
    per_seq = -seq_adv * ratio
    return _result(per_seq.unsqueeze(-1).expand_as(logp), log_ratio != clamped, log_ratio,
                   agg_mode=FIXED_AGG_MODES["geo_mean"])


@register_policy_loss("clip_cov")
def clip_cov_loss(old_logp: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                  opt: LossOptions) -> PolicyLoss:
    """Clip-Cov: PPO-clip, plus the gradient cut on a random ``clip_cov_ratio`` of the unclipped
    tokens whose covariance of advantage and log-prob lies in ``(clip_cov_lb, clip_cov_ub)``
    (the tokens that collapse entropy)."""
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1 - opt.clip_ratio_low, 1 + opt.clip_ratio_high)
    valid = mask > 0
    cov = (adv - _masked_mean(adv, mask)) * (logp - _masked_mean(logp.detach(), mask))
    cov = cov.masked_fill(~valid | ((loss2 > loss1) & valid), -torch.inf)
    n_clip = max(int(opt.clip_cov_ratio * mask.sum().item()), 1)
    candidates = torch.nonzero((cov < opt.clip_cov_ub) & (cov > opt.clip_cov_lb) & valid)
    keep = torch.ones_like(adv)
    if len(candidates):
        chosen = candidates[torch.randperm(len(candidates))[:min(n_clip, len(candidates))]]
        keep[chosen[:, 0], chosen[:, 1]] = 0
    return _result(torch.maximum(loss1, loss2) * keep, keep == 0, log_ratio)


@register_policy_loss("kl_cov")
def kl_cov_loss(old_logp: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                opt: LossOptions) -> PolicyLoss:
    """KL-Cov: the unclipped policy gradient, plus ``ppo_kl_coef |log ratio|`` on the
    ``kl_cov_ratio`` of tokens with the largest covariance of advantage and log-prob."""
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    loss = -adv * ratio
    valid = mask > 0
    flat = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    a, lp = adv[valid].detach(), logp[valid].detach()
    penalised = torch.zeros_like(loss)
    if len(a) and opt.kl_cov_ratio:
        cov = (a - a.mean()) * (lp - lp.mean())
        top = flat[torch.topk(cov, max(1, int(len(cov) * opt.kl_cov_ratio))).indices]
        rows, cols = top // adv.shape[1], top % adv.shape[1]
        penalised[rows, cols] = 1.0
        loss = torch.where(penalised > 0, loss + opt.ppo_kl_coef * log_ratio.abs(), loss)
    return _result(loss, penalised, log_ratio)


def _dppo(old_logp: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, opt: LossOptions, valid_pos: torch.Tensor,
          valid_neg: torch.Tensor) -> PolicyLoss:
    log_ratio = _log_ratio(logp, old_logp)
    truncated = torch.exp(log_ratio).clamp(max=opt.clip_ratio_c or 20.0).detach()
    valid = torch.where(adv > 0, valid_pos, valid_neg).detach().float()
    return _result(-adv * truncated * logp * valid, 1.0 - valid, log_ratio)


@register_policy_loss("dppo_tv")
def dppo_tv_loss(old_logp: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                 opt: LossOptions) -> PolicyLoss:
    """DPPO with a total-variation trust region: a token learns (``-A r_trunc log pi``) while
    its probability moved less than ``clip_ratio_high`` up (A > 0) or ``clip_ratio_low`` down."""
    p, p_old = torch.exp(logp), torch.exp(old_logp)
    return _dppo(old_logp, logp, adv, opt, (p - p_old) <= opt.clip_ratio_high, (p - p_old) >= -opt.clip_ratio_low)


@register_policy_loss("dppo_kl")
def dppo_kl_loss(old_logp: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                 opt: LossOptions) -> PolicyLoss:
    """DPPO with a binary-KL trust region between the old and new token probabilities."""
    p, p_old = torch.exp(logp), torch.exp(old_logp)
    kl = p_old * (old_logp - logp) + (1 - p_old) * torch.log((1.0 - p_old + 1e-8) / (1.0 - p + 1e-8))
    return _dppo(old_logp, logp, adv, opt, (kl <= opt.clip_ratio_high) | (p <= p_old),
                 (kl <= opt.clip_ratio_low) | (p >= p_old))


@dataclass
class GroupBaseline:
    """What a group-relative sequence loss needs of each row's group beyond the row itself (each
    ``[B]``): ``mean``, the group's mean of ``beta (sum log pi - sum log pi_old)`` at the current
    weights, detached, over all of the group's members in the mini-batch (on every rank); and
    ``size``, how many members the group has there (0: a row of no group, the ranks' padding)."""

    mean: torch.Tensor
    size: torch.Tensor


def sequence_log_ratio(old_logp: torch.Tensor, logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each row's ``sum log pi - sum log pi_old`` over its trained tokens (``[B]``; unclamped: a
    sequence's log-ratio, not a per-token ratio that ``exp`` could overflow)."""
    return (logp * mask).sum(-1) - (old_logp * mask).sum(-1)


def group_baseline(values: torch.Tensor, group_ids: Sequence[str]) -> GroupBaseline:
    """Each row's group mean of ``values`` (``[B]``, detached) and its group's size."""
    values = values.detach()
    mean, size = torch.zeros_like(values), torch.zeros_like(values)
    for members in _groups(group_ids):
        mean[members] = values[members].mean()
        size[members] = float(len(members))
    return GroupBaseline(mean=mean, size=size)


def gvpo_sequence_losses(old_logp: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                         beta: float, baseline: GroupBaseline) -> torch.Tensor:
    """GVPO (Group Variance Policy Optimization, arXiv 2504.19599; verl-recipe's ``gvpo``), per
    sequence ``[B]``: half the squared gap between the policy's implicit reward measured from
    its group's mean, ``R_theta = beta log(pi / pi_old)`` summed over the sequence, less the
    group's mean of it (``baseline.mean``, no gradient), and the reward measured from its group's
    mean (the sequence's mean advantage: GRPO's estimator without the std), over ``n - 1`` for a
    group of ``n``. Its gradient is ``((R_theta - mean) - A) beta grad log pi``: no importance
    ratio, so no clip. A row of a group of one (or of none) has no group to be measured against:
    0, where the recipe would divide by zero."""
    r_theta = beta * sequence_log_ratio(old_logp, logp, mask)
    tokens = mask.sum(-1)
    target = (adv * mask).sum(-1) / tokens.clamp(min=1e-8)
    pairs = baseline.size > 1
    gap = (r_theta - baseline.mean.to(r_theta.dtype)) - target
    return torch.where(pairs, 0.5 * gap.square() / (baseline.size.to(gap.dtype) - 1).clamp(min=1), torch.zeros_like(gap))


@register_policy_loss("gvpo", group_baseline=True)
def gvpo_loss(old_logp: torch.Tensor, logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
              opt: LossOptions, baseline: GroupBaseline | None = None) -> PolicyLoss:
    """GVPO (``gvpo_sequence_losses``) as the recipe trains it: its function sums the losses of
    a micro-batch's sequences, its gradient accumulation divides by the micro-batches and FSDP by
    the ranks, so a step's loss is ``micro_batch_size / B`` times the sum over the mini-batch's
    ``B`` sequences; here each sequence's loss spread over its tokens, aggregated
    seq-mean-token-sum (``FIXED_AGG_MODES``) and scaled by ``opt.gvpo_scale``."""
    if baseline is None:
        raise ValueError("gvpo needs its rows' group baseline (the group means of the log-ratios)")
    per_seq = gvpo_sequence_losses(old_logp, logp, adv, mask, opt.gvpo_beta, baseline) * opt.gvpo_scale
    per_token = per_seq.unsqueeze(-1) * mask / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return _result(per_token, None, logp - old_logp, agg_mode=FIXED_AGG_MODES["gvpo"])


def ppo_clip_loss(old_logp: torch.Tensor, logp: torch.Tensor, advantages: torch.Tensor, *,
                  clip_low: float = 0.2, clip_high: float = 0.2, clip_c: float = 3.0,
                  is_weight: torch.Tensor | None = None) -> PolicyLoss:
    """PPO-clip with verl's dual clip (``loss_mode: vanilla``). ``ratio = pi/pi_old``; the loss
    per token is ``max(-A r, -A clip(r, 1-low, 1+high))``, and for ``A < 0`` at most ``-A c``
    (dual clip, ``clip_c > 1``; 0 turns it off), which truncates the ratio of stale data whose
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


def policy_loss(mode: str, old_logp: torch.Tensor, logp: torch.Tensor, advantages: torch.Tensor,
                mask: torch.Tensor, opt: LossOptions, is_weight: torch.Tensor | None = None,
                baseline: GroupBaseline | None = None) -> PolicyLoss:
    """The loss ``mode`` names, times the (decoupled objective's) importance weight per token;
    for a loss registered with ``sequence_weight`` (``geo_mean``), a sequence's weight is the
    geometric mean of its tokens'. A loss registered with ``group_baseline`` (``gvpo``) gets
    ``baseline`` and takes no importance weight (it has no ratio to weigh: refused)."""
    fn = get_policy_loss_fn(mode)
    if getattr(fn, "group_baseline", False):
        if is_weight is not None:
            raise ValueError(f"policy loss {mode!r} takes no importance weight (rollout correction, decoupled)")
        return fn(old_logp, logp, advantages, mask, opt, baseline=baseline)
    out = fn(old_logp, logp, advantages, mask, opt)
    if is_weight is not None:
        w = is_weight.detach()
        if getattr(fn, "sequence_weight", False):
            n = mask.sum(-1, keepdim=True)
            w = torch.exp((torch.log(w + 1e-10) * mask).sum(-1, keepdim=True) / (n + 1e-8)).expand_as(w)
        out.loss, out.is_weight = out.loss * w, w
    return out


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
    loss = ppo_clip_loss(prox_logp, logp, advantages, clip_low=clip_low, clip_high=clip_high,
                         clip_c=clip_c, is_weight=weight)
    return loss, mask


# -- KL --------------------------------------------------------------------------------------



def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL estimate of the policy from the reference (Schulman's estimators, verl's
    names): ``kl``/``k1`` ``log pi - log ref``; ``abs``; ``mse``/``k2`` half the squared log
    ratio; ``low_var_kl``/``k3`` ``exp(ref-pi) - (ref-pi) - 1`` (non-negative, clamped to
    [-10, 10] as verl does). A ``+`` suffix (``k3+``) keeps the value and takes k2's gradient,
    the unbiased one (straight-through)."""
    base = kind[:-1] if kind.endswith("+") else kind
    if base in ("kl", "k1"):
        value = logp - ref_logp
    elif base == "abs":
        value = (logp - ref_logp).abs()
    elif base in ("mse", "k2"):
        value = 0.5 * (logp - ref_logp).square()
    elif base in ("low_var_kl", "k3"):
        kl = (ref_logp - logp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        value = (torch.exp(kl) - kl - 1).clamp(-10.0, 10.0)
    else:
        raise ValueError(f"kl_loss_type {kind!r}: one of {', '.join(KL_TYPES)}, each with an optional '+'")
    if not kind.endswith("+") or base in ("mse", "k2"):
        return value
    k2 = 0.5 * (logp - ref_logp).square()
    return k2 - k2.detach() + value.detach()


@dataclass
class KLController:
    """The coefficient of the KL penalty in the reward (verl's ``kl_ctrl``): ``fixed``, or
    ``adaptive`` (Ziegler et al.): moved towards ``target_kl`` by at most 20 % of ``n / horizon``
    after each batch of ``n`` samples."""

    value: float
    type: str = "fixed"
    target_kl: float = 0.1
    horizon: int = 10000

    def update(self, current_kl: float, n_steps: int) -> None:
        if self.type == "adaptive":
            error = min(max(current_kl / self.target_kl - 1, -0.2), 0.2)
            self.value *= 1 + error * n_steps / self.horizon


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax over the last axis, per position."""
    logz = torch.logsumexp(logits, dim=-1)
    return logz - (torch.softmax(logits, dim=-1) * logits).sum(-1)


# -- distillation (verl's distillation.distillation_loss) -------------------------------------

@dataclass
class DistillationTerms:
    """A distillation loss per token (``[B, T]``, before ``loss_max_clamp``) and its per-token
    diagnostics (``student_mass`` / ``teacher_mass``: the probability the top-k holds)."""

    losses: torch.Tensor
    diagnostics: dict[str, torch.Tensor]


def forward_kl_topk(student_topk_logp: torch.Tensor, teacher_topk_logp: torch.Tensor,
                    log_prob_min_clamp: float | None = None) -> DistillationTerms:
    """Forward KL(teacher || student) over the teacher's top-k tokens, ``sum_k p_t (log p_t -
    log q_s)`` per token (``[B, T, K]`` in, ``[B, T]`` out). The top-k holds less than all the
    mass, so the sum can be negative: clamped at 0, as verl does. ``log_prob_min_clamp`` bounds
    both log-probs from below (a token the student gives ~0 would dominate the loss)."""
    dtype = torch.promote_types(student_topk_logp.dtype, torch.float32)
    student, teacher = student_topk_logp.to(dtype), teacher_topk_logp.to(dtype)
    diagnostics = {"student_mass": student.detach().exp().sum(-1), "teacher_mass": teacher.exp().sum(-1)}
    if log_prob_min_clamp is not None:
        student, teacher = student.clamp_min(log_prob_min_clamp), teacher.clamp_min(log_prob_min_clamp)
    kl = (teacher.exp() * (teacher - student)).sum(-1)
    return DistillationTerms(kl.clamp_min(0.0), diagnostics)


def estimator_distillation(student_logp: torch.Tensor, teacher_logp: torch.Tensor, mode: str) -> DistillationTerms:
    """A single-sample KL estimate of KL(student || teacher) on the sampled token (verl's
    estimator family, ``kl_penalty``'s names): the teacher's log-prob of each sampled token is all
    it needs, so the teacher stage sends one number per token."""
    return DistillationTerms(kl_penalty(student_logp, teacher_logp, mode), {})


#: verl's ``distillation_loss.loss_mode`` names; ``streamrl.distillation.config.LOSS_MODES`` lists
#: the same (torch-free), and says which need the teacher's top-k
DISTILLATION_LOSSES: tuple[str, ...] = ("forward_kl_topk", *KL_TYPES)


def distillation_loss(terms: DistillationTerms, mask: torch.Tensor, agg_mode: str, *,
                      logp: torch.Tensor | None = None, old_logp: torch.Tensor | None = None,
                      loss_max_clamp: float | None = None, use_policy_gradient: bool = False,
                      clip_low: float = 0.2, clip_high: float = 0.2, **agg) -> torch.Tensor:
    """The distillation loss of one micro-batch, aggregated as the policy loss is (``agg``: the
    mini-batch's totals, so micro-batches and ranks add up to the whole). Directly (the per-token
    loss backpropagated, as a supervised loss) or, with ``use_policy_gradient``, as PPO-clip with
    the negative per-token loss as the advantage (verl's vanilla loss, dual clip at 3)."""
    losses = terms.losses
    if loss_max_clamp is not None:  # both sides: k1 can be negative
        losses = losses.clamp(-loss_max_clamp, loss_max_clamp)
    if not use_policy_gradient:
        return aggregate(losses, mask, agg_mode, **agg)
    if logp is None or old_logp is None:
        raise ValueError("use_policy_gradient needs the student's current and old log-probs")
    pl = ppo_clip_loss(old_logp, logp, -losses.detach(), clip_low=clip_low, clip_high=clip_high, clip_c=3.0)
    return aggregate(pl.loss, mask, agg_mode, **agg)


def combine_distillation(task_loss: torch.Tensor, distill: torch.Tensor, *, use_task_rewards: bool,
                         coef: float) -> torch.Tensor:
    """verl's combination: the task's loss plus ``coef`` times the distillation loss with task
    rewards; without them, the distillation loss alone (its coefficient is 1 then)."""
    return task_loss + coef * distill if use_task_rewards else distill
