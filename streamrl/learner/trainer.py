"""The model and one update: log-probs of the response tokens given ``prompt_ids +
response_ids``, advantages, the loss of ``losses``, gradient accumulation over micro-batches,
clipping and an AdamW step. torch + transformers, CPU or CUDA.

The learner owns exactly one ``Trainer``; ``stage`` hands it mini-batches of ``Sample``s
(``samples``) and reads back the metrics of each step. Everything here is synchronous (the stage
runs it in a thread so the Kafka client keeps its group membership alive during a long step).
Next to it: the model's files (``checkpoint.ModelState``, which the trainer holds), the ranks'
wire format (``distributed``) and the ranks other than 0 (``ranks``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from streamrl.errors import ConfigError
from streamrl.learner import checkpoint, distributed, losses, microbatch
from streamrl.learner.config import LearnerConfig, remove_padding_mode
from streamrl.learner.samples import Sample
from streamrl.policy import load_policy

log = logging.getLogger(__name__)


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
    # distillation: [B, 1] 1 for a sample the teacher annotated, 0 for one no teacher serves
    # (teacher.unserved: train: its tokens add nothing to the distillation loss)
    teacher_served: torch.Tensor | None = None
    teacher_of: torch.Tensor | None = None  # several teachers: [B, 1] each sample's teacher's index (-1: none)


@dataclass
class _MiniBatch:
    """One ``Trainer.step``'s mini-batch as this rank trains it, filled in by the step's named
    parts in order: the whole mini-batch's samples and totals, this rank's units (micro-batches)
    and what each part computes for them."""

    samples: list[Sample]  # the whole mini-batch, in id order
    masks: list[np.ndarray]  # each sample's tokens to train on
    groups: list[list[Sample]]  # each unit's samples (a 1-token dummy evens out the ranks' unit counts)
    chunks: list[int]  # each unit's chunk size (0: one forward pass)
    chunked: bool  # some rank chunks a sequence: gradients stay local until the last unit
    units: list[_Batch]  # each unit's tensors
    total_tokens: torch.Tensor  # the mini-batch's trained tokens (metrics' normaliser)
    totals: dict[str, Any]  # the policy loss's normalisers (``losses.aggregate``'s keywords)
    rewards: np.ndarray  # each sample's reward
    proximal: list[torch.Tensor] | None = None  # each unit's log-probs under the weights before the update
    behaviour: list[torch.Tensor] = field(default_factory=list)  # ... under the policy that sampled them
    advantages: torch.Tensor | None = None  # [B, R], the whole mini-batch's
    unit_advantages: list[torch.Tensor] = field(default_factory=list)
    reward_kl: float | None = None  # use_kl_in_reward: the mean KL to the reference, and its coefficient
    reward_kl_coef: float = 0.0
    critic_units: list[_Batch] | None = None  # gae: the critic's tensors, its values at the update
    old_values: list[torch.Tensor] | None = None
    values: torch.Tensor | None = None
    critic_metrics: dict[str, float] = field(default_factory=dict)
    corrected: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # rollout correction: weights, mask per unit
    live: list[torch.Tensor | None] | None = None  # bypass: each unit's log-probs in the first epoch
    is_norm: torch.Tensor | None = None  # bypass with a batch normaliser: the mean weight
    correction_metrics: dict[str, float] = field(default_factory=dict)


class _Metrics:
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


class Trainer:
    """One rank's trainer. Alone (``learner.parallel.nproc`` 1) it is the whole learner's model;
    in a group (``streamrl.learner.distributed``) its model is FSDP2-sharded, every rank gets the
    whole mini-batch, trains its token-balanced share and the gradients are summed over ranks,
    so the result is the one-process update. Rank 0 sends each collective call to the others
    first (``_lead``)."""

    def __init__(self, cfg: LearnerConfig, policy: str | None = None, resume: str | None = None):
        """``policy``: where to load the weights from, else ``cfg.policy``; ``resume``: a
        checkpoint directory (weights from its ``policy/``, then its optimizer / DCP shards)."""
        self.cfg = cfg
        self.group = distributed.init(cfg)
        self.world = self.group.world if self.group else 1
        self.rank = self.group.rank if self.group else 0
        if self.group is not None and self.group.leader:  # every rank loads the same weights
            distributed.Channel().send("init", json.dumps({"policy": policy, "resume": resume}).encode())
        self.lora = cfg.lora.enabled  # PEFT adapters on a frozen base (streamrl.learner.lora)
        if resume and not self.lora:  # (LoRA: the base as configured, the adapter from the DCP shards)
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
        self.forward_tokens: list[int] = []  # tokens of each forward pass of the last step (for tests/bench)
        # the weights and optimizer on disk: each version's weights, checkpoints, resuming
        self.state = checkpoint.ModelState(self)
        if resume:
            self.state.load_checkpoint(resume)

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
            distributed.Channel().send(op, payload() if callable(payload) else payload)

    # -- tensors ------------------------------------------------------------------------------
    @functools.cached_property
    def _teacher_names(self) -> list[str]:
        """Several teachers (``distillation.teacher_models``): their names, whose figures the
        step reports apart; [] otherwise."""
        d = self.cfg.distillation
        return list(d.entries()) if d.enabled and d.routed else []

    def _collate(self, samples: Sequence[Sample], packed: bool = False) -> _Batch:
        """The tensors of one forward pass (``packed``: one row without padding)."""
        batch = self._collate_packed(samples) if packed else self._collate_padded(samples)
        if self.cfg.distillation.enabled:
            batch.teacher_logprobs, batch.teacher_ids = self._teacher(samples, batch.mask.shape[1])
            batch.teacher_served = torch.tensor([[float(s.teacher_logprobs is not None)] for s in samples],
                                                device=self.device)
            names = self._teacher_names
            if names:
                batch.teacher_of = torch.tensor([[names.index(s.teacher_name) if s.teacher_name in names else -1]
                                                 for s in samples], device=self.device)
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
        self._lead("logprobs", lambda: distributed.encode_samples(samples))
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
        estimator = losses.get_adv_estimator_fn(self.cfg.adv_estimator)
        return estimator(rewards, mask, [s.group_id for s in samples], opt)

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
        self._lead("step", lambda: distributed.encode_samples(samples))
        started = time.perf_counter()
        self.state.forget()
        self.forward_tokens = []
        batch = self._prepare(samples)
        self._behaviour_logprobs(batch)
        self._step_advantages(batch)
        references = self._reference_logprobs(batch.units, batch.chunks) if self.has_reference and self.cfg.kl_coef > 0 else None
        metrics = _Metrics()
        options = losses.LossOptions.from_config(self.cfg)
        if self.critic is not None:  # its update on the returns, before the policy's (as verl's)
            self._train_critic(batch, metrics)
        self._prepare_correction(batch)
        grad_norm, skipped = 0.0, 0
        for _ in range(self.cfg.ppo_epochs):
            self.optimizer.zero_grad(set_to_none=True)
            for u in range(len(batch.units)):
                self._micro_step(batch, u, options, references, metrics)
            grad_norm, skipped = self._optimizer_step(skipped)
        self._set_accumulation(False, last=True)
        out = self._step_metrics(batch, metrics)
        out.update(lr=float(self.optimizer.param_groups[0]["lr"]))
        out.update(grad_norm=grad_norm, skipped_steps=float(skipped), tokens=float(batch.total_tokens),
                   sequences=float(len(batch.samples)), reward_mean=float(batch.rewards.mean()),
                   reward_std=float(batch.rewards.std()), step_seconds=time.perf_counter() - started)
        return out

    def _prepare(self, samples: Sequence[Sample]) -> _MiniBatch:
        """The mini-batch in id order (arrival order must not change the maths), its totals, and
        this rank's units collated (with a last 1-token unit where a rank chunks a sequence)."""
        samples = sorted(samples, key=lambda s: s.id)
        masks = [np.ones(len(s.response_ids), np.float32) if s.response_mask is None else
                 np.asarray(s.response_mask, np.float32) for s in samples]
        total_tokens = torch.tensor(max(1.0, float(sum(m.sum() for m in masks))), device=self.device)
        total_seqs = torch.tensor(max(1, sum(int(m.sum() > 0) for m in masks)), device=self.device)
        groups, chunks, chunked, packed = self._plan(samples)
        if chunked:
            groups, chunks = groups + [[self._dummy()]], chunks + [0]
        scale = float(self.cfg.loss_scale_factor or max(len(m) for m in masks))
        return _MiniBatch(samples=samples, masks=masks, groups=groups, chunks=chunks, chunked=chunked,
                          units=self._collate_units(groups, chunks, packed), total_tokens=total_tokens,
                          totals=dict(total_tokens=total_tokens, total_seqs=total_seqs, scale=scale),
                          rewards=np.array([s.reward for s in samples], dtype=np.float64))

    def _behaviour_logprobs(self, batch: _MiniBatch) -> None:
        """The log-probs each unit's tokens were sampled with (``behaviour``), and the current
        weights' before the update (``proximal``) where the objective or a record needs them:
        AReaL's decoupled objective, rollout correction's decoupled mode or its batch-normalised
        bypass, a record without log-probs (``missing_logprobs: recompute``)."""
        cfg, rc = self.cfg, self.cfg.rollout_correction
        batch_normalised_bypass = rc.bypass_mode and bool(rc.rollout_is) and rc.rollout_is_batch_normalize
        if (cfg.decoupled or (rc.enabled and not rc.bypass_mode) or batch_normalised_bypass
                or any(s.behaviour_logprobs is None for s in batch.samples)):
            batch.proximal = self._unit_logprobs(self.model, batch.units, batch.chunks)
        for u, group in enumerate(batch.groups):
            behaviour = torch.zeros_like(batch.units[u].mask)
            for i, s in enumerate(group):
                if s.behaviour_logprobs is None:
                    behaviour[i] = batch.proximal[u][i]
                else:
                    behaviour[i, :len(s.behaviour_logprobs)] = _tensor(s.behaviour_logprobs, np.float32)
            batch.behaviour.append(behaviour)

    def _step_advantages(self, batch: _MiniBatch) -> None:
        """The mini-batch's advantages (``advantages``; with the critic's values for ``gae``, the
        KL to the reference in the reward with ``use_kl_in_reward``, whose controller then
        adapts), and each unit's rows of them."""
        cfg, samples = self.cfg, batch.samples
        if self.critic is not None:  # the critic's values at the update, whole on every rank
            batch.critic_units = [self._collate(g, packed=False) for g in batch.groups]
            batch.old_values = self.critic.values(batch.critic_units)
            batch.values = self._rows(samples, batch.groups, batch.old_values)
        if cfg.use_kl_in_reward:
            kl_tokens, batch.reward_kl = self._reward_kl(samples, batch.masks, batch.groups, batch.units,
                                                         batch.chunks, batch.proximal)
            batch.reward_kl_coef = self.kl_ctrl.value
            batch.advantages = self.advantages(samples, batch.masks, kl_tokens, values=batch.values)
            self.kl_ctrl.update(batch.reward_kl, len(samples))
        else:
            batch.advantages = self.advantages(samples, batch.masks, values=batch.values)
        by_id = {s.id: batch.advantages[i] for i, s in enumerate(samples)}
        batch.unit_advantages = [
            torch.stack([by_id[s.id][:unit.mask.shape[1]] if s.id in by_id else torch.zeros(unit.mask.shape[1])
                         for s in group]).to(self.device)
            for group, unit in zip(batch.groups, batch.units)]

    def _train_critic(self, batch: _MiniBatch, metrics: _Metrics) -> None:
        """adv_estimator gae: the critic's epochs on the returns of the advantages, and its
        metrics (verl's ``critic/*``)."""
        row = {s.id: k for k, s in enumerate(batch.samples)}
        returns = self._returns
        targets = [torch.stack([returns[row[s.id], :unit.mask.shape[1]] if s.id in row else
                                torch.zeros(unit.mask.shape[1]) for s in group]).to(self.device)
                   for group, unit in zip(batch.groups, batch.critic_units)]
        grad = self.critic.update(batch.critic_units, targets, batch.old_values, batch.totals,
                                  dict(total_tokens=batch.total_tokens), self.world, metrics.add)
        trained = self._mask_rows(batch.masks).cpu() > 0
        values = batch.values.cpu()
        batch.critic_metrics = {
            "critic/grad_norm": grad, "critic/lr": float(self.critic.optimizer.param_groups[0]["lr"]),
            "critic/vf_explained_var": losses.explained_variance(values, returns, trained),
            "critic/values/mean": float(values[trained].mean()), "critic/returns/mean": float(returns[trained].mean())}

    def _prepare_correction(self, batch: _MiniBatch) -> None:
        """verl's rollout correction before the epochs. Decoupled: the weights and rejection of
        the whole mini-batch (as verl's on its batch), which also set the normalisers. Bypass:
        room for the first epoch's live log-probs, and with a batch normaliser the mean weight
        over the whole mini-batch (every rank alike)."""
        rc = self.cfg.rollout_correction
        if rc.enabled and not rc.bypass_mode:
            corr, batch.corrected = self._correction(batch.samples, batch.masks, batch.groups, batch.proximal,
                                                     batch.behaviour)
            batch.correction_metrics = corr.metrics
            kept = corr.mask
            batch.totals.update(total_tokens=kept.sum().clamp(min=1.0), total_seqs=(kept.sum(-1) > 0).sum().clamp(min=1))
        elif rc.bypass_mode:
            from streamrl.learner import rollout_correction

            batch.live = [None] * len(batch.units)
            if rc.bypass_mode and bool(rc.rollout_is) and rc.rollout_is_batch_normalize:
                behaviour, mask = self._rows(batch.samples, batch.groups, batch.behaviour), self._mask_rows(batch.masks)
                current = self._rows(batch.samples, batch.groups, batch.proximal)
                weights, _ = rollout_correction.is_weights(current - behaviour, mask, rc.rollout_is,
                                                           rc.rollout_is_threshold)
                batch.is_norm = rollout_correction.is_weight_mean(weights, mask, rc.rollout_is)

    def _micro_step(self, batch: _MiniBatch, u: int, options: losses.LossOptions,
                    references: list[torch.Tensor] | None, metrics: _Metrics) -> None:
        """Unit ``u``'s forward pass, loss (policy loss, entropy bonus, KL to the reference,
        distillation) and backward pass; its gradients add to the mini-batch's."""
        cfg, unit, totals = self.cfg, batch.units[u], batch.totals
        token_totals = dict(total_tokens=batch.total_tokens)
        self._set_accumulation(batch.chunked, last=u == len(batch.units) - 1)
        logp, ent = self._forward(self.model, unit, entropy=True, chunk=batch.chunks[u])
        policy, mask = self._policy_loss(batch, u, logp, options)
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
            loss = self._distillation_loss(loss, unit, logp, old, mask, totals, metrics.add, token_totals)
        # FSDP2 averages gradients over the ranks; each rank's loss is its share of the
        # mini-batch's (global normaliser), so the sum is wanted: scale by the world size
        (loss * self.world if self.sharded else loss).backward()
        metrics.add("loss", loss)
        metrics.add("pg_loss", pg_loss)
        metrics.add("entropy", entropy)
        metrics.add("clip_fraction", losses.aggregate(policy.clipped, unit.mask, "token-mean", **token_totals))
        metrics.add("ppo_kl", losses.aggregate(policy.approx_kl, unit.mask, "token-mean", **token_totals))
        metrics.add("is_weight", losses.aggregate(policy.is_weight, unit.mask, "token-mean", **token_totals))

    def _policy_loss(self, batch: _MiniBatch, u: int, logp: torch.Tensor,
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
        return losses.policy_loss(mode, batch.behaviour[u], logp, advantages, unit.mask, options), unit.mask

    def _optimizer_step(self, skipped: int) -> tuple[float, int]:
        """Clip the gradients and step; as verl, a non-finite gradient norm skips the step
        instead of poisoning Adam. Returns the norm and the steps skipped so far."""
        cfg = self.cfg
        norm = torch.nn.utils.clip_grad_norm_(self.trainable, cfg.grad_clip if cfg.grad_clip > 0 else math.inf)
        grad_norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:
            skipped += 1
            self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, skipped

    def _step_metrics(self, batch: _MiniBatch, metrics: _Metrics) -> dict[str, float]:
        """The step's metrics, reduced over the ranks (sums per epoch; verl's MIN / MAX ones),
        with verl's advantages, rewards, rollout correction, critic and GDPO figures."""
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

            live, behaviour = (self._rows(samples, batch.groups, x) for x in (batch.live, batch.behaviour))
            batch.correction_metrics = rollout_correction.correct(live, behaviour, self._mask_rows(masks),
                                                                  cfg.rollout_correction, batch.is_norm).metrics
        out.update(batch.correction_metrics)
        for name in self._teacher_names:  # verl's distillation/loss and abs_loss, by teacher
            tokens = out.pop(f"{_PER_TEACHER}{name}/tokens", 0.0)
            for part in ("loss", "abs_loss"):
                total = out.pop(f"{_PER_TEACHER}{name}/{part}", 0.0)
                if tokens > 0:
                    out[f"distillation/{name}/{part}"] = total / tokens
        if self.critic is not None:  # its sums are over its own epochs
            epochs = cfg.critic.ppo_epochs or cfg.ppo_epochs
            out.update({k: v * cfg.ppo_epochs / epochs for k, v in out.items() if k.startswith("critic/")})
            out.update(batch.critic_metrics)
        if cfg.adv_estimator == "gdpo":  # verl's gdpo/<key>/mean, std
            components = np.array([s.reward_components for s in samples], dtype=np.float64)
            for k, key in enumerate(cfg.gdpo_reward_keys):
                out.update({f"gdpo/{key}/mean": float(components[:, k].mean()),
                            f"gdpo/{key}/std": float(components[:, k].std())})
        return out

    def _distillation_loss(self, task_loss: torch.Tensor, unit: _Batch, logp: torch.Tensor, old: torch.Tensor,
                           mask: torch.Tensor, totals: dict, add: Any, token_totals: dict) -> torch.Tensor:
        """One micro-batch's loss with the teacher's (``learner.distillation``, verl's
        ``distillation_loss``): aggregated over the mini-batch's totals like the policy loss, so
        micro-batches and ranks add up to the whole; metrics as verl's ``distillation/*``."""
        dl = self.cfg.distillation.distillation_loss
        served = unit.teacher_served if unit.teacher_served is not None else 1.0
        mask, token_mask = mask * served, unit.mask * served  # a record no teacher serves: no distillation term
        if dl.use_topk:
            terms = losses.forward_kl_topk(unit.student_topk, unit.teacher_logprobs, dl.log_prob_min_clamp)
        else:
            terms = losses.estimator_distillation(logp, unit.teacher_logprobs, dl.loss_mode)
        distill = losses.distillation_loss(terms, mask, self.cfg.loss_agg_mode, logp=logp, old_logp=old,
                                           loss_max_clamp=dl.loss_max_clamp, use_policy_gradient=dl.use_policy_gradient,
                                           clip_low=dl.clip_ratio_low, clip_high=dl.clip_ratio_high, **totals)
        add("distillation/loss", distill)
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
        # from sums in _step_metrics so that micro-batches and ranks add up); every rank adds
        # every teacher's, so the reduction's names agree
        for i, name in enumerate(self._teacher_names):
            mine = token_mask * (unit.teacher_of == i) if unit.teacher_of is not None else token_mask * 0
            add(f"{_PER_TEACHER}{name}/tokens", mine.sum())
            add(f"{_PER_TEACHER}{name}/loss", (terms.losses.detach() * mine).sum())
            add(f"{_PER_TEACHER}{name}/abs_loss", (terms.losses.detach().abs() * mine).sum())
        return losses.combine_distillation(task_loss, distill, use_task_rewards=dl.use_task_rewards,
                                           coef=dl.distillation_loss_coef)

    # -- state (``checkpoint.ModelState``: what rank 0 and the followers call) ---------------------
    def save_weights(self, directory: str | Path) -> Path:
        """What rollout workers load (``ModelState.save_weights``)."""
        return self.state.save_weights(directory)

    def save_base(self, directory: str | Path) -> Path:
        """LoRA: the frozen base, once per start (``ModelState.save_base``)."""
        return self.state.save_base(directory)

    def write_checkpoint(self, directory: str | Path) -> None:
        """``policy/`` and the ranks' ``dcp/`` shards into a checkpoint being written
        (``ModelState.write_checkpoint``)."""
        self.state.write_checkpoint(directory)


#: the per-teacher sums a step's metrics carry until ``_step_metrics`` makes them means
_PER_TEACHER = "_distillation_by_teacher/"


def _check_prompt(s: Sample) -> None:
    if len(s.prompt_ids) == 0:
        raise ValueError(f"record {s.id}: empty prompt_ids (the first response token "
                         "needs a prompt token to be predicted from)")


def _tensor(values: np.ndarray, dtype) -> torch.Tensor:
    """A copy as a tensor (record arrays are read-only views of the message bytes)."""
    return torch.from_numpy(np.array(values, dtype=dtype))
