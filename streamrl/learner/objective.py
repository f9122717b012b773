"""What a mini-batch is trained toward, given its tensors: the advantages (by
``adv_estimator``, with the KL to the reference in the reward and the critic's values), the
critic's targets, verl's rollout correction, and each micro-batch's loss (the policy loss, the
entropy bonus, the KL to the reference, distillation), with the step's objective metrics.

The trainer (``streamrl.learner.trainer``) assembles the tensors (its plan, the forward passes,
the behaviour / proximal / reference log-probs) and steps the optimizer; this module holds the
maths between, built on ``streamrl.learner.losses``' verl functions. A new loss or estimator
touches it (and ``losses``) alone.

Ranks: every rank holds the whole mini-batch's samples but runs only its share of the
micro-batches (``units``); what needs the whole mini-batch (advantages, rollout correction, the
KL in the reward) gathers the units' rows from every rank first (``rows``), so each rank
computes the same figures as one process would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from streamrl.learner import losses
from streamrl.learner.samples import Sample

if TYPE_CHECKING:
    from streamrl.learner.collate import Batch
    from streamrl.learner.config import LearnerConfig


#: the per-teacher sums a step's metrics carry until ``step_metrics`` makes them means
_PER_TEACHER = "_distillation_by_teacher/"


@dataclass
class MiniBatch:
    """One ``Trainer.step``'s mini-batch as this rank trains it, filled in by the step's named
    parts in order: the whole mini-batch's samples and totals, this rank's units (micro-batches)
    and what each part computes for them."""

    samples: list[Sample]  # the whole mini-batch, in id order
    masks: list[np.ndarray]  # each sample's tokens to train on
    groups: list[list[Sample]]  # each unit's samples (a 1-token dummy evens out the ranks' unit counts)
    chunks: list[int]  # each unit's chunk size (0: one forward pass)
    chunked: bool  # some rank chunks a sequence: gradients stay local until the last unit
    units: list["Batch"]  # each unit's tensors
    total_tokens: torch.Tensor  # the mini-batch's trained tokens (metrics' normaliser)
    totals: dict[str, Any]  # the policy loss's normalisers (``losses.aggregate``'s keywords)
    rewards: np.ndarray  # each sample's reward
    proximal: list[torch.Tensor] | None = None  # each unit's log-probs under the weights before the update
    behaviour: list[torch.Tensor] = field(default_factory=list)  # ... under the policy that sampled them
    advantages: torch.Tensor | None = None  # [B, R], the whole mini-batch's
    unit_advantages: list[torch.Tensor] = field(default_factory=list)
    reward_kl: float | None = None  # use_kl_in_reward: the mean KL to the reference, and its coefficient
    reward_kl_coef: float = 0.0
    critic_groups: list[list[Sample]] | None = None  # gae: the critic's micro-batches (learner.critic's sizes)
    critic_units: list["Batch"] | None = None  # ... their tensors, its values at the update
    old_values: list[torch.Tensor] | None = None
    values: torch.Tensor | None = None
    returns: torch.Tensor | None = None  # gae: the returns of the advantages (the critic's targets)
    critic_metrics: dict[str, float] = field(default_factory=dict)
    corrected: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # rollout correction: weights, mask per unit
    live: list[torch.Tensor | None] | None = None  # bypass: each unit's log-probs in the first epoch
    is_norm: torch.Tensor | None = None  # bypass with a batch normaliser: the mean weight
    correction_metrics: dict[str, float] = field(default_factory=dict)
    baselines: list[losses.GroupBaseline] | None = None  # a group loss (gvpo): each unit's, this epoch's
    # distillation: the same normalisers over the samples a teacher annotated only (their trained
    # tokens for the token-mean metrics, ``totals``' keywords for the loss's figure)
    annotated_tokens: torch.Tensor | None = None
    annotated_totals: dict[str, Any] | None = None


def annotated(samples: Sequence[Sample], masks: Sequence[Any], device: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, sequences)`` to train of the samples a teacher annotated (``teacher.unserved:
    train`` leaves the others without a distillation term); ``masks``: each sample's tokens, as
    numpy arrays or tensors."""
    tokens = sum(float(m.sum()) for s, m in zip(samples, masks) if s.teacher_logprobs is not None)
    seqs = sum(int(float(m.sum()) > 0) for s, m in zip(samples, masks) if s.teacher_logprobs is not None)
    return (torch.tensor(max(1.0, tokens), device=device), torch.tensor(max(1, seqs), device=device))


def to_annotated(value: torch.Tensor, mode: str, totals: dict[str, Any], annotated_totals: dict[str, Any] | None
                 ) -> torch.Tensor:
    """A loss aggregated over the mini-batch's ``totals`` (``losses.aggregate``), as the same
    aggregate over the annotated samples' normalisers: exact, the aggregate being its sum over
    one normaliser (tokens for the token means, sequences for the sequence means)."""
    if annotated_totals is None or mode == "token-sum":
        return value
    key = "total_tokens" if mode == "token-mean" else "total_seqs"
    return value * (totals[key] / annotated_totals[key])


class Metrics:
    """A step's metrics as they accumulate over micro-batches: sums, and verl's MIN / MAX ones."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.extremes: dict[str, tuple[str, torch.Tensor]] = {}  # name -> (op, value)

    def add(self, name: str, value: torch.Tensor, reduce: str = "sum") -> None:
        value = value.detach().float()
        if reduce == "sum":
            self.sums[name] = self.sums.get(name, 0.0) + value
        else:
            prev = self.extremes.get(name)
            pick = torch.minimum if reduce == "min" else torch.maximum
            self.extremes[name] = (reduce, value if prev is None else pick(prev[1], value))

    def reduced(self, world: int, epochs: int) -> dict[str, float]:
        """Summed (or MIN / MAX'd) over the ranks, sums per epoch; an extreme that stayed
        infinite (no tokens anywhere) is left out. Every rank calls it with the same names."""
        names = sorted(self.sums)
        totals = torch.stack([torch.as_tensor(self.sums[k]).reshape(()) for k in names]) if names else torch.zeros(0)
        if world > 1 and names:
            import torch.distributed as dist

            dist.all_reduce(totals)
        out = {k: float(v) / epochs for k, v in zip(names, totals.cpu())}
        for name, (op, value) in sorted(self.extremes.items()):
            if world > 1:
                import torch.distributed as dist

                dist.all_reduce(value, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX)
            if math.isfinite(float(value)):
                out[name] = float(value)
        return out


class Objective:
    """One rank's objective: ``cfg``'s estimator and losses over the mini-batches the trainer
    hands it, ``kl_ctrl`` the KL-in-reward coefficient it adapts (verl's ``kl_ctrl``)."""

    def __init__(self, cfg: "LearnerConfig", device: torch.device, world: int, kl_ctrl: losses.KLController):
        self.cfg = cfg
        self.device = device
        self.world = world
        self.kl_ctrl = kl_ctrl
        d = cfg.distillation  # several teachers (distillation.teacher_models): their names, whose figures
        self.teacher_names: list[str] = list(d.entries()) if d.enabled and d.routed else []  # are apart

    # -- the whole mini-batch on every rank -----------------------------------------------------
    def rows(self, samples: Sequence[Sample], groups: list[list[Sample]], per_unit: list[torch.Tensor]
             ) -> torch.Tensor:
        """Per-unit ``[b, R_u]`` tensors of this rank as the mini-batch's ``[B, R]`` in ``samples``'
        order, whole on every rank (summed over the ranks: each sample is on one)."""
        row = {s.id: k for k, s in enumerate(samples)}
        width = max(max(len(s.response_ids) for s in samples), 1)
        full = torch.zeros((len(samples), width), device=self.device)
        for u, g in enumerate(groups):
            for i, s in enumerate(g):
                if s.id in row:
                    n = min(width, per_unit[u].shape[1])
                    full[row[s.id], :n] = per_unit[u][i, :n].float()
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(full)
        return full

    def mask_rows(self, masks: Sequence[np.ndarray]) -> torch.Tensor:
        full = torch.zeros((len(masks), max(max(len(m) for m in masks), 1)), device=self.device)
        for i, m in enumerate(masks):
            full[i, :len(m)] = torch.from_numpy(np.asarray(m, np.float32)).to(self.device)
        return full

    # -- advantages -------------------------------------------------------------------------------
    def advantages(self, samples: Sequence[Sample], masks: Sequence[np.ndarray],
                   kl: torch.Tensor | None = None, values: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token advantages ``[B, longest response]`` of the mini-batch by
        ``cfg.adv_estimator``, from each reward on its response's last token, less
        ``kl_ctrl``'s coefficient times ``kl`` per token (``use_kl_in_reward``); ``values``: the
        critic's ``[B, longest response]`` (``gae``), with the returns (the critic's targets)."""
        cfg = self.cfg
        mask = torch.zeros((len(samples), max(max(len(m) for m in masks), 1)), dtype=torch.float32)
        for i, m in enumerate(masks):
            mask[i, :len(m)] = torch.from_numpy(m)
        rewards = losses.token_rewards(torch.tensor([s.reward for s in samples], dtype=torch.float32), mask)
        if kl is not None:
            rewards = rewards - self.kl_ctrl.value * kl * mask
        comps = None
        if cfg.adv_estimator == "gdpo":
            comps = torch.tensor([s.reward_components if s.reward_components is not None else [s.reward]
                                  for s in samples], dtype=torch.float32)
        baselines = None
        if cfg.adv_estimator == "remax":
            baselines = torch.tensor([s.reward if s.reward_baseline is None else s.reward_baseline for s in samples],
                                     dtype=torch.float32)
        opt = losses.AdvantageOptions(norm_adv_by_std_in_grpo=cfg.norm_adv_by_std_in_grpo, gamma=cfg.gamma,
                                      reward_components=comps, gdpo_reward_weights=cfg.gdpo_reward_weights,
                                      reward_baselines=baselines, lam=cfg.lam,
                                      values=None if values is None else values.cpu())
        returns = None
        if values is not None:
            returns = losses.gae_advantages_returns(rewards, values.cpu().to(rewards.dtype), mask,
                                                    cfg.gamma, cfg.lam)[1]
        estimator = losses.get_adv_estimator_fn(cfg.adv_estimator)
        return estimator(rewards, mask, [s.group_id for s in samples], opt), returns

    def reward_kl(self, samples: Sequence[Sample], masks: Sequence[np.ndarray], groups: list[list[Sample]],
                  current: list[torch.Tensor], refs: list[torch.Tensor]) -> tuple[torch.Tensor, float]:
        """verl's KL in the reward: per token, KL(the policy before this update || the
        reference) by ``kl_penalty``, and its mean over sequences (what ``kl_ctrl`` adapts to).
        ``current`` and ``refs``: each unit's log-probs on this rank, gathered from every rank
        (``rows``) so each computes the whole mini-batch's, as one process would."""
        mask = self.mask_rows(masks).cpu()
        current_rows = self.rows(samples, groups, current).cpu()
        ref_rows = self.rows(samples, groups, refs).cpu()
        kl = losses.kl_penalty(current_rows, ref_rows, self.cfg.kl_penalty) * mask
        per_seq = kl.sum(-1) / (mask.sum(-1) + 1e-8)
        return kl, float(per_seq.mean())

    def set_advantages(self, batch: MiniBatch, current: list[torch.Tensor] | None = None,
                       refs: list[torch.Tensor] | None = None) -> None:
        """The mini-batch's advantages (``advantages``; with the critic's values for ``gae``, the
        KL to the reference in the reward with ``use_kl_in_reward`` from each unit's
        ``current`` and ``refs`` log-probs, whose controller then adapts), and each unit's rows
        of them."""
        samples = batch.samples
        if batch.old_values is not None:  # the critic's values at the update, whole on every rank
            batch.values = self.rows(samples, batch.critic_groups, batch.old_values)
        kl_tokens = None
        if self.cfg.use_kl_in_reward:
            kl_tokens, batch.reward_kl = self.reward_kl(samples, batch.masks, batch.groups, current, refs)
            batch.reward_kl_coef = self.kl_ctrl.value
        batch.advantages, batch.returns = self.advantages(samples, batch.masks, kl_tokens, values=batch.values)
        if self.cfg.use_kl_in_reward:
            self.kl_ctrl.update(batch.reward_kl, len(samples))
        by_id = {s.id: batch.advantages[i] for i, s in enumerate(samples)}
        batch.unit_advantages = [
            torch.stack([by_id[s.id][:unit.mask.shape[1]] if s.id in by_id else torch.zeros(unit.mask.shape[1])
                         for s in group]).to(self.device)
            for group, unit in zip(batch.groups, batch.units)]

    # -- a group loss's statistics (GVPO) ------------------------------------------------------------
    def set_group_baselines(self, batch: MiniBatch, current: list[torch.Tensor], metrics: Metrics) -> None:
        """Before an epoch of a loss registered with ``group_baseline`` (``gvpo``): each group's
        mean of ``beta (sum log pi - sum log pi_old)`` (pi_old: the weights before the update,
        ``proximal``, as verl's recipe recomputes its old log-probs) at the weights the epoch trains from
        (``current``: each unit's log-probs under them), over the whole mini-batch, the units of
        every rank gathered first (``rows``), so a group that the plan splits over micro-batches
        and ranks is measured whole, as verl's recipe gathers its micro-batch over the ranks.
        Adds ``gvpo/residual``: the mean over sequences of ``|(R_theta - mean) - A|``, the gap
        the loss closes."""
        samples, beta = batch.samples, self.cfg.policy_loss.gvpo_beta
        mask = self.mask_rows(batch.masks)
        log_ratio = losses.sequence_log_ratio(self.rows(samples, batch.groups, batch.proximal),
                                              self.rows(samples, batch.groups, current), mask)
        stats = losses.group_baseline(beta * log_ratio, [s.group_id for s in samples])
        row = {s.id: k for k, s in enumerate(samples)}
        batch.baselines = []
        for group in batch.groups:
            where = [row.get(s.id) for s in group]
            mean = torch.tensor([0.0 if k is None else float(stats.mean[k]) for k in where], device=self.device)
            size = torch.tensor([0.0 if k is None else float(stats.size[k]) for k in where], device=self.device)
            batch.baselines.append(losses.GroupBaseline(mean=mean, size=size))
        advantages = batch.advantages.to(mask.device)
        target = (advantages[:, :mask.shape[1]] * mask).sum(-1) / mask.sum(-1).clamp(min=1e-8)
        residual = ((beta * log_ratio - stats.mean) - target).abs()
        # (every rank holds the whole mini-batch: rank 0 adds it, the ranks' sum is the figure)
        metrics.add("gvpo/residual", residual.mean() if self._rank0() else residual.new_zeros(()))

    def _rank0(self) -> bool:
        if self.world == 1:
            return True
        import torch.distributed as dist

        return dist.get_rank() == 0

    # -- the critic's targets -----------------------------------------------------------------------
    def critic_targets(self, batch: MiniBatch) -> list[torch.Tensor]:
        """adv_estimator gae: each critic unit's returns (the value loss's targets)."""
        row = {s.id: k for k, s in enumerate(batch.samples)}
        return [torch.stack([batch.returns[row[s.id], :unit.mask.shape[1]] if s.id in row else
                             torch.zeros(unit.mask.shape[1]) for s in group]).to(self.device)
                for group, unit in zip(batch.critic_groups, batch.critic_units)]

    def set_critic_metrics(self, batch: MiniBatch, grad_norm: float, lr: float) -> None:
        """verl's ``critic/*`` figures of the critic's update on ``batch``."""
        trained = self.mask_rows(batch.masks).cpu() > 0
        values, returns = batch.values.cpu(), batch.returns
        batch.critic_metrics = {
            "critic/grad_norm": grad_norm, "critic/lr": lr,
            "critic/vf_explained_var": losses.explained_variance(values, returns, trained),
            "critic/values/mean": float(values[trained].mean()), "critic/returns/mean": float(returns[trained].mean())}

    # -- rollout correction ---------------------------------------------------------------------------
    def prepare_correction(self, batch: MiniBatch) -> None:
        """verl's rollout correction before the epochs. Decoupled: the weights and rejection of
        the whole mini-batch (as verl's on its batch), which also set the normalisers. Bypass:
        room for the first epoch's live log-probs, and with a batch normaliser the mean weight
        over the whole mini-batch (every rank alike)."""
        rc = self.cfg.rollout_correction
        if rc.enabled and not rc.bypass_mode:
            corr, batch.corrected = self.correction(batch.samples, batch.masks, batch.groups, batch.proximal,
                                                    batch.behaviour)
            batch.correction_metrics = corr.metrics
            kept = corr.mask
            batch.totals.update(total_tokens=kept.sum().clamp(min=1.0), total_seqs=(kept.sum(-1) > 0).sum().clamp(min=1))
            if batch.annotated_totals is not None:
                tokens, seqs = annotated(batch.samples, kept)
                batch.annotated_totals.update(total_tokens=tokens.to(kept.device), total_seqs=seqs.to(kept.device))
        elif rc.bypass_mode:
            from streamrl.learner import rollout_correction

            batch.live = [None] * len(batch.units)
            if rc.bypass_mode and bool(rc.rollout_is) and rc.rollout_is_batch_normalize:
                behaviour, mask = self.rows(batch.samples, batch.groups, batch.behaviour), self.mask_rows(batch.masks)
                current = self.rows(batch.samples, batch.groups, batch.proximal)
                weights, _ = rollout_correction.is_weights(current - behaviour, mask, rc.rollout_is,
                                                           rc.rollout_is_threshold)
                batch.is_norm = rollout_correction.is_weight_mean(weights, mask, rc.rollout_is)

    def correction(self, samples: Sequence[Sample], masks: Sequence[np.ndarray], groups: list[list[Sample]],
                   current: list[torch.Tensor], behavs: list[torch.Tensor]) -> tuple[Any, list[tuple]]:
        """verl's decoupled rollout correction on the whole mini-batch (every rank alike): the
        weights and kept-token mask of each unit of this rank."""
        from streamrl.learner import rollout_correction

        corr = rollout_correction.correct(self.rows(samples, groups, current), self.rows(samples, groups, behavs),
                                          self.mask_rows(masks), self.cfg.rollout_correction)
        row = {s.id: k for k, s in enumerate(samples)}
        out = []
        for u, g in enumerate(groups):
            width = current[u].shape[1]
            w = torch.ones_like(current[u]) if corr.weights is None else torch.zeros_like(current[u])
            m = torch.zeros_like(current[u])
            for i, s in enumerate(g):
                if s.id in row:
                    n = min(width, corr.mask.shape[1])
                    m[i, :n] = corr.mask[row[s.id], :n]
                    if corr.weights is not None:
                        w[i, :n] = corr.weights[row[s.id], :n]
            out.append((w, m))
        return corr, out

    # -- a micro-batch's loss -------------------------------------------------------------------------
    def loss(self, batch: MiniBatch, u: int, logp: torch.Tensor, ent: torch.Tensor,
             options: losses.LossOptions, references: list[torch.Tensor] | None, metrics: Metrics) -> torch.Tensor:
        """Unit ``u``'s loss from its log-probs ``logp`` and entropies ``ent``: the policy loss,
        the entropy bonus, the KL to the reference, distillation; its share of the mini-batch's
        (aggregated over the mini-batch's totals, so micro-batches and ranks add up to the whole)."""
        cfg, unit, totals = self.cfg, batch.units[u], batch.totals
        token_totals = dict(total_tokens=batch.total_tokens)
        policy, mask = self.policy_loss(batch, u, logp, options)
        pg_loss = losses.aggregate(policy.loss, mask, policy.agg_mode or cfg.loss_agg_mode, **totals)
        entropy = losses.aggregate(ent, unit.mask, cfg.loss_agg_mode, **totals)
        loss = pg_loss - cfg.entropy_coeff * entropy if cfg.entropy_coeff else pg_loss
        if references is not None and cfg.kl_coef > 0:
            kl = losses.aggregate(losses.kl_penalty(logp, references[u], cfg.kl_loss_type), mask,
                                  cfg.loss_agg_mode, **totals)
            loss = loss + cfg.kl_coef * kl
            metrics.add("kl", kl)
        if cfg.distillation.enabled:  # verl's distillation_ppo_loss: with or instead of the task's
            old = batch.proximal[u] if cfg.decoupled else batch.behaviour[u]
            loss = self.distillation_loss(loss, unit, logp, old, mask, batch, metrics.add)
        metrics.add("loss", loss)
        metrics.add("pg_loss", pg_loss)
        metrics.add("entropy", entropy)
        metrics.add("clip_fraction", losses.aggregate(policy.clipped, unit.mask, "token-mean", **token_totals))
        metrics.add("ppo_kl", losses.aggregate(policy.approx_kl, unit.mask, "token-mean", **token_totals))
        metrics.add("is_weight", losses.aggregate(policy.is_weight, unit.mask, "token-mean", **token_totals))
        return loss

    def policy_loss(self, batch: MiniBatch, u: int, logp: torch.Tensor,
                    options: losses.LossOptions) -> tuple[losses.PolicyLoss, torch.Tensor]:
        """Unit ``u``'s per-token policy loss and the mask to aggregate it with, by the objective:
        rollout correction (decoupled: clipped around pi_old, weighted; bypass: the behaviour
        log-probs are pi_old), AReaL's decoupled objective (the trust region around the proximal
        policy, weighted back to the behaviour one), or the loss against the behaviour policy."""
        cfg, unit, advantages = self.cfg, batch.units[u], batch.unit_advantages[u]
        mode = cfg.policy_loss.loss_mode
        if batch.corrected is not None:
            weight, mask = batch.corrected[u]
            return losses.policy_loss(mode, batch.proximal[u], logp, advantages, mask, options, weight), mask
        if batch.live is not None:
            from streamrl.learner import rollout_correction

            if batch.live[u] is None:
                batch.live[u] = logp.detach()
            return rollout_correction.bypass_loss(batch.behaviour[u], logp, advantages, unit.mask,
                                                  cfg.rollout_correction, cfg.clip_ratio_low, cfg.clip_ratio_high,
                                                  cfg.clip_ratio_c, batch.is_norm)
        if cfg.decoupled:
            weight, mask = losses.importance_weight(batch.proximal[u], batch.behaviour[u], unit.mask,
                                                    cap=cfg.is_cap, mode=cfg.is_mode)
            return losses.policy_loss(mode, batch.proximal[u], logp, advantages, mask, options, weight), mask
        if batch.baselines is not None:  # a group loss (gvpo): pi_old is the weights' before the update, as verl's
            return losses.policy_loss(mode, batch.proximal[u], logp, advantages, unit.mask, options,
                                      baseline=batch.baselines[u]), unit.mask
        return losses.policy_loss(mode, batch.behaviour[u], logp, advantages, unit.mask, options), unit.mask

    def distillation_loss(self, task_loss: torch.Tensor, unit: "Batch", logp: torch.Tensor, old: torch.Tensor,
                          mask: torch.Tensor, batch: MiniBatch, add: Any) -> torch.Tensor:
        """One micro-batch's loss with the teacher's (``learner.distillation``, verl's
        ``distillation_loss``): aggregated over the mini-batch's totals like the policy loss, so
        micro-batches and ranks add up to the whole; metrics as verl's ``distillation/*``.

        Records no teacher serves (``teacher.unserved: train``) carry no distillation term. The
        term keeps verl's weight, the mean over all of the mini-batch's tokens, as verl's
        ``agg_loss`` over the response mask and the batch's token count: each annotated token's
        loss is ``pg + coef * distill`` whatever else the mini-batch holds, so an annotated
        token's update does not grow as the unserved share does. The figures (``distillation/
        loss``, ``abs_loss``, ``teacher_mass``, ``student_mass``) are over the annotated tokens
        (what they mean to a reader; with every record annotated, verl's figures exactly)."""
        dl = self.cfg.distillation.distillation_loss
        totals, token_totals = batch.totals, dict(total_tokens=batch.total_tokens)
        if batch.annotated_tokens is not None:
            token_totals = dict(total_tokens=batch.annotated_tokens)
        served = unit.teacher_served if unit.teacher_served is not None else 1.0
        mask, token_mask = mask * served, unit.mask * served  # a record no teacher serves: no distillation term
        if dl.use_topk:
            terms = losses.forward_kl_topk(unit.student_topk, unit.teacher_logprobs, dl.log_prob_min_clamp)
        else:
            terms = losses.estimator_distillation(logp, unit.teacher_logprobs, dl.loss_mode)
        distill = losses.distillation_loss(terms, mask, self.cfg.loss_agg_mode, logp=logp, old_logp=old,
                                           loss_max_clamp=dl.loss_max_clamp, use_policy_gradient=dl.use_policy_gradient,
                                           clip_low=dl.clip_ratio_low, clip_high=dl.clip_ratio_high, **totals)
        add("distillation/loss", to_annotated(distill, self.cfg.loss_agg_mode, totals, batch.annotated_totals))
        add("distillation/abs_loss", losses.aggregate(terms.losses.detach().abs(), token_mask, "token-mean", **token_totals))
        # verl's distillation/loss_min and loss_max: the per-token loss before loss_max_clamp over
        # the response tokens, reduced as MIN / MAX over micro-batches and ranks
        valid = terms.losses.detach()[token_mask > 0]
        none = valid.new_tensor(math.inf)  # a rank without response tokens still joins the reduction
        add("distillation/loss_min", valid.min() if valid.numel() else none, "min")
        add("distillation/loss_max", valid.max() if valid.numel() else -none, "max")
        for name, value in terms.diagnostics.items():
            add(f"distillation/{name}", losses.aggregate(value.detach(), token_mask, "token-mean", **token_totals))
        # several teachers: each one's figures over its own records' tokens (token means, made
        # from sums in step_metrics so that micro-batches and ranks add up); every rank adds
        # every teacher's, so the reduction's names agree
        for i, name in enumerate(self.teacher_names):
            mine = token_mask * (unit.teacher_of == i) if unit.teacher_of is not None else token_mask * 0
            add(f"{_PER_TEACHER}{name}/tokens", mine.sum())
            add(f"{_PER_TEACHER}{name}/loss", (terms.losses.detach() * mine).sum())
            add(f"{_PER_TEACHER}{name}/abs_loss", (terms.losses.detach().abs() * mine).sum())
        return losses.combine_distillation(task_loss, distill, use_task_rewards=dl.use_task_rewards,
                                           coef=dl.distillation_loss_coef)

    # -- the step's figures -----------------------------------------------------------------------------
    def step_metrics(self, batch: MiniBatch, metrics: Metrics, critic: bool) -> dict[str, float]:
        """The step's metrics, reduced over the ranks (sums per epoch; verl's MIN / MAX ones),
        with verl's advantages, rewards, rollout correction, critic (``critic``: gae's is on)
        and GDPO figures."""
        cfg, samples, masks = self.cfg, batch.samples, batch.masks
        out = metrics.reduced(self.world, cfg.ppo_epochs)
        if batch.reward_kl is not None:
            out.update(reward_kl_penalty=batch.reward_kl, reward_kl_penalty_coeff=batch.reward_kl_coef)
        trained = torch.cat([batch.advantages[i, :len(m)][torch.from_numpy(m) > 0] for i, m in enumerate(masks)])
        if trained.numel():  # verl's critic/advantages/*: over the response tokens that are trained
            out.update(advantages_mean=float(trained.mean()), advantages_max=float(trained.max()),
                       advantages_min=float(trained.min()))
        if batch.reward_kl is not None:  # verl's critic/rewards: the score less the KL penalty
            out.update(rewards_mean=float(batch.rewards.mean()) - batch.reward_kl_coef * batch.reward_kl)
        if batch.live is not None:  # bypass: the mismatch of the policy at the mini-batch's start (first epoch)
            from streamrl.learner import rollout_correction

            live, behaviour = (self.rows(samples, batch.groups, x) for x in (batch.live, batch.behaviour))
            batch.correction_metrics = rollout_correction.correct(live, behaviour, self.mask_rows(masks),
                                                                  cfg.rollout_correction, batch.is_norm).metrics
        out.update(batch.correction_metrics)
        for name in self.teacher_names:  # verl's distillation/loss and abs_loss, by teacher
            tokens = out.pop(f"{_PER_TEACHER}{name}/tokens", 0.0)
            for part in ("loss", "abs_loss"):
                total = out.pop(f"{_PER_TEACHER}{name}/{part}", 0.0)
                if tokens > 0:
                    out[f"distillation/{name}/{part}"] = total / tokens
        if critic:  # its sums are over its own epochs
            epochs = cfg.critic.ppo_epochs or cfg.ppo_epochs
            out.update({k: v * cfg.ppo_epochs / epochs for k, v in out.items() if k.startswith("critic/")})
            out.update(batch.critic_metrics)
        if cfg.adv_estimator == "gdpo":  # verl's gdpo/<key>/mean, std
            components = np.array([s.reward_components for s in samples], dtype=np.float64)
            for k, key in enumerate(cfg.gdpo_reward_keys):
                out.update({f"gdpo/{key}/mean": float(components[:, k].mean()),
                            f"gdpo/{key}/std": float(components[:, k].std())})
        return out
