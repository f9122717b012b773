"""The model and one update: the plan of a mini-batch's micro-batches over the ranks, the
forward passes (log-probs of the response tokens given ``prompt_ids + response_ids``: behaviour,
proximal, reference, the teacher's top-k), gradient accumulation over micro-batches, clipping
and the optimizer's step. torch + transformers, CPU or CUDA.

What each mini-batch is trained toward (advantages, KL in the reward, the critic's targets,
rollout correction, the losses) is ``objective``'s; the tensors of one forward pass are
``collate``'s. The learner owns exactly one ``Trainer``; ``stage`` hands it mini-batches of
``Sample``s (``samples``) and reads back the metrics of each step. Everything here is
synchronous (the stage runs it in a thread so the Kafka client keeps its group membership alive
during a long step). Next to it: the model's files (``checkpoint.ModelState``, which the trainer
holds), the ranks' wire format (``distributed``) and the ranks other than 0 (``ranks``).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from streamrl.errors import ConfigError
from streamrl.learner import checkpoint, collate, distributed, losses, microbatch
from streamrl.learner import optimizer as optim
from streamrl.learner.collate import Batch
from streamrl.learner.config import LearnerConfig, remove_padding_mode
from streamrl.learner.objective import Metrics, MiniBatch, Objective, annotated
from streamrl.learner.samples import Sample
from streamrl.policy import load_policy, model_overrides

log = logging.getLogger(__name__)


class Trainer:
    """One rank's trainer. Alone (``learner.parallel.nproc`` 1) it is the whole learner's model;
    in a group (``streamrl.learner.distributed``) its model is FSDP2-sharded, every rank gets the
    whole mini-batch, trains its token-balanced share and the gradients are summed over ranks,
    so the result is the one-process update. Rank 0 sends each collective call to the others
    first (``_lead``)."""

    def __init__(self, cfg: LearnerConfig, policy: str | None = None, resume: str | None = None,
                 data_versions: int = 0):
        """``policy``: where to load the weights from, else ``cfg.policy``; ``resume``: a
        checkpoint directory (weights from its ``policy/``, then its optimizer / DCP shards);
        ``data_versions``: the versions the feed's data makes (``schedule.data_versions``), the
        lr schedule's total where ``cfg.versions`` is 0 (verl's total_training_steps from the data)."""
        self.cfg = cfg
        # the schedule's total, checked now that it is known (the config's check left it open)
        self.total = cfg.versions or (data_versions if cfg.end_with_data else 0)
        if not cfg.versions and cfg.end_with_data:  # the data's total: the checks the config's left open
            for prefix, opt in (("learner.", cfg), ("learner.critic.", cfg.critic))[:2 if cfg.adv_estimator == "gae" else 1]:
                if opt.needs_total():
                    opt.validate_optimizer(prefix, self.total)
        self.group = distributed.init(cfg)
        self.world = self.group.world if self.group else 1
        self.rank = self.group.rank if self.group else 0
        if self.group is not None and self.group.leader:  # every rank loads the same weights and schedule
            distributed.Channel().send("init", json.dumps({"policy": policy, "resume": resume,
                                                           "data_versions": data_versions}).encode())
        self.lora = cfg.lora.enabled  # PEFT adapters on a frozen base (streamrl.learner.lora)
        if resume and not self.lora:  # (LoRA: the base as configured, the adapter from the DCP shards)
            policy = str(checkpoint.policy_dir(resume))
        spec = policy or cfg.policy
        self.memory_estimate = distributed.check_memory(cfg, spec, self.world)  # bytes per rank
        torch.manual_seed(cfg.seed)
        dev = self.group.device if self.group else cfg.device
        self.device = torch.device(dev)
        # verl's model.override_config: the policy's and its reference's config changed at load
        self.overrides = model_overrides(cfg.override_config)
        self.model, self.tokenizer = load_policy(spec, device=dev, dtype=cfg.dtype, seed=cfg.seed,
                                                 overrides=self.overrides, where="learner.override_config")
        self.model.to(dtype=getattr(torch, cfg.dtype))
        self.kl_ctrl = losses.KLController(cfg.kl_ctrl.kl_coef, cfg.kl_ctrl.type, cfg.kl_ctrl.target_kl,
                                           cfg.kl_ctrl.horizon)
        # The KL reference is the weights the run started from (verl: the initial actor); with
        # LoRA, the frozen base itself with the adapter off (``_reference_logprobs``)
        self.reference = None
        self.has_reference = cfg.kl_coef > 0 or cfg.use_kl_in_reward
        if self.has_reference and not self.lora:
            self.reference = (load_policy(cfg.policy, device=dev, dtype=cfg.dtype, seed=cfg.seed,
                                          overrides=self.overrides, where="learner.override_config")[0]
                              if spec != cfg.policy else copy.deepcopy(self.model)).eval()
            self.reference.requires_grad_(False)
        # MoE router replay (learner.router_replay): hooks on the policy's routers (the KL
        # reference, built above, routes by itself, as verl's)
        self.tap, self.route_shape, self._replay_off = None, None, False
        if cfg.router_replay != "disabled":
            from streamrl.routing import RouterTap, RoutingError

            try:
                self.tap = RouterTap(self.model)
            except RoutingError as exc:
                raise ConfigError(f"config field 'learner.router_replay': {cfg.router_replay}, but {exc}") from None
            self.route_shape = (self.tap.layers, self.tap.topk, self.tap.num_experts)
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
        # what each mini-batch is trained toward: advantages, the critic's targets, the losses
        self.objective = Objective(cfg, self.device, self.world, self.kl_ctrl)
        # only what trains has gradients and optimizer states (with LoRA: the adapters alone)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = optim.build_optimizer(self.trainable, cfg)  # verl's optim.optimizer, betas, ...
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
    def _collate(self, samples: Sequence[Sample], packed: bool = False) -> Batch:
        """The tensors of one forward pass (``packed``: one row without padding; the teacher's
        log-probs under distillation)."""
        dl = self.cfg.distillation
        topk = (dl.distillation_loss.topk if dl.distillation_loss.use_topk else 0) if dl.enabled else None
        batch = collate.collate(samples, self.device, self.model, self.tokenizer.pad_token_id, packed, topk,
                                self.objective.teacher_names)
        if self.cfg.router_replay == "R3":  # the rollout's routing, where the records carry it
            collate.routes(samples, batch, self.tap.layers, self.tap.topk)
        return batch

    def _replaying(self, model: Any, batch: Batch, lo: int = 0, hi: int | None = None) -> Any:
        """The policy's routers replaying ``batch.routes`` (rows ``lo:hi``) for the pass that
        follows; a no-op without routes, for another model, or while the replay is off (the KL
        reference that LoRA's base is)."""
        if (self.tap is None or batch.routes is None or model is not self.model or self._replay_off
                or self.tap.active):  # (already replaying: through a backward that recomputes, _micro_step)
            return contextlib.nullcontext()
        return self.tap.replaying(batch.routes[lo:hi], batch.route_mask[lo:hi])

    def _forward(self, model: Any, batch: Batch, entropy: bool,
                 chunk: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs ``[B, R]`` of the response tokens (at ``cfg.temperature``), and their
        entropies when asked. ``chunk`` > 0 (one sequence): forward passes of at most that many
        tokens, the KV cache of the earlier ones kept with its graph, so the result and its
        gradients are those of one pass."""
        if chunk:
            return self._forward_chunked(model, batch, entropy, chunk)
        self.forward_tokens.append(int(batch.input_ids.numel()))
        with self._replaying(model, batch):
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

    def _forward_chunked(self, model: Any, batch: Batch, entropy: bool,
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
            with self._replaying(model, batch, lo, hi):
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
    def _plan(self, samples: Sequence[Sample], micro_batch_size: int = 0, budget: int = 0,
              packable: bool = True) -> tuple[list[list[Sample]], list[int], bool, bool]:
        """This rank's micro-batches (samples; padded with a 1-token dummy so every rank runs
        as many), their chunk sizes (0: one pass), whether any rank chunks a sequence, and whether
        they are packed (``_packs``: every rank decides alike from the lengths). The sizes are the
        policy's (``learner.micro_batch_size``, ``max_tokens_per_micro_batch``) unless given (the critic's)."""
        cfg = self.cfg
        lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
        shares = microbatch.balance(lengths, self.world) if self.world > 1 else [list(range(len(samples)))]
        budget = budget or cfg.max_tokens_per_micro_batch
        packed = self._packs(lengths) if packable else False
        plans = []
        for share in shares:
            mbs = microbatch.split([lengths[i] for i in share], budget, micro_batch_size or cfg.micro_batch_size,
                                   packed=packed)
            plans.append([(tuple(share[j] for j in mb.indices), mb.chunks) for mb in mbs])
        if cfg.gradient_checkpointing:  # HF turns the KV cache off under checkpointing: one pass
            plans = [[(idx, 1) for idx, _ in plan] for plan in plans]
        chunked = any(c > 1 for plan in plans for _, c in plan)
        units = max(len(plan) for plan in plans)
        mine = plans[self.rank]
        dummy = collate.dummy()
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

    def _collate_units(self, groups: list[list[Sample]], chunks: list[int], packed: bool) -> list[Batch]:
        """Each unit's tensors: packed when the plan packs, except a chunked sequence (one
        sequence, no padding either way; its passes keep a KV cache, which packing has not)."""
        return [self._collate(g, packed=packed and not c) for g, c in zip(groups, chunks)]

    @torch.no_grad()
    def _unit_logprobs(self, model: Any, units: list[Batch], chunks: list[int],
                       record: bool = False) -> list[torch.Tensor]:
        """Log-probs of each unit without gradients; in a group every rank runs as many forward
        passes (padded with the dummy), as FSDP2 gathers the parameters in each. ``record``
        (router replay R2): each unit keeps the routing its pass chose (``Batch.routes``), which
        the update's passes replay."""
        extra = 0
        if self.world > 1:  # counted before any pass: each pass is a collective
            import torch.distributed as dist

            passes = [max(1, -(-int(b.attention_mask[0].sum()) // c)) if c else 1 for b, c in zip(units, chunks)]
            total = torch.tensor([sum(passes)])
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
            extra = int(total) - sum(passes)
        out = [self._recorded_pass(model, b, c) if record else self._forward(model, b, entropy=False, chunk=c)[0]
               for b, c in zip(units, chunks)]
        if extra:
            dummy = self._collate([collate.dummy()])
            for _ in range(extra):
                self._forward(model, dummy, entropy=False)
        return out

    def _recorded_pass(self, model: Any, batch: Batch, chunk: int) -> torch.Tensor:
        """One unit's log-probs, its routers' choices kept on it (R2's old-log-prob pass)."""
        with self.tap.recording():
            logp = self._forward(model, batch, entropy=False, chunk=chunk)[0]
            batch.routes = self.tap.stacked()
        batch.route_mask = torch.ones(batch.routes.shape[0], dtype=torch.bool, device=batch.routes.device)
        return logp

    def _reference_logprobs(self, units: list[Batch], chunks: list[int]) -> list[torch.Tensor]:
        """The KL reference's log-probs: the initial weights' copy, or with LoRA the base
        itself, its adapter switched off for these passes (PEFT's ``disable_adapter``), its
        routing its own (no router replay: verl's reference pass replays none)."""
        if not self.lora:
            return self._unit_logprobs(self.reference, units, chunks)
        self._replay_off = True
        try:
            with self.model.disable_adapter():
                return self._unit_logprobs(self.model, units, chunks)
        finally:
            self._replay_off = False

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
        """Per-token advantages ``[B, longest response]`` (``Objective.advantages``)."""
        return self.objective.advantages(samples, masks, kl, values)[0]

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
        """The learning rate of the updates towards version ``version + 1`` on every rank, the
        policy's and the critic's (``streamrl.learner.schedule``); called before each step, a
        no-op while it stays."""
        if version == self.version:
            return
        from streamrl.learner.schedule import lr_at

        self._lead("version", str(version).encode())
        self.version = version
        for group in self.optimizer.param_groups:  # (after a critic warm-up: from its first update, as verl's)
            group["lr"] = lr_at(self.cfg, max(0, version - max(0, self.cfg.critic_warmup - 1)), self.total)
        if self.critic is not None:
            for group in self.critic.optimizer.param_groups:
                group["lr"] = lr_at(self.cfg.critic, version, self.total)

    @property
    def warming_up(self) -> bool:
        """Whether the updates towards the version being made train the critic alone
        (``learner.critic_warmup``: verl's steps numbered below ``trainer.critic_warmup`` skip the
        actor's update; here the update towards version ``v + 1`` is verl's step ``v + 1``)."""
        return self.version is not None and self.version + 1 < self.cfg.critic_warmup

    def step(self, samples: Sequence[Sample]) -> dict[str, float]:
        """One mini-batch: ``ppo_epochs`` optimizer steps over ``samples`` (the critic's alone
        while ``warming_up``). Returns metrics (summed over the ranks: every rank normalises by
        the whole mini-batch's totals)."""
        self._lead("step", lambda: distributed.encode_samples(samples))
        started = time.perf_counter()
        self.state.forget()
        self.forward_tokens = []
        batch = self._prepare(samples)
        self._behaviour_logprobs(batch)
        self._step_advantages(batch)
        references = self._reference_logprobs(batch.units, batch.chunks) if self.has_reference and self.cfg.kl_coef > 0 else None
        metrics = Metrics()
        options = losses.LossOptions.from_config(self.cfg)
        if self.critic is not None:  # its update on the returns, before the policy's (as verl's)
            self._train_critic(batch, metrics)
        self.objective.prepare_correction(batch)
        grad_norm, skipped = 0.0, 0
        group_loss = losses.needs_group_baseline(self.cfg.policy_loss.loss_mode)
        for epoch in range(0 if self.warming_up else self.cfg.ppo_epochs):
            if group_loss:  # (gvpo) its groups' statistics at the weights this epoch trains from
                current = batch.proximal if epoch == 0 else self._unit_logprobs(self.model, batch.units, batch.chunks)
                self.objective.set_group_baselines(batch, current, metrics)
            self.optimizer.zero_grad(set_to_none=True)
            for u in range(len(batch.units)):
                self._micro_step(batch, u, options, references, metrics)
            grad_norm, skipped = self._optimizer_step(skipped)
        self._set_accumulation(False, last=True)
        out = self.objective.step_metrics(batch, metrics, critic=self.critic is not None)
        out.update(lr=float(self.optimizer.param_groups[0]["lr"]))
        if self.cfg.critic_warmup:  # 1 while the critic trains alone
            out.update(critic_warmup=float(self.warming_up))
        out.update(grad_norm=grad_norm, skipped_steps=float(skipped), tokens=float(batch.total_tokens),
                   sequences=float(len(batch.samples)), reward_mean=float(batch.rewards.mean()),
                   reward_std=float(batch.rewards.std()), step_seconds=time.perf_counter() - started)
        return out

    def _prepare(self, samples: Sequence[Sample]) -> MiniBatch:
        """The mini-batch in id order (arrival order must not change the maths), its totals, and
        this rank's units collated (with a last 1-token unit where a rank chunks a sequence)."""
        samples = sorted(samples, key=lambda s: s.id)
        masks = [np.ones(len(s.response_ids), np.float32) if s.response_mask is None else
                 np.asarray(s.response_mask, np.float32) for s in samples]
        total_tokens = torch.tensor(max(1.0, float(sum(m.sum() for m in masks))), device=self.device)
        total_seqs = torch.tensor(max(1, sum(int(m.sum() > 0) for m in masks)), device=self.device)
        groups, chunks, chunked, packed = self._plan(samples)
        if chunked:
            groups, chunks = groups + [[collate.dummy()]], chunks + [0]
        scale = float(self.cfg.loss_scale_factor or max(len(m) for m in masks))
        batch = MiniBatch(samples=samples, masks=masks, groups=groups, chunks=chunks, chunked=chunked,
                          units=self._collate_units(groups, chunks, packed), total_tokens=total_tokens,
                          totals=dict(total_tokens=total_tokens, total_seqs=total_seqs, scale=scale),
                          rewards=np.array([s.reward for s in samples], dtype=np.float64))
        if self.cfg.distillation.enabled:  # the distillation figures' normalisers (Objective.distillation_loss)
            tokens, seqs = annotated(samples, masks, self.device)
            batch.annotated_tokens = tokens
            batch.annotated_totals = dict(total_tokens=tokens, total_seqs=seqs, scale=scale)
        return batch

    def _behaviour_logprobs(self, batch: MiniBatch) -> None:
        """The log-probs each unit's tokens were sampled with (``behaviour``), and the current
        weights' before the update (``proximal``) where the objective or a record needs them:
        AReaL's decoupled objective, rollout correction's decoupled mode or its batch-normalised
        bypass, a record without log-probs (``missing_logprobs: recompute``), a group loss (GVPO,
        whose pi_old they are, as verl's recipe recomputes its old log-probs)."""
        cfg, rc = self.cfg, self.cfg.rollout_correction
        batch_normalised_bypass = rc.bypass_mode and bool(rc.rollout_is) and rc.rollout_is_batch_normalize
        needed = (cfg.decoupled or (rc.enabled and not rc.bypass_mode) or batch_normalised_bypass
                  or losses.needs_group_baseline(cfg.policy_loss.loss_mode)  # (gvpo's pi_old, as verl's recipe)
                  or any(s.behaviour_logprobs is None for s in batch.samples))
        if needed or cfg.router_replay == "R2":  # R2: this pass records the routing the update replays
            proximal = self._unit_logprobs(self.model, batch.units, batch.chunks, record=cfg.router_replay == "R2")
            batch.proximal = proximal if needed else None
        for u, group in enumerate(batch.groups):
            behaviour = torch.zeros_like(batch.units[u].mask)
            for i, s in enumerate(group):
                if s.behaviour_logprobs is None:
                    behaviour[i] = batch.proximal[u][i]
                else:
                    behaviour[i, :len(s.behaviour_logprobs)] = collate.tensor(s.behaviour_logprobs, np.float32)
            batch.behaviour.append(behaviour)

    def _step_advantages(self, batch: MiniBatch) -> None:
        """The forward passes the advantages need (the critic's values at the update; with KL in
        the reward, the policy's and the reference's log-probs), then the objective's
        advantages (``Objective.set_advantages``)."""
        if self.critic is not None:  # the critic's values at the update, whole on every rank
            c = self.cfg.critic
            if c.micro_batch_size or c.max_tokens_per_micro_batch:  # its own micro-batches (padded, whole)
                batch.critic_groups = self._plan(batch.samples, c.micro_batch_size, c.max_tokens_per_micro_batch,
                                                 packable=False)[0]
            else:
                batch.critic_groups = batch.groups
            batch.critic_units = [self._collate(g, packed=False) for g in batch.critic_groups]
            batch.old_values = self.critic.values(batch.critic_units)
        current = refs = None
        if self.cfg.use_kl_in_reward:
            current = batch.proximal or self._unit_logprobs(self.model, batch.units, batch.chunks)
            refs = self._reference_logprobs(batch.units, batch.chunks)
        self.objective.set_advantages(batch, current, refs)

    def _train_critic(self, batch: MiniBatch, metrics: Metrics) -> None:
        """adv_estimator gae: the critic's epochs on the returns of the advantages, and its
        metrics (verl's ``critic/*``)."""
        targets = self.objective.critic_targets(batch)
        grad = self.critic.update(batch.critic_units, targets, batch.old_values, batch.totals,
                                  dict(total_tokens=batch.total_tokens), self.world, metrics.add)
        self.objective.set_critic_metrics(batch, grad, float(self.critic.optimizer.param_groups[0]["lr"]))

    def _micro_step(self, batch: MiniBatch, u: int, options: losses.LossOptions,
                    references: list[torch.Tensor] | None, metrics: Metrics) -> None:
        """Unit ``u``'s forward pass, loss (``Objective.loss``) and backward pass; its gradients
        add to the mini-batch's."""
        self._set_accumulation(batch.chunked, last=u == len(batch.units) - 1)
        # router replay with gradient checkpointing: the backward's recomputation routes as the
        # forward did (a chunked unit never checkpoints with replay: LearnerConfig refuses it)
        recomputes = self.cfg.gradient_checkpointing and not batch.chunks[u]
        with self._replaying(self.model, batch.units[u]) if recomputes else contextlib.nullcontext():
            logp, ent = self._forward(self.model, batch.units[u], entropy=True, chunk=batch.chunks[u])
            loss = self.objective.loss(batch, u, logp, ent, options, references, metrics)
            # FSDP2 averages gradients over the ranks; each rank's loss is its share of the
            # mini-batch's (global normaliser), so the sum is wanted: scale by the world size
            (loss * self.world if self.sharded else loss).backward()

    def _optimizer_step(self, skipped: int) -> tuple[float, int]:
        """Clip the gradients and step; as verl, a non-finite gradient norm skips the step
        instead of poisoning Adam. Returns the norm and the steps skipped so far."""
        grad_norm = optim.clip_and_step(self.trainable, self.optimizer, self.cfg.grad_clip)
        return grad_norm, skipped + (not math.isfinite(grad_norm))

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

