"""The learner's config section (``learner:`` in a pipeline YAML).

Names follow verl where verl has one (``adv_estimator``, ``policy_loss.loss_mode``,
``clip_ratio_low``/``clip_ratio_high``/``clip_ratio_c``, ``loss_agg_mode``, ``kl_loss_type``,
``use_kl_in_reward``, ``kl_ctrl``, ``filter_groups``, ``entropy_coeff``, ``grad_clip``,
``ppo_epochs``, ``norm_adv_by_std_in_grpo``), and ``streamrl.verl.VERL_TABLE`` maps a verl config's
own keys (``algorithm.*``, ``actor_rollout_ref.actor.*``) onto them, so a verl user can read it; the streaming parts (staleness,
groups, mini-batches per version, checkpoints) are streamrl's own. ``validate`` runs at start and
names the field that is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from streamrl.distillation.config import DistillationConfig
from streamrl.errors import ConfigError
from streamrl.learner.objective_names import (ADV_ESTIMATORS, FIXED_AGG_MODES, GROUP_LOSSES, KL_TYPES, LOSS_AGG_MODES,
                                              LOSS_MODES)

ROUTER_REPLAY_MODES = ("disabled", "R2", "R3")  # streamrl.routing.MODES (here without importing it)
FILTER_METRICS = ("acc", "score", "seq_final_reward", "seq_reward")
KL_CTRL_TYPES = ("fixed", "adaptive")
IS_MODES = ("truncate", "mask")
MISSING_LOGPROBS = ("error", "recompute")
INCOMPLETE_GROUPS = ("drop", "train")
#: rollout correction's rejection options (``streamrl.learner.rollout_correction.RS_OPTIONS``)
RS_OPTION_NAMES = ("token_k1", "seq_sum_k1", "seq_mean_k1", "token_k2", "seq_sum_k2", "seq_mean_k2",
                   "token_k3", "seq_sum_k3", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
REMOVE_PADDING = ("auto", "true", "false")


def remove_padding_mode(value: Any) -> str:
    """``learner.use_remove_padding`` as one of ``REMOVE_PADDING`` (a YAML or verl boolean, or a
    string in any case: verl's scripts write ``True``)."""
    mode = str(value).strip().lower()
    if mode not in REMOVE_PADDING:
        raise ConfigError(f"config field 'learner.use_remove_padding': one of auto, true, false (got {value!r})")
    return mode


#: torch.optim's classes a config may name without torch being imported to check it
KNOWN_OPTIMIZERS = ("AdamW", "Adam", "SGD", "Adagrad", "Adamax", "NAdam", "RAdam", "RMSprop", "Adadelta", "ASGD",
                    "Rprop")
#: Megatron's names (verl's megatron ``optim.optimizer``): the torch class and the keywords the name
#: fixes (``adam``: Adam with decoupled weight decay, torch's AdamW; ``sgd``: Megatron's momentum 0.9)
MEGATRON_OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {"adam": ("AdamW", {}), "sgd": ("SGD", {"momentum": 0.9})}


def optimizer_class(name: str) -> tuple[str, dict[str, Any]]:
    """The torch.optim class that verl's ``optim.optimizer`` ``name`` means, and the keywords its
    name fixes; ``ValueError`` naming the choices for another (checked at start; torch is
    imported only for a name outside ``KNOWN_OPTIMIZERS``)."""
    if name in MEGATRON_OPTIMIZERS:
        return MEGATRON_OPTIMIZERS[name]
    if name in KNOWN_OPTIMIZERS:
        return name, {}
    try:
        import torch
    except ImportError:  # (no torch: the learner cannot run here; it checks the name at start)
        return name, {}
    cls = getattr(torch.optim, name, None)
    if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and cls is not torch.optim.Optimizer:
        return name, {}
    raise ValueError(f"a torch.optim optimizer ({', '.join(KNOWN_OPTIMIZERS)}, ...) or Megatron's adam / sgd; "
                     "Megatron's muon, 8-bit and other libraries' optimizers are not built in")
LR_SCHEDULERS = ("constant", "cosine")
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


@dataclass
class OptimizerConfig:
    """verl's ``optim.*`` (the actor's and the critic's, each its own): the optimizer
    (``streamrl.learner.optimizer``) and its learning rate over versions
    (``streamrl.learner.schedule``). FSDP's schedule by ``lr_scheduler_type``; Megatron's by
    ``lr_decay_style`` when that is set. ``learner.*`` and ``learner.critic.*`` hold the same
    fields."""

    lr: float = 1e-6  # the learning rate (verl's optim.lr)
    # a torch.optim class (verl FSDP's optim.optimizer: AdamW, Adam, SGD, ...); Megatron's adam
    # (decoupled weight decay: AdamW) and sgd (momentum 0.9) too
    optimizer: str = "AdamW"
    optimizer_impl: str = "torch.optim"  # the optimizer's module (verl's optim.optimizer_impl): torch.optim only
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # Adam's betas (an optimizer named *adam*)
    weight_decay: float = 0.01  # (decoupled, AdamW's) weight decay (verl's optim.weight_decay)
    grad_clip: float = 1.0  # max gradient norm (verl's optim.clip_grad); 0: off
    # more keywords of the optimizer (verl's optim.override_optimizer_config), e.g. {eps: 1e-6}
    override_optimizer_config: dict[str, Any] = field(default_factory=dict)
    # The schedule over versions, FSDP's (verl's lr_scheduler_type, warmup_style its older
    # name): constant | cosine; cosine decays over learner.versions, or where that is 0 (the
    # run ends with the data) over the versions the data makes (streamrl.learner.schedule.data_versions)
    lr_scheduler_type: str = "constant"
    lr_warmup_steps: int = -1  # versions of linear warm-up from 0; <= 0: lr_warmup_steps_ratio's
    lr_warmup_steps_ratio: float = 0.0  # warm-up as a share of learner.versions (Megatron's: of lr_decay_steps)
    min_lr_ratio: float = 0.0  # cosine: the floor, a share of lr
    num_cycles: float = 0.5  # cosine: waves over the run (0.5: one half-cosine down)
    zero_indexed_step: bool = True  # cosine: false counts the versions from 1 (verl's zero_indexed_step)
    # Megatron's schedule instead (verl's megatron optim.lr_decay_style): constant | linear |
    # cosine | inverse-square-root | WSD, after a linear warm-up from lr_warmup_init; "": FSDP's
    lr_decay_style: str = ""
    min_lr: float = 0.0  # Megatron's floor (an absolute rate)
    lr_warmup_init: float = 0.0  # Megatron's warm-up starts here
    lr_decay_steps: int = 0  # Megatron's decay length in versions; 0: learner.versions (verl: the run's steps)
    lr_wsd_decay_style: str = "exponential"  # WSD's anneal: exponential | linear | cosine | minus_sqrt
    lr_wsd_decay_steps: int = 0  # WSD's anneal length in versions (the last ones of lr_decay_steps)

    def needs_total(self) -> bool:
        """Whether the schedule counts versions towards the run's total (a cosine, a warm-up as a
        ratio, Megatron's decay without lr_decay_steps): what a run ending with the data counts at start."""
        ratio_warmup = self.lr_warmup_steps <= 0 and self.lr_warmup_steps_ratio > 0
        if self.lr_decay_style:
            return (self.lr_decay_style != "constant" or ratio_warmup) and not self.lr_decay_steps
        return self.lr_scheduler_type == "cosine" or ratio_warmup

    def validate_optimizer(self, prefix: str, versions: int | None) -> None:
        """Raise ``ConfigError`` naming the first bad field (``prefix``: ``learner.`` or
        ``learner.critic.``); ``versions``: the run's length (``learner.versions``, 0: open;
        None: the data's, counted at the learner's start, where the checks against it are made
        again with the count: a dry-run's dataset need not exist)."""

        def bad(name: str, why: str) -> None:
            raise ConfigError(f"config field '{prefix}{name}': {why} (got {getattr(self, name)!r})")

        if not self.lr > 0:
            bad("lr", "must be > 0")
        for name in ("weight_decay", "grad_clip", "min_lr", "lr_warmup_init", "lr_decay_steps", "lr_wsd_decay_steps"):
            if getattr(self, name) < 0:
                bad(name, "must be >= 0")
        if self.optimizer_impl != "torch.optim":
            bad("optimizer_impl", "torch.optim only (torchao's and bitsandbytes' optimizers are not built in)")
        try:
            optimizer_class(self.optimizer)
        except ValueError as exc:
            bad("optimizer", str(exc))
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            bad("betas", "two numbers in [0, 1)")
        if not isinstance(self.override_optimizer_config, dict):
            bad("override_optimizer_config", "a mapping of the optimizer's keyword arguments")
        if self.lr_scheduler_type not in LR_SCHEDULERS:
            bad("lr_scheduler_type", f"one of {', '.join(LR_SCHEDULERS)}")
        if self.lr_decay_style not in ("",) + LR_DECAY_STYLES:
            bad("lr_decay_style", f"one of {', '.join(LR_DECAY_STYLES)}, or empty (FSDP's lr_scheduler_type)")
        if self.lr_wsd_decay_style not in WSD_DECAY_STYLES:
            bad("lr_wsd_decay_style", f"one of {', '.join(WSD_DECAY_STYLES)}")
        if not 0 <= self.min_lr_ratio <= 1 or not 0 <= self.lr_warmup_steps_ratio <= 1:
            bad("min_lr_ratio", f"min_lr_ratio and lr_warmup_steps_ratio are in [0, 1] "
                f"(lr_warmup_steps_ratio {self.lr_warmup_steps_ratio})")
        ratio_warmup = self.lr_warmup_steps <= 0 and self.lr_warmup_steps_ratio > 0
        if self.lr_decay_style:
            decay = self.lr_decay_steps or versions
            if (self.lr_decay_style != "constant" or ratio_warmup) and decay == 0:
                bad("lr_decay_steps", f"lr_decay_style {self.lr_decay_style} decays over lr_decay_steps versions: "
                    "set it or learner.versions (or learner.end_with_data: the versions the data makes)")
            if self.lr_decay_style != "constant" and decay and (self.lr_warmup_steps if self.lr_warmup_steps > 0 else
                                                                 int(self.lr_warmup_steps_ratio * decay)) >= decay:
                bad("lr_warmup_steps", f"Megatron's warm-up ends before its decay does (lr_decay_steps {decay})")
            if self.lr_decay_style == "WSD" and not 0 < self.lr_wsd_decay_steps <= (decay or self.lr_wsd_decay_steps):
                bad("lr_wsd_decay_steps", "WSD anneals over the last lr_wsd_decay_steps of lr_decay_steps (> 0)")
            if not self.min_lr <= self.lr or not self.lr_warmup_init <= self.lr:
                bad("min_lr", f"min_lr and lr_warmup_init are at most lr (lr_warmup_init {self.lr_warmup_init})")
        elif (self.lr_scheduler_type == "cosine" or ratio_warmup) and versions == 0:
            raise ConfigError(f"config field 'learner.versions': {prefix}lr_scheduler_type {self.lr_scheduler_type} "
                              f"with lr_warmup_steps_ratio {self.lr_warmup_steps_ratio} counts versions towards a "
                              "total: set learner.versions, or learner.end_with_data for the versions the data "
                              "makes (got 0)")


@dataclass
class ParallelConfig:
    """How many processes train the policy (``streamrl.learner.distributed``): N ranks of one
    ``torch.distributed`` group, the model sharded with FSDP2. 1: one process, no group."""

    nproc: int = 1  # ranks on this node (torch.distributed.run --nproc-per-node)
    nnodes: int = 1  # nodes (each runs nproc ranks; torchrun / one pod per node on K8s)
    backend: str = ""  # "": gloo on CPU, nccl on CUDA (from learner.device)
    cpu_offload: bool = False  # FSDP2 CPUOffloadPolicy: parameters, gradients, optimizer states in host memory
    timeout_s: float = 1800.0  # a collective waiting longer than this fails the group


@dataclass
class PolicyLossConfig:
    """verl's ``actor.policy_loss``: which loss (a name ``streamrl.learner.losses``'
    ``register_policy_loss`` registered) and the knobs of Clip-Cov and KL-Cov."""

    loss_mode: str = "vanilla"  # vanilla | gspo | clip_cov | kl_cov | geo_mean | cispo | gpg | sapo | dppo_tv | dppo_kl | gvpo
    clip_cov_ratio: float = 0.0002  # Clip-Cov: the share of tokens whose gradient is clipped
    clip_cov_lb: float = 1.0  # Clip-Cov: the covariance's lower bound for picking tokens
    clip_cov_ub: float = 5.0  # Clip-Cov: its upper bound
    kl_cov_ratio: float = 0.0002  # KL-Cov: the share of tokens that get the KL penalty
    ppo_kl_coef: float = 0.1  # KL-Cov: the penalty's coefficient
    # GVPO (verl-recipe's gvpo, verl's actor.gvpo_beta): the KL coefficient of its objective, which
    # scales the policy's log-ratio to the reward's units (R_theta = beta log pi / pi_old); the
    # recipe's config file sets 0.1
    gvpo_beta: float = 0.1


@dataclass
class KLControlConfig:
    """verl's ``algorithm.kl_ctrl``: the coefficient of the KL penalty in the reward, fixed or
    adapted towards ``target_kl`` over ``horizon`` samples (Ziegler et al.)."""

    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001  # the KL-in-reward coefficient (the adaptive controller's start)
    horizon: int = 10000  # adaptive: samples over which the coefficient moves towards target_kl
    target_kl: float = 0.1  # adaptive: the KL the coefficient aims at


@dataclass
class FilterGroupsConfig:
    """DAPO's dynamic sampling (verl's ``algorithm.filter_groups``): a group whose ``metric``
    has no variance carries no gradient, so the learner drops it (dead letter ``filtered``,
    which the staleness gate counts as finished) before it counts towards a mini-batch."""

    enable: bool = False  # drop groups whose metric has no variance
    metric: str = "acc"  # acc | score | seq_final_reward | seq_reward (a reward_info field, or the reward)
    # verl's bound on generation batches: here, at most this many mini-batches' worth of groups
    # filtered per version; past it a flat group is trained (its advantages are 0). 0: no bound
    max_num_gen_batches: int = 0


@dataclass
class RolloutCorrectionConfig:
    """verl's ``algorithm.rollout_correction`` (``streamrl.learner.rollout_correction``): importance
    weights and rejection between the policy trained and the one that generated the records,
    and the ``rollout_corr/*`` mismatch figures. Off while ``rollout_is``, ``rollout_rs`` and
    ``bypass_mode`` are all unset."""

    rollout_is: str | None = None  # token | sequence: the weights' level; null: no weights
    rollout_is_threshold: str = "2.0"  # truncate above (TIS), or "lower_upper": zero outside (IcePop)
    rollout_is_batch_normalize: bool = False  # weights divided by their mean over the mini-batch
    rollout_rs: str | None = None  # rejection: token_k1, seq_mean_k3, ... comma-separated; null: none
    rollout_rs_threshold: str | None = None  # one bound for all options, or one per option (k1: "lower_upper")
    # no recomputation: the behaviour log-probs stand in for the old policy's (verl's bypass mode)
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"  # bypass mode's loss: ppo_clip | reinforce

    @property
    def enabled(self) -> bool:
        return bool(self.rollout_is or self.rollout_rs or self.bypass_mode)


@dataclass
class CriticConfig(OptimizerConfig):
    """verl's ``critic.*``: the value model of ``adv_estimator: gae`` (``streamrl.learner.critic``),
    trained in the learner's processes beside the policy, FSDP2-sharded as it is, with its own
    optimizer and schedule (verl's ``critic.optim.*``: ``OptimizerConfig``'s fields), micro-batches,
    offload and checkpoint (``critic_dcp/``)."""

    lr: float = 1e-5  # verl's critic.optim.lr
    model: str = ""  # its weights (verl's critic.model.path): "" the policy's; a fresh value head on top
    cliprange_value: float = 0.5  # the prediction is clipped to the update's values +- this in the loss
    # sequences per forward pass of the critic (verl's critic.ppo_micro_batch_size_per_gpu); 0: learner.micro_batch_size
    micro_batch_size: int = 0
    # the critic's token budget per forward pass (verl's critic.ppo_max_token_len_per_gpu with
    # use_dynamic_bsz); 0: learner.max_tokens_per_micro_batch
    max_tokens_per_micro_batch: int = 0
    # FSDP2's CPU offload of the critic's parameters, gradients and optimizer states (verl's
    # critic.fsdp.param_offload / optimizer_offload), apart from the policy's parallel.cpu_offload
    cpu_offload: bool = False
    ppo_epochs: int = 0  # passes over each mini-batch; 0: learner.ppo_epochs
    loss_agg_mode: str = ""  # the value loss's aggregation; "": learner.loss_agg_mode
    # changes to the critic model's config at load (verl's critic.model.override_config; the
    # policy's own are learner.override_config), as streamrl.policy.apply_overrides sets them
    override_config: dict[str, Any] = field(default_factory=dict)


@dataclass
class LoraConfig:
    """LoRA (``streamrl.learner.lora``): the policy wrapped with PEFT, only the adapters trained
    (gradients, AdamW states) and published each version; the frozen base is loaded once, in
    ``learner.dtype``, and is also the KL reference (the adapter switched off). verl's
    ``actor_rollout_ref.model.lora_rank`` / ``lora_alpha`` / ``target_modules`` map here."""

    rank: int = 0  # LoRA rank r (verl's lora_rank); 0: off, every weight is trained
    alpha: float = 16.0  # the adapter's scale is alpha / rank (verl's lora_alpha)
    # the modules that get an adapter: "all-linear" (every linear layer but the output head, as
    # verl's default), or names such as [q_proj, k_proj, v_proj, o_proj] (verl's target_modules)
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    dropout: float = 0.0  # dropout on the adapter's input while training (PEFT's lora_dropout)
    # publish the base merged with the adapter (full weights) each version instead of the
    # adapter alone: for inference servers that cannot load LoRA adapters
    merge_for_servers: bool = False

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass
class LearnerConfig(OptimizerConfig):
    """The learner: assembles complete groups from rewarded within the staleness bound, trains
    the policy with verl's objectives, checkpoints, and announces each version on policy."""

    # -- the model ----------------------------------------------------------------------------
    policy: str = "tiny"  # "tiny" or a local directory in Hugging Face layout
    device: str = "cpu"  # cpu | cuda | cuda:N
    dtype: str = "float32"  # parameters' dtype (the optimizer keeps them; bf16 for big models)
    seed: int = 0  # the tiny policy's init and the trainer's RNG
    temperature: float = 1.0  # the rollout's sampling temperature: log-probs are of logits / T
    # changes to the policy's config at load, for it and its KL reference (verl's
    # actor_rollout_ref.model.override_config: {max_position_embeddings: 8192}, {rope_scaling: {...}},
    # {attention_dropout: 0.1}); a mapping updates the sub-config of its name. The rollout applies
    # the same (rollout.override_config: the servers' --hf-overrides / --json-model-override-args)
    override_config: dict[str, Any] = field(default_factory=dict)

    # -- the objective (verl's names; streamrl.learner.losses) ---------------------------------
    # verl's algorithm.adv_estimator: grpo (normalised within each group), rloo, opo, grpo_passk,
    # gpg, reinforce_plus_plus, reinforce_plus_plus_baseline; or ppo: PPO-clip on rewards
    # whitened over the mini-batch (streamrl's, no critic; docs/guides/objective.md)
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True  # false: Dr. GRPO
    gamma: float = 1.0  # REINFORCE++'s and GAE's discount (verl's algorithm.gamma)
    lam: float = 1.0  # GAE's lambda (verl's algorithm.lam)
    critic: CriticConfig = field(default_factory=CriticConfig)  # adv_estimator gae's value model
    # verl's trainer.critic_warmup: the versions numbered below this train the critic alone (the
    # policy's weights stay, each such version is published unchanged), as verl's steps numbered
    # below it skip the actor's update; the policy's lr schedule starts at its first update. 0: off
    critic_warmup: int = 0
    # GDPO (adv_estimator gdpo): the reward components, fields of each record's reward_info (a
    # scorer's dict result), each normalised within its group, summed with these weights (empty: 1 each)
    gdpo_reward_keys: list[str] = field(default_factory=list)
    gdpo_reward_weights: list[float] = field(default_factory=list)  # one per gdpo_reward_keys entry; empty: 1 each
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    # the optimizer and its schedule (verl's actor.optim.*): OptimizerConfig's fields, here flat
    # (learner.lr, learner.betas, learner.lr_scheduler_type, ...)
    clip_ratio_low: float = 0.2  # PPO clip below: ratio >= 1 - clip_ratio_low (verl)
    clip_ratio_high: float = 0.2  # PPO clip above: ratio <= 1 + clip_ratio_high (DAPO's clip-higher: 0.28)
    clip_ratio_c: float = 3.0  # dual-clip bound for negative advantages (verl); 0 = off
    # Decoupled objective (AReaL): clip against a proximal policy (the weights when the
    # mini-batch is taken) and weight each token by pi_prox / pi_behaviour, truncated at
    # ``is_cap``; worth it when ``max_staleness`` is large. Off: clip against the behaviour
    # log-probs carried in the records (``is_cap`` unused).
    decoupled: bool = False
    is_cap: float = 2.0  # truncation of the importance weight pi_prox / pi_behaviour
    is_mode: str = "truncate"  # truncate: min(w, cap) (verl TIS) | mask: drop tokens w > cap (AReaL)
    # KL to the initial weights (the reference) in the loss (verl's kl_loss_coef with
    # use_kl_loss); 0 = none (no reference kept unless use_kl_in_reward)
    kl_coef: float = 0.0
    # kl|k1, abs, mse|k2, low_var_kl|k3, each with "+" for k2's gradient (straight-through)
    kl_loss_type: str = "low_var_kl"
    # KL in the reward (verl's algorithm.use_kl_in_reward, kl_penalty, kl_ctrl): each token's
    # reward less coef * KL(current policy before the update || reference)
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"  # the KL estimator of use_kl_in_reward (kl_loss_type's choices)
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    tau_pos: float = 1.0  # sapo's gate for positive advantages
    tau_neg: float = 1.05  # ... and for the others
    entropy_coeff: float = 0.0  # entropy bonus in the loss (verl's actor.entropy_coeff); 0: none
    # token-mean | seq-mean-token-mean | token-sum | seq-mean-token-sum | seq-mean-token-sum-norm
    loss_agg_mode: str = "token-mean"
    # seq-mean-token-sum-norm's constant (Dr. GRPO: the longest response allowed); 0: the
    # mini-batch's longest response
    loss_scale_factor: int = 0
    ppo_epochs: int = 1  # passes over each mini-batch
    micro_batch_size: int = 8  # sequences per forward pass (gradient accumulation)
    # Token budget of one forward pass (verl's ppo_max_token_len_per_gpu, use_dynamic_bsz):
    # packed, real tokens <= this (a balanced partition, longest first); padded, sequences x
    # padded length <= this. A longer sequence runs in chunks of this many tokens (KV cache kept
    # with its graph). 0: micro_batch_size sequences per forward.
    max_tokens_per_micro_batch: int = 0
    # Padding-free micro-batches (verl's actor_rollout_ref.model.use_remove_padding): the
    # sequences of a forward pass end to end in one row, each with its own position ids and
    # attention kept inside it (streamrl.learner.packing); log-probs, losses and gradients are
    # the padded path's. auto: packed where the model can pack (checked at start), else padded,
    # the start line says which and why; true: packed, or refused at start where the model
    # cannot; false: padded.
    use_remove_padding: str = "auto"
    # MoE router replay (streamrl.routing; verl's actor.{megatron,veomni}.router_replay.mode):
    # disabled: every pass routes by itself; R2: the old-log-prob pass before the update records
    # the learner's routing and the update's passes replay it; R3: the rollout's recorded routing
    # (a record's routed_experts; rollout.return_routed_experts, on by itself with R3) is replayed
    # in every policy pass (the KL reference routes by itself; a record without routing is routed
    # by the learner). The routing weights stay the learner's own.
    router_replay: str = "disabled"
    # FSDP2 mixed precision (N > 1 or CUDA): the dtype of the gathered parameters in forward /
    # backward and of the gradient reduction; master weights and AdamW states stay ``dtype``.
    # "": no mixed precision.
    param_dtype: str = ""
    reduce_dtype: str = ""  # ... and of the gradient reduction (see param_dtype)
    gradient_checkpointing: bool = False  # recompute activations in backward (HF models)
    # Refuse to start when parameters + gradients + AdamW states per rank (estimated from the
    # model config and the rank count) exceed this; 0: no check (the estimate is logged anyway).
    max_memory_gb: float = 0.0
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)  # LoRA adapters instead of full fine-tuning (rank 0: off)
    # A record without ``response_logprobs`` (or without token ids): ``error`` dead-letters it
    # (reason ``no_logprobs`` / ``no_tokens``); ``recompute`` tokenises the text if needed and
    # takes the current policy's log-probs as the behaviour ones (on-policy by assumption).
    missing_logprobs: str = "error"
    # on-policy distillation's loss: the pipeline's top-level ``distillation`` section (verl's
    # keys), set here by load_config (a YAML sets it there, not under learner:)
    distillation: DistillationConfig = field(default_factory=DistillationConfig)

    # -- streaming ----------------------------------------------------------------------------
    max_staleness: int = 1  # train at version v only on records with v - policy_version <= this
    groups_per_mini_batch: int = 4  # complete prompt groups per optimizer step
    mini_batches_per_version: int = 1  # optimizer steps per policy version (advantages are per mini-batch)
    group_timeout_s: float = 300.0  # an incomplete group older than this ...
    allow_partial_groups: bool = False  # ... trains as it is (True) or goes to dead letters
    # De-duplication: finished record ids (and closed groups) are remembered, and checkpointed,
    # for dedup_versions versions (0: max_staleness + 2) and at least dedup_seconds of the
    # learner's running time, then forgotten: a copy older than that is stale or cannot come
    # (streamrl.learner.assembler says why), so memory and checkpoints stay flat over a long
    # run. dedup_window caps the ids kept whatever the two say.
    dedup_versions: int = 0  # versions a finished id is kept (0: max_staleness + 2)
    dedup_seconds: float = 120.0  # and at least this long, of the learner's running time
    dedup_window: int = 100_000  # at most this many ids, whatever the two above say
    # Records the reward stage's group hook published unadjusted (its group timed out: status
    # incomplete / late in reward_info.group): mixing them with adjusted ones skews a batch, so
    # they are dropped (dead letter "incomplete_group") unless "train".
    incomplete_groups: str = "drop"
    max_abs_reward: float = 1e6  # a reward beyond this (or not finite) is refused (reward.bounds)
    max_response_tokens: int = 0  # a longer response is refused ("response_too_long"); 0: no limit
    versions: int = 0  # stop once the policy version reaches this (across restarts); 0 = never
    # verl's total_epochs: end when the feed's data ends (every prompt the ``feed`` section
    # publishes has its group trained or dead-lettered), after a last, possibly smaller,
    # version. The learner derives the feed's group ids from the same config (streamrl.learner.stage)
    end_with_data: bool = True
    # On start, seek to the offsets saved in the checkpoint (false when the topics are new: a
    # resumed run on the embedded broker, whose topics lived in memory; `streamrl run` sets it)
    checkpoint_offsets: bool = True
    consumer_group: str = ""  # "": <bus.topic_prefix>-learner

    # -- outputs ------------------------------------------------------------------------------
    checkpoint_dir: str = "runs/learner/checkpoints"  # streamrl run: <run>/checkpoints; shared by every rank
    # versions between checkpoints (offsets are committed with them); 0: at the end only (verl's save_freq -1)
    checkpoint_every: int = 1
    keep_checkpoints: int = 2  # the newest is loaded on restart; an older one if it is unreadable
    keep_weights: int = 4  # v<N> directories kept (rollout workers load the newest few)
    # v<N> directories kept besides those, for N a multiple of this (and 0): the eval stage loads
    # them, maybe late. 0: none; load_config sets it to eval.every when eval.dataset is set
    keep_every: int = 0
    weights_dir: str = "runs/learner/weights"  # v<N>/ per version; a shared filesystem on clusters
    # Also upload each version to <weights_uri>/v<N>/ (fsspec: s3://BUCKET/PATH, gs://...,
    # file:///shared/dir) and announce that URI, for rollout workers on other nodes; empty: they
    # load weights_dir's path (streamrl.weights)
    weights_uri: str = ""
    # Publish each version as the bitwise XOR of its tensors against the previous version's
    # (in the published dtype), compressed with zstd (streamrl.weights.delta): a few percent of
    # the bytes in bf16 at RL learning rates; readers reconstruct it bit-exactly. LoRA adapters
    # are published as they are. auto: on when weights_uri is set (the bytes cross a network or
    # a store), off for weights_dir alone, where it was measured not to pay (BENCHMARKS.md)
    weights_delta: str = "auto"  # auto | on | off
    weights_full_every: int = 10  # a full version every this many versions (the chain a late reader rebuilds)
    weights_delta_level: int = 1  # zstd's level (1 measured as small as 3 on weight deltas, faster)

    @property
    def delta_on(self) -> bool:
        """Whether versions are published by delta (``weights_delta``, ``auto`` resolved)."""
        mode = str(self.weights_delta).lower()
        return mode in ("on", "true") or (mode == "auto" and bool(self.weights_uri))

    def _validate_rollout_correction(self) -> None:
        rc = self.rollout_correction

        def bad(name: str, why: str) -> None:
            raise ConfigError(f"config field 'learner.rollout_correction.{name}': {why} "
                              f"(got {getattr(rc, name)!r})")

        if rc.rollout_is not in (None, "token", "sequence"):
            bad("rollout_is", "token, sequence or null")
        if rc.loss_type not in ("ppo_clip", "reinforce"):
            bad("loss_type", "ppo_clip or reinforce")
        if rc.enabled:
            try:
                parse_is_threshold(rc.rollout_is_threshold)
            except ValueError as exc:
                bad("rollout_is_threshold", str(exc))
            if rc.rollout_rs:
                try:
                    parse_rs(rc.rollout_rs, rc.rollout_rs_threshold)
                except ValueError as exc:
                    bad("rollout_rs", str(exc))
            if self.decoupled:
                bad("rollout_is", "rollout correction and learner.decoupled are two ways of the same correction: "
                    "choose one")

    def start_notes(self) -> list[str]:
        """What the learner says once at start about a config that trains another objective than
        its words suggest (a loss that fixes its aggregation; GSPO's paper aggregation)."""
        mode, agg = self.policy_loss.loss_mode, self.loss_agg_mode
        fixed = FIXED_AGG_MODES.get(mode)
        if fixed and fixed != agg:
            return [f"policy_loss.loss_mode {mode} aggregates {fixed} whatever loss_agg_mode says "
                    f"(as verl's does): loss_agg_mode {agg} applies to the entropy and KL terms only"]
        rc = self.rollout_correction
        if rc.bypass_mode and mode != "vanilla":
            return [f"rollout_correction.bypass_mode trains loss_type {rc.loss_type} (as verl's), not "
                    f"policy_loss.loss_mode {mode}"]
        if mode == "gspo" and agg != "seq-mean-token-mean":
            return [f"policy_loss.loss_mode gspo aggregates by loss_agg_mode ({agg}), as verl 0.9.1 does; the "
                    "GSPO paper's sequence-level objective is loss_agg_mode: seq-mean-token-mean"]
        return []

    def schedule_total(self) -> int | None:
        """The versions the lr schedule counts towards, as the config knows them (verl's
        total_training_steps): ``versions``; None where the run ends with the data (verl's
        ``len(train_dataloader) * total_epochs``, counted at the learner's start from the feed's
        data: ``streamrl.learner.schedule.data_versions``); 0: an open run, where a schedule that
        needs a total is refused."""
        return self.versions or (None if self.end_with_data else 0)

    def validate(self) -> "LearnerConfig":
        """Raise ``ConfigError`` naming the first bad field."""
        self._validate_choices()
        self.use_remove_padding = remove_padding_mode(self.use_remove_padding)
        self._validate_numbers()
        self._validate_rollout_correction()
        self._validate_objective()
        self._validate_precision_and_ranks()
        self._validate_lora()
        if self.distillation.enabled and not self.distillation.distillation_loss.use_task_rewards \
                and self.filter_groups.enable:  # every reward is 0 then: every group would be filtered
            raise ConfigError("config field 'learner.filter_groups.enable': needs task rewards "
                              "(distillation.distillation_loss.use_task_rewards is false)")
        if self.weights_uri:
            from streamrl.weights import check_uri

            check_uri(self.weights_uri, "learner.weights_uri")
        return self

    def _bad(self, name: str, why: str) -> None:
        raise ConfigError(f"config field 'learner.{name}': {why} (got {getattr(self, name)!r})")

    def _validate_choices(self) -> None:
        """The fields that name one of a list (the estimator and the loss: a registry's)."""
        kl_types = [k + plus for k in KL_TYPES for plus in ("", "+")]
        choices = {"adv_estimator": ADV_ESTIMATORS, "loss_agg_mode": LOSS_AGG_MODES,
                   "kl_loss_type": kl_types, "kl_penalty": kl_types, "is_mode": IS_MODES,
                   "missing_logprobs": MISSING_LOGPROBS, "incomplete_groups": INCOMPLETE_GROUPS,
                   "policy_loss.loss_mode": LOSS_MODES, "kl_ctrl.type": KL_CTRL_TYPES,
                   "filter_groups.metric": FILTER_METRICS, "router_replay": ROUTER_REPLAY_MODES}
        for name, allowed in choices.items():
            section, _, key = name.rpartition(".")
            value = getattr(getattr(self, section) if section else self, key)
            if value not in allowed and name in _REGISTRIES:  # (one registered by the user's code)
                allowed = registered(name)
            if value not in allowed:
                raise ConfigError(f"config field 'learner.{name}': one of {', '.join(allowed)} (got {value!r})")

    def _validate_numbers(self) -> None:
        """Bounds of the numbers, and the lr schedule's."""
        for name in ("temperature", "is_cap", "max_abs_reward"):
            if not getattr(self, name) > 0:
                self._bad(name, "must be > 0")
        at_least_one = ("groups_per_mini_batch", "mini_batches_per_version", "ppo_epochs",
                        "micro_batch_size", "dedup_window", "keep_checkpoints",
                        "keep_weights", "weights_full_every")
        for name in at_least_one:
            if getattr(self, name) < 1:
                self._bad(name, "must be >= 1")
        non_negative = ("checkpoint_every", "keep_every", "max_staleness", "versions", "kl_coef", "entropy_coeff",
                        "dedup_versions", "dedup_seconds",
                        "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "group_timeout_s",
                        "max_response_tokens", "loss_scale_factor", "gamma", "tau_pos", "tau_neg", "critic_warmup")
        if str(self.weights_delta).lower() not in ("auto", "on", "off", "true", "false"):
            self._bad("weights_delta", "one of auto, on, off")
        if not 1 <= self.weights_delta_level <= 22:
            self._bad("weights_delta_level", "zstd's levels are 1 to 22")
        for name in non_negative:
            if getattr(self, name) < 0:
                self._bad(name, "must be >= 0")
        self.validate_optimizer("learner.", self.schedule_total())

    def _validate_objective(self) -> None:
        """What the estimator and the losses need: gae's critic, GDPO's components, the KL."""
        bad = self._bad
        if self.adv_estimator == "gae":
            critic = self.critic
            if critic.loss_agg_mode not in ("",) + LOSS_AGG_MODES:
                raise ConfigError(f"config field 'learner.critic.loss_agg_mode': one of {', '.join(LOSS_AGG_MODES)} "
                                  f"or empty (got {critic.loss_agg_mode!r})")
            critic.validate_optimizer("learner.critic.", self.schedule_total())
            for name in ("cliprange_value", "ppo_epochs", "micro_batch_size", "max_tokens_per_micro_batch"):
                if getattr(critic, name) < 0:
                    raise ConfigError(f"config field 'learner.critic.{name}': must be >= 0 (got {getattr(critic, name)!r})")
            if self.lora.enabled:
                bad("adv_estimator", "gae's critic is a full model: not with learner.lora")
        if not 0 <= self.lam <= 1:
            bad("lam", "GAE's lambda is in [0, 1]")
        if self.adv_estimator == "gdpo" and not self.gdpo_reward_keys:
            bad("gdpo_reward_keys", "adv_estimator gdpo names the reward components it normalises (reward_info fields)")
        if self.gdpo_reward_weights and len(self.gdpo_reward_weights) != len(self.gdpo_reward_keys):
            bad("gdpo_reward_weights", f"one weight per gdpo_reward_keys entry ({len(self.gdpo_reward_keys)})")
        if self.kl_ctrl.type == "adaptive" and self.kl_ctrl.horizon < 1:
            raise ConfigError(f"config field 'learner.kl_ctrl.horizon': must be >= 1 (got {self.kl_ctrl.horizon!r})")
        if self.clip_ratio_c and self.clip_ratio_c <= 1:
            bad("clip_ratio_c", "the dual-clip bound must be > 1 (or 0 for off)")
        mode = self.policy_loss.loss_mode
        if mode in GROUP_LOSSES:  # (GVPO: no importance ratio, so nothing to weigh or clip around)
            if self.decoupled:
                bad("decoupled", f"policy_loss.loss_mode {mode} has no importance ratio to decouple")
            if self.rollout_correction.enabled:
                raise ConfigError(f"config field 'learner.rollout_correction': policy_loss.loss_mode {mode} takes no "
                                  "importance weight (verl's recipe drops rollout_is_weights): turn rollout "
                                  "correction off")
            if not self.policy_loss.gvpo_beta > 0:
                raise ConfigError("config field 'learner.policy_loss.gvpo_beta': must be > 0 (got "
                                  f"{self.policy_loss.gvpo_beta!r})")

    def _validate_precision_and_ranks(self) -> None:
        """dtypes, token and memory budgets, ``parallel``."""
        if self.router_replay != "disabled" and self.gradient_checkpointing and self.max_tokens_per_micro_batch:
            raise ConfigError("config field 'learner.router_replay': with gradient_checkpointing, not with "
                              "max_tokens_per_micro_batch (a sequence longer than it runs in chunks, whose "
                              "recomputation in backward cannot be told apart to replay each its routing)")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            self._bad("dtype", "one of float32, bfloat16, float16")
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in ("", "float32", "bfloat16", "float16"):
                self._bad(name, "one of float32, bfloat16, float16 (or empty: no mixed precision)")
        for name in ("max_tokens_per_micro_batch", "max_memory_gb"):
            if getattr(self, name) < 0:
                self._bad(name, "must be >= 0 (0: off)")
        par = self.parallel
        for name in ("nproc", "nnodes"):
            if getattr(par, name) < 1:
                raise ConfigError(f"config field 'learner.parallel.{name}': must be >= 1 (got {getattr(par, name)!r})")
        if par.backend not in ("", "gloo", "nccl"):
            raise ConfigError(f"config field 'learner.parallel.backend': gloo, nccl or empty (got {par.backend!r})")
        if par.backend == "nccl" and not self.device.startswith("cuda"):
            raise ConfigError("config field 'learner.parallel.backend': nccl needs learner.device cuda "
                              f"(got device {self.device!r})")

    def _validate_lora(self) -> None:
        lora = self.lora
        if lora.rank < 0:
            raise ConfigError(f"config field 'learner.lora.rank': must be >= 0 (0: off) (got {lora.rank!r})")
        if lora.enabled:
            if not lora.alpha > 0:
                raise ConfigError(f"config field 'learner.lora.alpha': must be > 0 (got {lora.alpha!r})")
            if not 0 <= lora.dropout < 1:
                raise ConfigError(f"config field 'learner.lora.dropout': must be in [0, 1) (got {lora.dropout!r})")
            if not lora.target_modules or not all(isinstance(m, str) and m for m in lora.target_modules):
                raise ConfigError("config field 'learner.lora.target_modules': module names, or [all-linear] "
                                  f"(got {lora.target_modules!r})")


def parse_is_threshold(spec: str | float) -> tuple[float, float | None]:
    """``2.0`` (truncate above, TIS) or ``"0.5_2.0"`` (zero outside, IcePop): ``(upper, lower)``."""
    text = str(spec).strip()
    lower, _, upper = text.rpartition("_") if "_" in text else ("", "", text)
    up, low = float(upper), (float(lower) if lower else None)
    if up <= 0 or (low is not None and not 0 < low <= up):
        raise ValueError(f"rollout_is_threshold {spec!r}: a positive upper bound, or 'lower_upper' with "
                         "0 < lower <= upper")
    return up, low


def parse_rs(options: str, threshold: str | float | None) -> dict[str, tuple[float | None, float]]:
    """``rollout_rs`` (comma-separated, each once) with its ``rollout_rs_threshold`` (one for all,
    or one per option): option -> ``(lower, upper)``; k1 options take ``"lower_upper"`` (a lone
    upper ``u`` means ``1/u _ u``), the others an upper bound."""
    names = list(dict.fromkeys(o.strip() for o in str(options).split(",") if o.strip()))
    bad = [n for n in names if n not in RS_OPTION_NAMES]
    if not names or bad:
        raise ValueError(f"rollout_rs {options!r}: comma-separated options of {', '.join(RS_OPTION_NAMES)}")
    if threshold is None:
        raise ValueError("rollout_rs needs rollout_rs_threshold")
    specs = [s.strip() for s in str(threshold).split(",") if s.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(f"rollout_rs_threshold {threshold!r}: one threshold, or one per rollout_rs option")
    specs = specs * len(names) if len(specs) == 1 else specs
    out: dict[str, tuple[float | None, float]] = {}
    for name, spec in zip(names, specs):
        if name.endswith("k1"):
            low_s, _, up_s = spec.rpartition("_") if "_" in spec else (str(1.0 / float(spec)), "", spec)
            low, up = float(low_s), float(up_s)
            if not 0 < low <= up:
                raise ValueError(f"rollout_rs_threshold {spec!r} for {name}: 0 < lower <= upper")
            out[name] = (low, up)
        else:
            if "_" in spec or float(spec) <= 0:
                raise ValueError(f"rollout_rs_threshold {spec!r} for {name}: one positive upper bound")
            out[name] = (None, float(spec))
    return out


#: the fields whose names are the losses' registries' (``streamrl.learner.losses``)
_REGISTRIES = ("adv_estimator", "policy_loss.loss_mode")


def registered(field_name: str) -> tuple[str, ...]:
    """The names the losses' registry behind ``field_name`` holds (``adv_estimator``:
    ``register_adv_est``'s; ``policy_loss.loss_mode``: ``register_policy_loss``'s), built-in or
    registered by the user's code; the built-in ones alone where torch is not installed. Asked
    only for a name outside the built-in ones: importing the losses imports torch."""
    builtin = ADV_ESTIMATORS if field_name == "adv_estimator" else LOSS_MODES
    try:
        from streamrl.learner import losses
    except ImportError:  # (no torch: the learner cannot run here, and checks its names at start)
        return builtin
    return tuple(losses.ADV_ESTIMATORS if field_name == "adv_estimator" else losses.POLICY_LOSSES)

