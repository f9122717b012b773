"""The model and one update: log-probs of the response tokens given ``prompt_ids +
response_ids``, advantages, the loss of ``losses``, gradient accumulation over micro-batches,
clipping and an AdamW step. torch + transformers, CPU or CUDA.

The learner owns exactly one ``Trainer``; ``stage`` hands it mini-batches of ``Sample``s and
reads back the metrics of each step. Everything here is synchronous (the stage runs it in a
thread so the Kafka client keeps its group membership alive during a long step).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from streamrl.learner import losses
from streamrl.learner.config import LearnerConfig
from streamrl.policy import load_policy


@dataclass
class Sample:
    """One trajectory ready to train on."""

    id: str
    group_id: str
    prompt_ids: np.ndarray
    response_ids: np.ndarray
    reward: float
    policy_version: int
    behaviour_logprobs: np.ndarray | None = None  # None: recompute with the current weights
    response_mask: np.ndarray | None = None  # 1 where the policy produced the token

    @property
    def n_tokens(self) -> int:
        return int(len(self.response_ids) if self.response_mask is None else self.response_mask.sum())


@dataclass
class _Batch:
    input_ids: torch.Tensor  # [B, L] prompt + response, right-padded
    attention_mask: torch.Tensor  # [B, L]
    positions: torch.Tensor  # [B, R] index of the logits that predict response token j
    response_ids: torch.Tensor  # [B, R]
    mask: torch.Tensor  # [B, R] float: 1 for tokens to train on

    def rows(self, sl: slice) -> "_Batch":
        return _Batch(*(t[sl] for t in (self.input_ids, self.attention_mask, self.positions,
                                         self.response_ids, self.mask)))


class Trainer:
    def __init__(self, cfg: LearnerConfig, policy: str | None = None):
        """``policy``: where to load the weights from (a checkpoint), else ``cfg.policy``."""
        self.cfg = cfg
        torch.manual_seed(cfg.seed)
        self.device = torch.device(cfg.device)
        self.model, self.tokenizer = load_policy(policy or cfg.policy, device=cfg.device,
                                                 dtype=cfg.dtype, seed=cfg.seed)
        self.model.to(dtype=getattr(torch, cfg.dtype))
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr,
                                           weight_decay=cfg.weight_decay)
        # The KL reference is the weights the run started from (verl: the initial actor).
        self.reference = None
        if cfg.kl_coef > 0:
            ref_spec = cfg.policy
            self.reference = (load_policy(ref_spec, device=cfg.device, dtype=cfg.dtype, seed=cfg.seed)[0]
                              if policy else copy.deepcopy(self.model)).eval()
            self.reference.requires_grad_(False)

    # -- tensors ------------------------------------------------------------------------------
    def _collate(self, samples: Sequence[Sample]) -> _Batch:
        pad = self.tokenizer.pad_token_id or 0
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        max_len, max_resp = max(lengths), max(max(len(s.response_ids) for s in samples), 1)
        B = len(samples)
        input_ids = torch.full((B, max_len), pad, dtype=torch.long)
        attention = torch.zeros((B, max_len), dtype=torch.long)
        positions = torch.zeros((B, max_resp), dtype=torch.long)
        response = torch.full((B, max_resp), pad, dtype=torch.long)
        mask = torch.zeros((B, max_resp), dtype=torch.float32)
        for i, s in enumerate(samples):
            p, r = len(s.prompt_ids), len(s.response_ids)
            if p == 0:
                raise ValueError(f"record {s.id}: empty prompt_ids (the first response token "
                                 "needs a prompt token to be predicted from)")
            resp_ids = _tensor(s.response_ids, np.int64)
            input_ids[i, :p] = _tensor(s.prompt_ids, np.int64)
            input_ids[i, p:p + r] = resp_ids
            attention[i, :p + r] = 1
            positions[i, :r] = torch.arange(p - 1, p - 1 + r)
            response[i, :r] = resp_ids
            mask[i, :r] = 1.0 if s.response_mask is None else _tensor(s.response_mask, np.float32)
        dev = self.device
        return _Batch(input_ids.to(dev), attention.to(dev), positions.to(dev), response.to(dev), mask.to(dev))

    def _forward(self, model: Any, batch: _Batch, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs ``[B, R]`` of the response tokens (at ``cfg.temperature``), and their
        entropies when asked."""
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        V = logits.shape[-1]
        logits = logits.gather(1, batch.positions.unsqueeze(-1).expand(-1, -1, V)).float()
        if self.cfg.temperature != 1.0:
            logits = logits / self.cfg.temperature
        logp = logits.gather(-1, batch.response_ids.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)
        ent = losses.entropy_from_logits(logits) if entropy else None
        return logp, ent

    @torch.no_grad()
    def _logprobs(self, model: Any, batch: _Batch) -> torch.Tensor:
        mb = self.cfg.micro_batch_size
        parts = [self._forward(model, batch.rows(slice(i, i + mb)), entropy=False)[0]
                 for i in range(0, batch.input_ids.shape[0], mb)]
        return torch.cat(parts)

    def logprobs(self, samples: Sequence[Sample]) -> list[np.ndarray]:
        """The current policy's log-probs of each sample's response tokens."""
        was_training = self.model.training
        self.model.eval()
        try:
            lp = self._logprobs(self.model, self._collate(samples)).cpu().numpy()
        finally:
            self.model.train(was_training)
        return [lp[i, :len(s.response_ids)].astype(np.float32) for i, s in enumerate(samples)]

    def advantages(self, samples: Sequence[Sample]) -> torch.Tensor:
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        if self.cfg.algorithm == "grpo":
            return losses.grpo_advantages(rewards, [s.group_id for s in samples],
                                          norm_by_std=self.cfg.norm_adv_by_std_in_grpo)
        return losses.whitened_advantages(rewards)

    # -- the update ---------------------------------------------------------------------------
    def step(self, samples: Sequence[Sample]) -> dict[str, float]:
        """One mini-batch: ``ppo_epochs`` optimizer steps over ``samples``. Returns metrics."""
        cfg = self.cfg
        started = time.perf_counter()
        samples = sorted(samples, key=lambda s: s.id)  # arrival order must not change the math
        batch = self._collate(samples)
        B = len(samples)
        adv = self.advantages(samples).to(self.device)
        current = None
        if cfg.decoupled or any(s.behaviour_logprobs is None for s in samples):
            current = self._logprobs(self.model, batch)  # the proximal policy (AReaL)
        behav = torch.zeros_like(batch.mask)
        for i, s in enumerate(samples):
            if s.behaviour_logprobs is None:
                behav[i] = current[i]
            else:
                behav[i, :len(s.behaviour_logprobs)] = _tensor(s.behaviour_logprobs, np.float32)
        ref = self._logprobs(self.reference, batch) if self.reference is not None else None
        total_tokens = batch.mask.sum().clamp(min=1.0)
        total_seqs = (batch.mask.sum(-1) > 0).sum().clamp(min=1)
        sums: dict[str, float] = {}

        def add(name: str, value: torch.Tensor) -> None:
            sums[name] = sums.get(name, 0.0) + float(value)

        grad_norm, skipped = 0.0, 0
        for _ in range(cfg.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for lo in range(0, B, cfg.micro_batch_size):
                sl = slice(lo, lo + cfg.micro_batch_size)
                mb = batch.rows(sl)
                logp, ent = self._forward(self.model, mb, entropy=True)
                if cfg.decoupled:
                    pl, mask = losses.decoupled_ppo_loss(
                        logp, current[sl], behav[sl], adv[sl], mb.mask, cap=cfg.is_cap,
                        mode=cfg.is_mode, clip_low=cfg.clip_ratio_low,
                        clip_high=cfg.clip_ratio_high, clip_c=cfg.clip_ratio_c)
                else:
                    pl = losses.ppo_clip_loss(logp, behav[sl], adv[sl], clip_low=cfg.clip_ratio_low,
                                              clip_high=cfg.clip_ratio_high, clip_c=cfg.clip_ratio_c)
                    mask = mb.mask
                agg = dict(mode=cfg.loss_agg_mode, total_tokens=total_tokens, total_seqs=total_seqs)
                pg = losses.aggregate(pl.loss, mask, **agg)
                entropy = losses.aggregate(ent, mb.mask, **agg)
                loss = pg - cfg.entropy_coeff * entropy if cfg.entropy_coeff else pg
                if ref is not None:
                    kl = losses.aggregate(losses.kl_penalty(logp, ref[sl], cfg.kl_loss_type), mask, **agg)
                    loss = loss + cfg.kl_coef * kl
                    add("kl", kl.detach())
                loss.backward()
                tok = dict(total_tokens=total_tokens)
                add("loss", loss.detach())
                add("pg_loss", pg.detach())
                add("entropy", entropy.detach())
                add("clip_fraction", losses.aggregate(pl.clipped, mb.mask, "token-mean", **tok))
                add("ppo_kl", losses.aggregate(pl.approx_kl, mb.mask, "token-mean", **tok))
                add("is_weight", losses.aggregate(pl.is_weight, mb.mask, "token-mean", **tok))
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(),
                                                  cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
            grad_norm = float(norm)
            if math.isfinite(grad_norm):
                self.optimizer.step()
            else:  # as verl: a non-finite gradient skips the step instead of poisoning Adam
                skipped += 1
                self.optimizer.zero_grad(set_to_none=True)
        rewards = np.array([s.reward for s in samples], dtype=np.float64)
        out = {k: v / cfg.ppo_epochs for k, v in sums.items()}
        out.update(grad_norm=grad_norm, skipped_steps=float(skipped), tokens=float(total_tokens),
                   sequences=float(B), reward_mean=float(rewards.mean()),
                   reward_std=float(rewards.std()), step_seconds=time.perf_counter() - started)
        return out

    # -- state --------------------------------------------------------------------------------
    def optimizer_state(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


def _tensor(values: np.ndarray, dtype) -> torch.Tensor:
    """A copy as a tensor (record arrays are read-only views of the message bytes)."""
    return torch.from_numpy(np.array(values, dtype=dtype))
