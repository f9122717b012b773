"""The model and one update: log-probs of the response tokens given ``prompt_ids +
response_ids``, advantages, the loss of ``losses``, gradient accumulation over micro-batches,
clipping and an AdamW step. torch + transformers, CPU or CUDA.

The learner owns exactly one ``Trainer``; ``stage`` hands it mini-batches of ``Sample``s and
reads back the metrics of each step. Everything here is synchronous (the stage runs it in a
thread so the Kafka client keeps its group membership alive during a long step).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import logging
import math
import signal
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from streamrl.errors import ConfigError
from streamrl.learner import losses, microbatch
from streamrl.learner.config import LearnerConfig, remove_padding_mode
from streamrl.policy import load_policy

log = logging.getLogger(__name__)


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
    # distillation: the teacher's log-probs, one per response token (teacher_topk 0) or
    # teacher_topk per token row-major with their ids (records.Distilled)
    teacher_logprobs: np.ndarray | None = None
    teacher_ids: np.ndarray | None = None
    teacher_topk: int = 0
    reward_components: list[float] | None = None  # GDPO: gdpo_reward_keys' values from reward_info
    reward_baseline: float | None = None  # ReMax: the reward of the group's greedy response

    @property
    def n_tokens(self) -> int:
        return int(len(self.response_ids) if self.response_mask is None else self.response_mask.sum())


@dataclass
class _Batch:
    """One forward pass's tensors. Padded: ``input_ids`` ``[B, L]`` right-padded, ``positions``
    index each row. Packed (``packed`` set): ``input_ids`` ``[1, T]``, the B sequences end to end,
    ``positions`` index that one row. Log-probs come out ``[B, R]`` either way."""

    input_ids: torch.Tensor  # [B, L] prompt + response, right-padded; packed: [1, T]
    attention_mask: torch.Tensor | None  # [B, L]; packed: None
    positions: torch.Tensor  # [B, R] index of the logits that predict response token j
    response_ids: torch.Tensor  # [B, R]
    mask: torch.Tensor  # [B, R] float: 1 for tokens to train on
    valid: torch.Tensor  # [B, R] bool: True for j < len(response)
    packed: dict[str, Any] | None = None  # packed: the forward's keywords (packing.forward_kwargs)
    teacher_logprobs: torch.Tensor | None = None  # distillation: [B, R], or [B, R, K] with teacher_ids
    teacher_ids: torch.Tensor | None = None  # forward_kl_topk: [B, R, K]
    student_topk: torch.Tensor | None = None  # set by each forward with teacher_ids: the student's [B, R, K]


class Trainer:
    """One rank's trainer. Alone (``learner.parallel.nproc`` 1) it is the whole learner's model;
    in a group (``streamrl.learner.distributed``) its model is FSDP2-sharded, every rank gets the
    whole mini-batch, trains its token-balanced share and the gradients are summed over ranks,
    so the result is the one-process update. Rank 0 sends each collective call to the others
    first (``_lead``)."""

    def __init__(self, cfg: LearnerConfig, policy: str | None = None, resume: str | None = None):
        """``policy``: where to load the weights from, else ``cfg.policy``; ``resume``: a
        checkpoint directory (weights from its ``policy/``, then its optimizer / DCP shards)."""
        from streamrl.learner import distributed

        self.cfg = cfg
        self.group = distributed.init(cfg)
        self.world = self.group.world if self.group else 1
        self.rank = self.group.rank if self.group else 0
        if self.group is not None and self.group.leader:  # every rank loads the same weights
            distributed.Channel().send("init", json.dumps({"policy": policy, "resume": resume}).encode())
        self.lora = cfg.lora.enabled  # PEFT adapters on a frozen base (streamrl.learner.lora)
        if resume and not self.lora:  # (LoRA: the base as configured, the adapter from the DCP shards)
            from streamrl.learner import checkpoint

            policy = str(checkpoint.policy_dir(resume))
        spec = policy or cfg.policy
        self.memory_estimate = distributed.check_memory(cfg, spec, self.world)  # bytes per rank
        torch.manual_seed(cfg.seed)
        dev = self.group.device if self.group else cfg.device
        self.device = torch.device(dev)
        self.model, self.tokenizer = load_policy(spec, device=dev, dtype=cfg.dtype, seed=cfg.seed)
        self.model.to(dtype=getattr(torch, cfg.dtype))
        self.kl_ctrl = losses.KLController(cfg.kl_ctrl.kl_coef, cfg.kl_ctrl.type, cfg.kl_ctrl.target_kl,
                                           cfg.kl_ctrl.horizon)
        # The KL reference is the weights the run started from (verl: the initial actor); with
        # LoRA, the frozen base itself with the adapter off (``_reference_logprobs``)
        self.reference = None
        self.has_reference = cfg.kl_coef > 0 or cfg.use_kl_in_reward
        if self.has_reference and not self.lora:
            self.reference = (load_policy(cfg.policy, device=dev, dtype=cfg.dtype, seed=cfg.seed)[0]
                              if spec != cfg.policy else copy.deepcopy(self.model)).eval()
            self.reference.requires_grad_(False)
        if cfg.gradient_checkpointing:
            if hasattr(self.model, "activation_checkpointing_enable"):  # transformers >= 5.x's name
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.remove_padding = remove_padding_mode(cfg.use_remove_padding)
        # the model can pack (and may: not false); the note says which path and why (start line)
        self.packed, self.packing_note = self._enable_packing(self.remove_padding)
        log.info("learner: %s", self.packing_note)
        if self.lora:
            from streamrl.learner import lora

            self.model = lora.wrap(self.model, cfg.lora)
        self.sharded = self.group is not None
        if self.sharded:
            distributed.shard(self.model, cfg)
            if self.reference is not None:
                distributed.shard(self.reference, cfg, trainable=False)
        self.model.train()
        self.critic = None  # adv_estimator gae's value model (streamrl.learner.critic)
        if cfg.adv_estimator == "gae":
            from streamrl.learner.critic import Critic

            self.critic = Critic(cfg, self.device, self.sharded)
        self._returns: torch.Tensor | None = None  # GAE's returns of the last advantages() (the critic's targets)
        # only what trains has gradients and AdamW states (with LoRA: the adapters alone)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.version: int | None = None  # the version being trained towards (+1): the lr schedule's step
        self._full_state: dict[str, Any] | None = None  # gathered once per version (weights + checkpoint)
        self._adapter: dict[str, Any] | None = None  # the adapter's, likewise (LoRA)
        self.forward_tokens: list[int] = []  # tokens of each forward pass of the last step (for tests/bench)
        if resume:
            self.load_checkpoint(resume)

    def _enable_packing(self, mode: str) -> tuple[bool, str]:
        """Padding-free micro-batches (``learner.use_remove_padding``) where the model (and the KL
        reference) can pack, checked before sharding so every rank decides alike on its own copy;
        says which path the learner takes and why (with ``auto``, each mini-batch is then packed
        or padded by ``_packs``)."""
        from streamrl.learner import packing

        if mode == "false":
            return False, "padded micro-batches (learner.use_remove_padding=false)"
        models = [self.model] + ([self.reference] if self.reference is not None else [])
        before = [m.config._attn_implementation for m in models]
        why = ""
        for m in models:
            why = why or packing.enable(m)
        if why:
            for m, impl in zip(models, before):  # both or neither: one plan serves the two
                m.set_attn_implementation(impl)
            if mode == "true":
                raise ConfigError(f"config field 'learner.use_remove_padding': true, but {why}; set it to auto "
                                  "(packs where the model can) or false")
            return False, f"padded micro-batches (learner.use_remove_padding=auto): {why}"
        when = ("every mini-batch" if mode == "true" else
                f"mini-batches whose padded micro-batches would hold >= {packing.AUTO_MIN_PADDING:.0%} padding, "
                "the others padded")
        return True, (f"packed micro-batches (learner.use_remove_padding={mode}): {when}; attention by "
                      f"{packing.kernel(self.device, getattr(torch, self.cfg.dtype))}")

    def _lead(self, op: str, payload: Any) -> None:
        """Rank 0 of a group: have the other ranks join the collective call that follows
        (``payload``: bytes, or a function making them, called on rank 0 only)."""
        if self.group is not None and self.group.leader:
            from streamrl.learner.distributed import Channel

            Channel().send(op, payload() if callable(payload) else payload)

    # -- tensors ------------------------------------------------------------------------------
    def _collate(self, samples: Sequence[Sample], packed: bool = False) -> _Batch:
        """The tensors of one forward pass (``packed``: one row without padding)."""
        batch = self._collate_packed(samples) if packed else self._collate_padded(samples)
        if self.cfg.distillation.enabled:
            batch.teacher_logprobs, batch.teacher_ids = self._teacher(samples, batch.mask.shape[1])
        return batch

    def _teacher(self, samples: Sequence[Sample], width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The teacher's log-probs ``[B, R]`` (``[B, R, K]`` and their ids with the top-k loss);
        zeros for a sample without them (the dummy: it trains nothing)."""
        k = self.cfg.distillation.distillation_loss.topk if self.cfg.distillation.distillation_loss.use_topk else 0
        shape = (len(samples), width, k) if k else (len(samples), width)
        logprobs, ids = torch.zeros(shape), torch.zeros(shape, dtype=torch.long) if k else None
        for i, s in enumerate(samples):
            if s.teacher_logprobs is None:
                continue
            r = len(s.response_ids)
            logprobs[i, :r] = _tensor(s.teacher_logprobs, np.float32).reshape((r, k) if k else (r,))
            if ids is not None:
                ids[i, :r] = _tensor(s.teacher_ids, np.int64).reshape(r, k)
        return logprobs.to(self.device), None if ids is None else ids.to(self.device)

    def _collate_packed(self, samples: Sequence[Sample]) -> _Batch:
        from streamrl.learner import packing

        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int).tolist()
        ids = torch.cat([_tensor(np.concatenate([s.prompt_ids, s.response_ids]), np.int64) for s in samples])
        dev = self.device
        pos_ids, cu, longest = packing.layout(lengths, dev)
        return _Batch(ids.unsqueeze(0).to(dev), None, *self._targets(samples, starts),
                      packed=packing.forward_kwargs(self.model, pos_ids, cu, longest))

    def _collate_padded(self, samples: Sequence[Sample]) -> _Batch:
        pad = self.tokenizer.pad_token_id or 0
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        input_ids = torch.full((len(samples), max(lengths)), pad, dtype=torch.long)
        attention = torch.zeros((len(samples), max(lengths)), dtype=torch.long)
        for i, (s, n) in enumerate(zip(samples, lengths)):
            input_ids[i, :n] = _tensor(np.concatenate([s.prompt_ids, s.response_ids]), np.int64)
            attention[i, :n] = 1
        return _Batch(input_ids.to(self.device), attention.to(self.device), *self._targets(samples, [0] * len(samples)))

    def _targets(self, samples: Sequence[Sample], starts: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """``positions, response_ids, mask, valid`` ``[B, R]``: sample ``i``'s response token ``j``
        is predicted by the logits at ``starts[i] + len(prompt) - 1 + j`` of its row."""
        B, R = len(samples), max(max(len(s.response_ids) for s in samples), 1)
        positions = torch.zeros((B, R), dtype=torch.long)
        response = torch.zeros((B, R), dtype=torch.long)
        mask = torch.zeros((B, R), dtype=torch.float32)
        valid = torch.zeros((B, R), dtype=torch.bool)
        for i, (s, start) in enumerate(zip(samples, starts)):
            _check_prompt(s)
            p, r = len(s.prompt_ids), len(s.response_ids)
            positions[i, :r] = torch.arange(start + p - 1, start + p - 1 + r)
            response[i, :r] = _tensor(s.response_ids, np.int64)
            mask[i, :r] = 1.0 if s.response_mask is None else _tensor(s.response_mask, np.float32)
            valid[i, :r] = True
        return tuple(t.to(self.device) for t in (positions, response, mask, valid))

    def _forward(self, model: Any, batch: _Batch, entropy: bool,
                 chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs ``[B, R]`` of the response tokens (at ``cfg.temperature``), and their
        entropies when asked. ``chunk`` > 0 (one sequence): forward passes of at most that many
        tokens, the KV cache of the earlier ones kept with its graph, so the result and its
        gradients are those of one pass."""
        if chunk:
            return self._forward_chunked(model, batch, entropy, chunk)
        self.forward_tokens.append(int(batch.input_ids.numel()))
        if batch.packed is not None:
            logits = model(input_ids=batch.input_ids, **batch.packed).logits
        else:
            logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        # the stats of the real response tokens only (not of [B, R]'s padding), placed in [B, R]
        where = batch.valid.nonzero(as_tuple=True)
        rows = torch.zeros_like(where[0]) if batch.packed is not None else where[0]
        picked = logits[rows, batch.positions[where]].float()
        logp, ent = self._token_stats(picked, batch.response_ids[where], entropy)
        zeros = torch.zeros(batch.valid.shape, device=logp.device, dtype=logp.dtype)
        if batch.teacher_ids is not None:
            topk = self._topk_logprobs(picked, batch.teacher_ids[where])
            blank = torch.zeros(batch.teacher_ids.shape, device=topk.device, dtype=topk.dtype)
            batch.student_topk = blank.index_put(where, topk)
        return zeros.index_put(where, logp), None if ent is None else zeros.index_put(where, ent)

    def _token_stats(self, logits: torch.Tensor, targets: torch.Tensor,
                     entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs of ``targets`` and the entropies (a metric only, without a graph, unless
        ``entropy_coeff`` puts them in the loss)."""
        if self.cfg.temperature != 1.0:
            logits = logits / self.cfg.temperature
        logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)
        if not entropy:
            return logp, None
        with contextlib.nullcontext() if self.cfg.entropy_coeff else torch.no_grad():
            return logp, losses.entropy_from_logits(logits)

    def _topk_logprobs(self, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The student's log-probs ``[N, K]`` of the teacher's top-k tokens ``ids`` (distillation's
        ``forward_kl_topk``), at the rollout's temperature as the sampled tokens' are."""
        if self.cfg.temperature != 1.0:
            logits = logits / self.cfg.temperature
        return logits.gather(-1, ids) - torch.logsumexp(logits, -1, keepdim=True)

    def _forward_chunked(self, model: Any, batch: _Batch, entropy: bool,
                         chunk: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        from transformers import DynamicCache

        length = int(batch.attention_mask[0].sum())
        ids, pos, targets = batch.input_ids[:, :length], batch.positions[0], batch.response_ids[0]
        cache = DynamicCache()
        key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        logp = torch.zeros(pos.shape, device=ids.device)
        ent = torch.zeros(pos.shape, device=ids.device) if entropy else None
        topk = None if batch.teacher_ids is None else torch.zeros(batch.teacher_ids.shape[1:], device=ids.device)
        for lo in range(0, length, chunk):
            hi = min(lo + chunk, length)
            self.forward_tokens.append(hi - lo)
            out = model(input_ids=ids[:, lo:hi], use_cache=True, **{key: cache},
                        position_ids=torch.arange(lo, hi, device=ids.device).unsqueeze(0))
            idx = ((pos >= lo) & (pos < hi)).nonzero().squeeze(-1)
            if idx.numel() == 0:
                continue
            picked = out.logits[0, pos[idx] - lo].float()
            lp, e = self._token_stats(picked, targets[idx], entropy)
            logp = logp.index_put((idx,), lp)
            if topk is not None:
                topk = topk.index_put((idx,), self._topk_logprobs(picked, batch.teacher_ids[0, idx]))
            if ent is not None:
                ent = ent.index_put((idx,), e)
        if topk is not None:
            batch.student_topk = topk.unsqueeze(0)
        return logp.unsqueeze(0), None if ent is None else ent.unsqueeze(0)

    # -- the plan: who trains what, in which forward passes -----------------------------------
    def _plan(self, samples: Sequence[Sample]) -> tuple[list[list[Sample]], list[int], bool, bool]:
        """This rank's micro-batches (samples; padded with a 1-token dummy so every rank runs
        as many), their chunk sizes (0: one pass), whether any rank chunks a sequence, and whether
        they are packed (``_packs``: every rank decides alike from the lengths)."""
        cfg = self.cfg
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        shares = microbatch.balance(lengths, self.world) if self.world > 1 else [list(range(len(samples)))]
        budget = cfg.max_tokens_per_micro_batch
        packed = self._packs(lengths)
        plans = []
        for share in shares:
            mbs = microbatch.split([lengths[i] for i in share], budget, cfg.micro_batch_size, packed=packed)
            plans.append([(tuple(share[j] for j in mb.indices), mb.chunks) for mb in mbs])
        if cfg.gradient_checkpointing:  # HF turns the KV cache off under checkpointing: one pass
            plans = [[(idx, 1) for idx, _ in plan] for plan in plans]
        chunked = any(c > 1 for plan in plans for _, c in plan)
        units = max(len(plan) for plan in plans)
        mine = plans[self.rank]
        dummy = self._dummy()
        out = [[samples[i] for i in idx] for idx, _ in mine] + [[dummy]] * (units - len(mine))
        chunks = [budget if c > 1 else 0 for _, c in mine] + [0] * (units - len(mine))
        return out, chunks, chunked, packed

    def _packs(self, lengths: Sequence[int]) -> bool:
        """Whether a mini-batch of sequences of ``lengths`` trains packed: always where packing is
        on (``use_remove_padding`` true), never where it is off or the model cannot pack; with
        ``auto``, where its padded micro-batches would hold at least ``packing.AUTO_MIN_PADDING``
        of padding (below that packing has little to remove, and its gathers cost about as much)."""
        from streamrl.learner import packing

        if not self.packed or self.remove_padding == "true":
            return self.packed
        cfg = self.cfg
        padded = sum(sum(lengths[i] for i in mb.indices) if mb.chunks > 1 else
                     len(mb.indices) * max(lengths[i] for i in mb.indices)
                     for mb in microbatch.split(lengths, cfg.max_tokens_per_micro_batch, cfg.micro_batch_size))
        return 1 - sum(lengths) / max(padded, 1) >= packing.AUTO_MIN_PADDING

    def _collate_units(self, groups: list[list[Sample]], chunks: list[int], packed: bool) -> list[_Batch]:
        """Each unit's tensors: packed when the plan packs, except a chunked sequence (one
        sequence, no padding either way; its passes keep a KV cache, which packing has not)."""
        return [self._collate(g, packed=packed and not c) for g, c in zip(groups, chunks)]

    def _dummy(self) -> Sample:
        """A sequence that trains nothing (mask 0): runs the collectives of a pass on a rank
        with fewer micro-batches than another."""
        return Sample(id="", group_id="", prompt_ids=np.zeros(1, np.int64), response_ids=np.zeros(1, np.int64),
                      reward=0.0, policy_version=0, behaviour_logprobs=np.zeros(1, np.float32),
                      response_mask=np.zeros(1, np.float32))

    @torch.no_grad()
    def _unit_logprobs(self, model: Any, units: list[_Batch], chunks: list[int]) -> list[torch.Tensor]:
        """Log-probs of each unit without gradients; in a group every rank runs as many forward
        passes (padded with the dummy), as FSDP2 gathers the parameters in each."""
        extra = 0
        if self.world > 1:  # counted before any pass: each pass is a collective
            import torch.distributed as dist

            passes = [max(1, -(-int(b.attention_mask[0].sum()) // c)) if c else 1 for b, c in zip(units, chunks)]
            total = torch.tensor([sum(passes)])
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
            extra = int(total) - sum(passes)
        out = [self._forward(model, b, entropy=False, chunk=c)[0] for b, c in zip(units, chunks)]
        if extra:
            dummy = self._collate([self._dummy()])
            for _ in range(extra):
                self._forward(model, dummy, entropy=False)
        return out

    def _reference_logprobs(self, units: list[_Batch], chunks: list[int]) -> list[torch.Tensor]:
        """The KL reference's log-probs: the initial weights' copy, or with LoRA the base
        itself, its adapter switched off for these passes (PEFT's ``disable_adapter``)."""
        if not self.lora:
            return self._unit_logprobs(self.reference, units, chunks)
        with self.model.disable_adapter():
            return self._unit_logprobs(self.model, units, chunks)

    def logprobs(self, samples: Sequence[Sample]) -> list[np.ndarray]:
        """The current policy's log-probs of each sample's response tokens (rank 0 gets them)."""
        self._lead("logprobs", lambda: encode_samples(samples))
        samples = list(samples)
        was_training = self.model.training
        self.model.eval()
        try:
            units, chunks, _, packed = self._plan(samples)
            lps = self._unit_logprobs(self.model, self._collate_units(units, chunks, packed), chunks)
        finally:
            self.model.train(was_training)
        found = {s.id: lp[i].cpu().numpy() for u, lp in zip(units, lps) for i, s in enumerate(u)}
        return [found[s.id][:len(s.response_ids)].astype(np.float32) if s.id in found else
                np.zeros(0, np.float32) for s in samples]

    def advantages(self, samples: Sequence[Sample], masks: Sequence[np.ndarray],
                   kl: torch.Tensor | None = None, values: torch.Tensor | None = None) -> torch.Tensor:
        """Per-token advantages ``[B, longest response]`` of the mini-batch by
        ``cfg.adv_estimator``, from each reward on its response's last token, less
        ``kl_ctrl``'s coefficient times ``kl`` per token (``use_kl_in_reward``); ``values``: the
        critic's ``[B, longest response]`` (``gae``, whose returns it keeps for the critic)."""
        mask = torch.zeros((len(samples), max(max(len(m) for m in masks), 1)), dtype=torch.float32)
        for i, m in enumerate(masks):
            mask[i, :len(m)] = torch.from_numpy(m)
        rewards = losses.token_rewards(torch.tensor([s.reward for s in samples], dtype=torch.float32), mask)
        if kl is not None:
            rewards = rewards - self.kl_ctrl.value * kl * mask
        comps = None
        if self.cfg.adv_estimator == "gdpo":
            comps = torch.tensor([s.reward_components if s.reward_components is not None else [s.reward]
                                  for s in samples], dtype=torch.float32)
        baselines = None
        if self.cfg.adv_estimator == "remax":
            baselines = torch.tensor([s.reward if s.reward_baseline is None else s.reward_baseline for s in samples],
                                     dtype=torch.float32)
        opt = losses.AdvantageOptions(norm_adv_by_std_in_grpo=self.cfg.norm_adv_by_std_in_grpo, gamma=self.cfg.gamma,
                                      reward_components=comps, gdpo_reward_weights=self.cfg.gdpo_reward_weights,
                                      reward_baselines=baselines, lam=self.cfg.lam,
                                      values=None if values is None else values.cpu())
        if values is not None:
            self._returns = losses.gae_advantages_returns(rewards, values.cpu().to(rewards.dtype), mask,
                                                          self.cfg.gamma, self.cfg.lam)[1]
        return losses.ADV_ESTIMATORS[self.cfg.adv_estimator](rewards, mask, [s.group_id for s in samples], opt)

    def _reward_kl(self, samples: Sequence[Sample], masks: Sequence[np.ndarray], groups: list[list[Sample]],
                   units: list[_Batch], chunks: list[int],
                   current: list[torch.Tensor] | None) -> tuple[torch.Tensor, float]:
        """verl's KL in the reward: per token, KL(the policy before this update || the
        reference) by ``kl_penalty``, and its mean over sequences (what ``kl_ctrl`` adapts to).
        One rank holds every sample (``validate`` refuses it on several)."""
        current = current or self._unit_logprobs(self.model, units, chunks)
        refs = self._reference_logprobs(units, chunks)
        row = {s.id: (u, i) for u, g in enumerate(groups) for i, s in enumerate(g)}
        kl = torch.zeros((len(samples), max(max(len(m) for m in masks), 1)))
        for k, (s, m) in enumerate(zip(samples, masks)):
            u, i = row[s.id]
            n = len(m)
            kl[k, :n] = losses.kl_penalty(current[u][i, :n].float().cpu(), refs[u][i, :n].float().cpu(),
                                          self.cfg.kl_penalty) * torch.from_numpy(m)
        per_seq = kl.sum(-1) / (torch.tensor([float(m.sum()) for m in masks]) + 1e-8)
        return kl, float(per_seq.mean())

    def _rows(self, samples: Sequence[Sample], groups: list[list[Sample]], per_unit: list[torch.Tensor]
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

    def _mask_rows(self, masks: Sequence[np.ndarray]) -> torch.Tensor:
        full = torch.zeros((len(masks), max(max(len(m) for m in masks), 1)), device=self.device)
        for i, m in enumerate(masks):
            full[i, :len(m)] = torch.from_numpy(np.asarray(m, np.float32)).to(self.device)
        return full

    def _correction(self, samples: Sequence[Sample], masks: Sequence[np.ndarray], groups: list[list[Sample]],
                    current: list[torch.Tensor], behavs: list[torch.Tensor]) -> tuple[Any, list[tuple]]:
        """verl's decoupled rollout correction on the whole mini-batch (every rank alike): the
        weights and kept-token mask of each unit of this rank."""
        from streamrl.learner import rollout_correction

        corr = rollout_correction.correct(self._rows(samples, groups, current), self._rows(samples, groups, behavs),
                                          self._mask_rows(masks), self.cfg.rollout_correction)
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

    def _set_accumulation(self, local: bool, last: bool) -> None:
        """FSDP2 between micro-batches. Every pass syncs (ZeRO-3: gather for each forward,
        reduce-scatter after each backward) unless a rank chunks a long sequence: its passes
        differ in number from the others', so the parameters stay gathered and the gradients
        local until the last unit (a 1-token one on every rank), which reduce-scatters them."""
        if not self.sharded:
            return
        self.model.set_requires_gradient_sync(not local or last)
        self.model.set_reshard_after_backward(not local or last)
        self.model.set_reshard_after_forward(not local)

    # -- the update ---------------------------------------------------------------------------
    def set_version(self, version: int) -> None:
        """The learning rate of the updates towards version ``version + 1`` on every rank
        (``streamrl.learner.schedule``); called before each step, a no-op while it stays."""
        if version == self.version:
            return
        from streamrl.learner.schedule import lr_at

        self._lead("version", str(version).encode())
        self.version = version
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.cfg, version)

    def step(self, samples: Sequence[Sample]) -> dict[str, float]:
        """One mini-batch: ``ppo_epochs`` optimizer steps over ``samples``. Returns metrics
        (summed over the ranks: every rank normalises by the whole mini-batch's totals)."""
        self._lead("step", lambda: encode_samples(samples))
        cfg = self.cfg
        started = time.perf_counter()
        self._full_state = self._adapter = None
        self.forward_tokens = []
        samples = sorted(samples, key=lambda s: s.id)  # arrival order must not change the math
        masks = [np.ones(len(s.response_ids), np.float32) if s.response_mask is None else
                 np.asarray(s.response_mask, np.float32) for s in samples]
        total_tokens = torch.tensor(max(1.0, float(sum(m.sum() for m in masks))), device=self.device)
        total_seqs = torch.tensor(max(1, sum(int(m.sum() > 0) for m in masks)), device=self.device)
        groups, chunks, local, packed = self._plan(samples)
        if local:
            groups, chunks = groups + [[self._dummy()]], chunks + [0]
        units = self._collate_units(groups, chunks, packed)
        current = None
        rc = cfg.rollout_correction
        rc_decoupled = rc.enabled and not rc.bypass_mode  # verl's decoupled mode: pi_old recomputed
        # (bypass mode with a batch normaliser: the mini-batch's weights at its start, one pass more)
        rc_prepass = rc.bypass_mode and bool(rc.rollout_is) and rc.rollout_is_batch_normalize
        if cfg.decoupled or rc_decoupled or rc_prepass or any(s.behaviour_logprobs is None for s in samples):
            current = self._unit_logprobs(self.model, units, chunks)  # the proximal policy (AReaL)
        behavs = []
        for u, g in enumerate(groups):
            behav = torch.zeros_like(units[u].mask)
            for i, s in enumerate(g):
                if s.behaviour_logprobs is None:
                    behav[i] = current[u][i]
                else:
                    behav[i, :len(s.behaviour_logprobs)] = _tensor(s.behaviour_logprobs, np.float32)
            behavs.append(behav)
        reward_kl, values = None, None
        if self.critic is not None:  # the critic's values at the update, whole on every rank
            critic_units = [self._collate(g, packed=False) for g in groups]
            old_values = self.critic.values(critic_units)
            values = self._rows(samples, groups, old_values)
        if cfg.use_kl_in_reward:
            kl_tokens, reward_kl = self._reward_kl(samples, masks, groups, units, chunks, current)
            beta = self.kl_ctrl.value
            adv_all = self.advantages(samples, masks, kl_tokens, values=values)
            self.kl_ctrl.update(reward_kl, len(samples))
        else:
            adv_all = self.advantages(samples, masks, values=values)
        adv_of = {s.id: adv_all[i] for i, s in enumerate(samples)}
        advs = [torch.stack([adv_of[s.id][:units[u].mask.shape[1]] if s.id in adv_of else
                             torch.zeros(units[u].mask.shape[1]) for s in g]).to(self.device)
                for u, g in enumerate(groups)]
        refs = self._reference_logprobs(units, chunks) if self.has_reference and cfg.kl_coef > 0 else None
        sums: dict[str, torch.Tensor] = {}
        extremes: dict[str, tuple[str, torch.Tensor]] = {}  # verl's MIN / MAX metrics: name -> (op, value)

        def add(name: str, value: torch.Tensor, reduce: str = "sum") -> None:
            value = value.detach().float()
            if reduce == "sum":
                sums[name] = sums.get(name, 0.0) + value
            else:
                prev = extremes.get(name)
                pick = torch.minimum if reduce == "min" else torch.maximum
                extremes[name] = (reduce, value if prev is None else pick(prev[1], value))

        scale = float(cfg.loss_scale_factor or max(len(m) for m in masks))
        agg = dict(total_tokens=total_tokens, total_seqs=total_seqs, scale=scale)
        opt = losses.LossOptions(
            clip_ratio_low=cfg.clip_ratio_low, clip_ratio_high=cfg.clip_ratio_high, clip_ratio_c=cfg.clip_ratio_c,
            clip_cov_ratio=cfg.policy_loss.clip_cov_ratio, clip_cov_lb=cfg.policy_loss.clip_cov_lb,
            clip_cov_ub=cfg.policy_loss.clip_cov_ub, kl_cov_ratio=cfg.policy_loss.kl_cov_ratio,
            ppo_kl_coef=cfg.policy_loss.ppo_kl_coef, tau_pos=cfg.tau_pos, tau_neg=cfg.tau_neg)
        tok = dict(total_tokens=total_tokens)
        critic_out: dict[str, float] = {}
        if self.critic is not None:  # its update on the returns, before the policy's (as verl's)
            row = {x.id: k for k, x in enumerate(samples)}
            rets = [torch.stack([self._returns[row[x.id], :b.mask.shape[1]] if x.id in row else
                                 torch.zeros(b.mask.shape[1]) for x in g]).to(self.device)
                    for g, b in zip(groups, critic_units)]
            grad = self.critic.update(critic_units, rets, old_values, agg, tok, self.world, add)
            trained = self._mask_rows(masks).cpu() > 0
            critic_out = {"critic/grad_norm": grad, "critic/lr": float(self.critic.optimizer.param_groups[0]["lr"]),
                          "critic/vf_explained_var": losses.explained_variance(values.cpu(), self._returns, trained),
                          "critic/values/mean": float(values.cpu()[trained].mean()),
                          "critic/returns/mean": float(self._returns[trained].mean())}
        corrected, corr_metrics, live = None, {}, None
        if rc_decoupled:  # the weights and rejection of the whole mini-batch, as verl's on its batch
            from streamrl.learner import rollout_correction

            corr, corrected = self._correction(samples, masks, groups, current, behavs)
            corr_metrics = corr.metrics
            kept = corr.mask
            agg.update(total_tokens=kept.sum().clamp(min=1.0), total_seqs=(kept.sum(-1) > 0).sum().clamp(min=1))
        elif rc.bypass_mode:
            from streamrl.learner import rollout_correction

            live = [None] * len(units)  # the live log-probs of the first epoch, for rollout_corr/*
            is_norm = None
            if rc_prepass:  # the mean weight over the whole mini-batch (every rank alike)
                full_behav, full_mask = self._rows(samples, groups, behavs), self._mask_rows(masks)
                weights, _ = rollout_correction.is_weights(self._rows(samples, groups, current) - full_behav, full_mask,
                                                           rc.rollout_is, rc.rollout_is_threshold)
                is_norm = rollout_correction.is_weight_mean(weights, full_mask, rc.rollout_is)
        grad_norm, skipped = 0.0, 0
        for _ in range(cfg.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for u, mb in enumerate(units):
                self._set_accumulation(local, last=u == len(units) - 1)
                logp, ent = self._forward(self.model, mb, entropy=True, chunk=chunks[u])
                adv = advs[u]
                if corrected is not None:  # verl's rollout correction, decoupled: clip around pi_old, weighted
                    weight, mask = corrected[u]
                    pl = losses.policy_loss(cfg.policy_loss.loss_mode, logp, current[u], adv, mask, opt, weight)
                elif live is not None:  # ... bypass: the behaviour log-probs are pi_old
                    if live[u] is None:
                        live[u] = logp.detach()
                    pl, mask = rollout_correction.bypass_loss(logp, behavs[u], adv, mb.mask, rc, cfg.clip_ratio_low,
                                                              cfg.clip_ratio_high, cfg.clip_ratio_c, is_norm)
                elif cfg.decoupled:  # the trust region around the proximal policy, weighted back to the behaviour one
                    weight, mask = losses.importance_weight(current[u], behavs[u], mb.mask, cap=cfg.is_cap,
                                                            mode=cfg.is_mode)
                    pl = losses.policy_loss(cfg.policy_loss.loss_mode, logp, current[u], adv, mask, opt, weight)
                else:
                    mask = mb.mask
                    pl = losses.policy_loss(cfg.policy_loss.loss_mode, logp, behavs[u], adv, mask, opt)
                pg = losses.aggregate(pl.loss, mask, pl.agg_mode or cfg.loss_agg_mode, **agg)
                entropy = losses.aggregate(ent, mb.mask, cfg.loss_agg_mode, **agg)
                loss = pg - cfg.entropy_coeff * entropy if cfg.entropy_coeff else pg
                if refs is not None and cfg.kl_coef > 0:
                    kl = losses.aggregate(losses.kl_penalty(logp, refs[u], cfg.kl_loss_type), mask,
                                          cfg.loss_agg_mode, **agg)
                    loss = loss + cfg.kl_coef * kl
                    add("kl", kl)
                if cfg.distillation.enabled:  # verl's distillation_ppo_loss: with or instead of the task's
                    old = current[u] if cfg.decoupled else behavs[u]
                    loss = self._distillation_loss(loss, mb, logp, old, mask, agg, add, tok)
                # FSDP2 averages gradients over the ranks; each rank's loss is its share of the
                # mini-batch's (global normaliser), so the sum is wanted: scale by the world size
                (loss * self.world if self.sharded else loss).backward()
                add("loss", loss)
                add("pg_loss", pg)
                add("entropy", entropy)
                add("clip_fraction", losses.aggregate(pl.clipped, mb.mask, "token-mean", **tok))
                add("ppo_kl", losses.aggregate(pl.approx_kl, mb.mask, "token-mean", **tok))
                add("is_weight", losses.aggregate(pl.is_weight, mb.mask, "token-mean", **tok))
            norm = torch.nn.utils.clip_grad_norm_(self.trainable,
                                                  cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
            grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
            if math.isfinite(grad_norm):
                self.optimizer.step()
            else:  # as verl: a non-finite gradient skips the step instead of poisoning Adam
                skipped += 1
                self.optimizer.zero_grad(set_to_none=True)
        self._set_accumulation(False, last=True)
        names = sorted(sums)
        totals = torch.stack([torch.as_tensor(sums[k]).reshape(()) for k in names]) if names else torch.zeros(0)
        if self.world > 1 and names:
            import torch.distributed as dist

            dist.all_reduce(totals)
        rewards = np.array([s.reward for s in samples], dtype=np.float64)
        out = {k: float(v) / cfg.ppo_epochs for k, v in zip(names, totals.cpu())}
        for name, (op, value) in sorted(extremes.items()):  # every rank adds the same names (inf when empty)
            if self.world > 1:
                import torch.distributed as dist

                dist.all_reduce(value, op=dist.ReduceOp.MIN if op == "min" else dist.ReduceOp.MAX)
            if math.isfinite(float(value)):
                out[name] = float(value)
        if reward_kl is not None:
            out.update(reward_kl_penalty=reward_kl, reward_kl_penalty_coeff=beta)
        valid = torch.cat([adv_all[i, :len(m)][torch.from_numpy(m) > 0] for i, m in enumerate(masks)])
        if valid.numel():  # verl's critic/advantages/*: over the response tokens that are trained
            out.update(advantages_mean=float(valid.mean()), advantages_max=float(valid.max()),
                       advantages_min=float(valid.min()))
        if reward_kl is not None:  # verl's critic/rewards: the score less the KL penalty
            out.update(rewards_mean=float(rewards.mean()) - beta * reward_kl)
        if live is not None:  # bypass: the mismatch of the policy at the mini-batch's start (first epoch)
            full = [self._rows(samples, groups, x) for x in (live, behavs)]
            corr_metrics = rollout_correction.correct(full[0], full[1], self._mask_rows(masks), rc, is_norm).metrics
        out.update(corr_metrics)
        if self.critic is not None:  # its sums are over its own epochs
            epochs = cfg.critic.ppo_epochs or cfg.ppo_epochs
            out.update({k: v * cfg.ppo_epochs / epochs for k, v in out.items() if k.startswith("critic/")})
            out.update(critic_out)
        if cfg.adv_estimator == "gdpo":  # verl's gdpo/<key>/mean, std
            comps = np.array([s.reward_components for s in samples], dtype=np.float64)
            for k, key in enumerate(cfg.gdpo_reward_keys):
                out.update({f"gdpo/{key}/mean": float(comps[:, k].mean()), f"gdpo/{key}/std": float(comps[:, k].std())})
        out.update(lr=float(self.optimizer.param_groups[0]["lr"]))
        out.update(grad_norm=grad_norm, skipped_steps=float(skipped), tokens=float(total_tokens),
                   sequences=float(len(samples)), reward_mean=float(rewards.mean()),
                   reward_std=float(rewards.std()), step_seconds=time.perf_counter() - started)
        return out

    def _distillation_loss(self, task_loss: torch.Tensor, mb: _Batch, logp: torch.Tensor, old: torch.Tensor,
                           mask: torch.Tensor, agg: dict, add: Any, tok: dict) -> torch.Tensor:
        """One micro-batch's loss with the teacher's (``learner.distillation``, verl's
        ``distillation_loss``): aggregated over the mini-batch's totals like the policy loss, so
        micro-batches and ranks add up to the whole; metrics as verl's ``distillation/*``."""
        dl = self.cfg.distillation.distillation_loss
        if dl.use_topk:
            terms = losses.forward_kl_topk(mb.student_topk, mb.teacher_logprobs, dl.log_prob_min_clamp)
        else:
            terms = losses.estimator_distillation(logp, mb.teacher_logprobs, dl.loss_mode)
        distill = losses.distillation_loss(terms, mask, self.cfg.loss_agg_mode, logp=logp, old_logp=old,
                                           loss_max_clamp=dl.loss_max_clamp, use_policy_gradient=dl.use_policy_gradient,
                                           clip_low=dl.clip_ratio_low, clip_high=dl.clip_ratio_high, **agg)
        add("distillation/loss", distill)
        add("distillation/abs_loss", losses.aggregate(terms.losses.detach().abs(), mb.mask, "token-mean", **tok))
        # verl's distillation/loss_min and loss_max: the per-token loss before loss_max_clamp over
        # the response tokens, reduced as MIN / MAX over micro-batches and ranks
        valid = terms.losses.detach()[mb.mask > 0]
        none = valid.new_tensor(math.inf)  # a rank without response tokens still joins the reduction
        add("distillation/loss_min", valid.min() if valid.numel() else none, "min")
        add("distillation/loss_max", valid.max() if valid.numel() else -none, "max")
        for name, value in terms.diagnostics.items():
            add(f"distillation/{name}", losses.aggregate(value.detach(), mb.mask, "token-mean", **tok))
        return losses.combine_distillation(task_loss, distill, use_task_rewards=dl.use_task_rewards,
                                           coef=dl.distillation_loss_coef)

    # -- state --------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, Any]:
        """The whole model's weights on rank 0's CPU (gathered from the shards; once per version:
        kept until the next step). Every rank must call it; the others get ``{}``."""
        if not self.sharded:
            return self.model.state_dict()
        if self._full_state is None:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            self._full_state = get_model_state_dict(
                self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return self._full_state

    def adapter_state_dict(self) -> dict[str, Any]:
        """LoRA: the adapter's tensors whole on rank 0's CPU (gathered from the shards, only the
        adapter's bytes; once per version). Every rank must call it."""
        if self._adapter is None:
            from streamrl.learner import lora

            self._adapter = lora.adapter_state(self.model)
        return self._adapter

    def save_weights(self, directory: str | Path) -> Path:
        """What rollout workers load, at ``directory``, written by rank 0: the weights in Hugging
        Face layout (safetensors); with LoRA the adapter alone in PEFT's layout (on the base
        ``save_base`` wrote), or the base merged with it (``learner.lora.merge_for_servers``)."""
        from streamrl.weights import save_policy

        self._lead("weights", str(directory).encode())
        started = time.perf_counter()
        path = Path(directory)
        if self.lora:
            from streamrl.learner import lora

            if self.cfg.lora.merge_for_servers:
                state = self.full_state_dict()
                if self.rank == 0:
                    path = save_policy(lora.base_model(self.model), self.tokenizer, directory,
                                       state_dict=lora.merged_state(self.model, state))
            else:
                state = self.adapter_state_dict()
                if self.rank == 0:
                    path = lora.save_adapter(self.model, directory, state)
        elif not self.sharded:
            path = save_policy(self.model, self.tokenizer, directory)
        else:
            state = self.full_state_dict()
            if self.rank == 0:
                path = save_policy(self.model, self.tokenizer, directory, state_dict=dict(state))
        from streamrl import metrics

        metrics.LEARNER_WEIGHTS_PUBLISH_SECONDS.observe(time.perf_counter() - started)
        return path

    def save_base(self, directory: str | Path) -> Path:
        """LoRA: the frozen base in Hugging Face layout (with the tokenizer) at ``directory``, by
        rank 0; the adapters published each version apply to it. Written once per start."""
        from streamrl.learner import lora
        from streamrl.weights import save_policy

        self._lead("base", str(directory).encode())
        state = self.full_state_dict() if self.sharded else self.model.state_dict()
        if self.rank == 0:
            save_policy(lora.base_model(self.model), self.tokenizer, directory,
                        state_dict=lora.base_state(self.model, state))
        self._full_state = None  # (gathered for this alone: not kept)
        return Path(directory)

    def _dcp_options(self) -> Any:
        """LoRA: the DCP shards hold what trains (adapters) and its optimizer state, not the
        frozen base (it is the configured policy, loaded as at the first start)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(ignore_frozen_params=self.lora, strict=not self.lora)

    def write_checkpoint(self, directory: str | Path) -> None:
        """Into a checkpoint being written (``learner.checkpoint.save``): the weights as
        ``policy/`` (Hugging Face layout, rank 0; with LoRA the adapter, PEFT's layout) and model
        + optimizer state as sharded ``torch.distributed.checkpoint`` files in ``dcp/`` (each
        rank its shard; they load on any number of ranks)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        from streamrl.weights import save_policy

        self._lead("checkpoint", str(directory).encode())
        directory = Path(directory)
        if self.lora:
            from streamrl.learner import lora

            state = self.adapter_state_dict()
            if self.rank == 0:
                lora.save_adapter(self.model, directory / "policy", state)
        elif not self.sharded:
            save_policy(self.model, self.tokenizer, directory / "policy")
        else:
            state = self.full_state_dict()
            if self.rank == 0:
                save_policy(self.model, self.tokenizer, directory / "policy", state_dict=dict(state))
        options = self._dcp_options()
        state = {"model": get_model_state_dict(self.model, options=options)}
        if self.optimizer.state:  # (asking a fresh optimizer for its state would take a step)
            state["optim"] = get_optimizer_state_dict(self.model, self.optimizer, options=options)
        with _single_process_dcp():
            dcp.save(state, checkpoint_id=str(directory / "dcp"))
            if self.critic is not None:  # its weights and AdamW states, sharded as the policy's
                self.critic.save(directory / "critic_dcp")

    def load_checkpoint(self, directory: str | Path) -> None:
        """Model and optimizer state from a checkpoint's ``dcp/`` (written by any number of
        ranks), or its ``optimizer.pt`` (single-process checkpoints of earlier versions)."""
        directory = Path(directory)
        if (directory / "dcp").is_dir():
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                                 set_model_state_dict, set_state_dict)

            path = str(directory / "dcp")
            saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
            options = self._dcp_options()
            with _single_process_dcp():
                if any(k.startswith("optim.") for k in saved):
                    model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=options)
                    state = {"model": model_sd, "optim": optim_sd}
                    dcp.load(state, checkpoint_id=path)
                    set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                                   optim_state_dict=state["optim"], options=options)
                else:
                    state = {"model": get_model_state_dict(self.model, options=options)}
                    dcp.load(state, checkpoint_id=path)
                    set_model_state_dict(self.model, state["model"], options=options)
            if self.critic is not None and (directory / "critic_dcp").is_dir():
                with _single_process_dcp():
                    self.critic.load(directory / "critic_dcp")
        elif (directory / "optimizer.pt").is_file():
            self.optimizer.load_state_dict(torch.load(directory / "optimizer.pt", map_location=self.device,
                                                      weights_only=True))

    def optimizer_state(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_optimizer_state(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


@contextlib.contextmanager
def _single_process_dcp() -> Iterator[None]:
    """DCP without a process group is the single-process learner's normal case, not a warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# -- the wire format of mini-batches between ranks, and the ranks other than 0 -------------------
_ARRAYS = (("prompt_ids", np.int64), ("response_ids", np.int64),
           ("behaviour_logprobs", np.float32), ("response_mask", np.float32),
           ("teacher_logprobs", np.float32), ("teacher_ids", np.int64))


def encode_samples(samples: Sequence[Sample]) -> bytes:
    """Samples as bytes: a JSON header (ids, rewards, array lengths) and the arrays' raw bytes."""
    header, blobs = [], []
    for s in samples:
        entry: dict[str, Any] = {"id": s.id, "group_id": s.group_id, "reward": s.reward,
                                 "policy_version": s.policy_version, "teacher_topk": s.teacher_topk}
        for name in ("reward_components", "reward_baseline"):  # (optional: absent when None)
            if getattr(s, name) is not None:
                entry[name] = getattr(s, name)
        for name, dtype in _ARRAYS:
            value = getattr(s, name)
            if value is None:
                entry[name] = None
                continue
            arr = np.ascontiguousarray(value, dtype=dtype)
            entry[name] = len(arr)
            blobs.append(arr.tobytes())
        header.append(entry)
    head = json.dumps(header).encode()
    return len(head).to_bytes(8, "little") + head + b"".join(blobs)


def decode_samples(data: bytes) -> list[Sample]:
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    pos, out = 8 + n, []
    for entry in header:
        arrays = {}
        for name, dtype in _ARRAYS:
            count = entry.pop(name)
            if count is None:
                arrays[name] = None
                continue
            size = count * np.dtype(dtype).itemsize
            arrays[name] = np.frombuffer(data, dtype=dtype, count=count, offset=pos).copy()
            pos += size
        out.append(Sample(**entry, **arrays))
    return out


def follow(cfg: LearnerConfig) -> int:
    """A rank other than 0: build the trainer when rank 0 says from which checkpoint, then run
    what it sends until it says stop. SIGTERM and SIGINT are ignored (the launcher passes
    SIGTERM to every rank at a stop, a terminal's Ctrl-C reaches every process of its group;
    rank 0 drains and checkpoints, which needs this rank, then says stop); a dead rank 0 fails
    the next collective and ends this process."""
    from streamrl.learner import distributed

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    group = distributed.init(cfg)
    assert group is not None and not group.leader
    channel = distributed.Channel()
    trainer: Trainer | None = None
    while True:
        op, payload = channel.receive()
        if op == "init":
            trainer = Trainer(cfg, **json.loads(payload))
        elif op == "stop":
            break
        elif trainer is None:
            raise RuntimeError(f"learner rank {group.rank}: {op!r} before init")
        elif op == "step":
            trainer.step(decode_samples(payload))
        elif op == "logprobs":
            trainer.logprobs(decode_samples(payload))
        elif op == "weights":
            trainer.save_weights(payload.decode())
        elif op == "checkpoint":
            trainer.write_checkpoint(payload.decode())
        elif op == "base":
            trainer.save_base(payload.decode())
        elif op == "version":
            trainer.set_version(int(payload))
    import torch.distributed as dist

    dist.destroy_process_group()
    return 0


def _check_prompt(s: Sample) -> None:
    if len(s.prompt_ids) == 0:
        raise ValueError(f"record {s.id}: empty prompt_ids (the first response token "
                         "needs a prompt token to be predicted from)")


def _tensor(values: np.ndarray, dtype) -> torch.Tensor:
    """A copy as a tensor (record arrays are read-only views of the message bytes)."""
    return torch.from_numpy(np.array(values, dtype=dtype))
