"""The distillation sections of a pipeline config: ``distillation:`` (verl's keys and meaning:
``enabled`` and ``distillation_loss.*``) and ``teacher:`` (streamrl's teacher stage: which model
annotates, how many records at once, its consumer group).

Torch-free: ``streamrl run --dry-run`` and the learner's config check read it where torch is not
installed. The loss names are those ``streamrl.learner.losses.DISTILLATION_LOSSES`` registers
(``tests/distillation/test_distillation_losses.py`` checks the two agree).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from streamrl.errors import ConfigError

#: verl's single-sample KL estimators (the teacher's log-prob of the sampled token is enough)
ESTIMATOR_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
#: losses over the teacher's top-k distribution (the teacher's top-k log-probs and token ids)
TOPK_MODES = ("forward_kl_topk",)
LOSS_MODES = TOPK_MODES + ESTIMATOR_MODES
TEACHER_BACKENDS = ("transformers", "openai")


@dataclass
class DistillationLossConfig:
    """verl's ``distillation.distillation_loss`` (same names, same defaults as its YAML)."""

    loss_mode: str = "k3"  # forward_kl_topk | kl|k1 | abs | mse|k2 | low_var_kl|k3
    topk: Optional[int] = 32  # forward_kl_topk: the teacher's top-k log-probs per token
    # train on the task's reward too (the reward group scores, the teacher annotates): the
    # policy loss plus distillation_loss_coef times the distillation loss; false: the
    # distillation loss alone (no reward group runs)
    use_task_rewards: bool = True
    distillation_loss_coef: float = 1.0  # the distillation loss's weight beside the task's (use_task_rewards)
    loss_max_clamp: Optional[float] = None  # per-token loss clamped to [-c, c]; null: none
    log_prob_min_clamp: Optional[float] = None  # forward_kl_topk: log-probs clamped below; null: none
    # the negative per-token distillation loss as the advantage of a PPO-clip policy gradient
    # (Thinking Machines' on-policy distillation; k1 is meant for it); false: the loss is
    # backpropagated directly as a supervised loss (k3, forward_kl_topk)
    use_policy_gradient: bool = False
    policy_loss_mode: str = "vanilla"  # use_policy_gradient: the policy loss (verl supports vanilla only)
    clip_ratio: float = 0.2  # use_policy_gradient: PPO clip (verl's; the low/high ones below are used)
    clip_ratio_low: float = 0.2  # use_policy_gradient: the ratio's lower clip, 1 - clip_ratio_low
    clip_ratio_high: float = 0.2  # use_policy_gradient: the ratio's upper clip, 1 + clip_ratio_high

    @property
    def use_topk(self) -> bool:
        """Whether the loss needs the teacher's top-k (else its log-prob of the sampled token)."""
        return self.loss_mode in TOPK_MODES


@dataclass
class DistillationConfig:
    """verl's ``distillation`` section: on when ``enabled``; the teacher itself is ``teacher:``
    (verl's ``distillation.teacher_models.teacher_model.model_path`` maps to ``teacher.model``)."""

    enabled: bool = False  # on: streamrl run starts the teacher group, the learner reads the distilled topic
    distillation_loss: DistillationLossConfig = field(default_factory=DistillationLossConfig)  # verl's loss keys

    def validate(self) -> "DistillationConfig":
        """Raise ``ConfigError`` naming the first bad field (verl's own checks included)."""
        loss = self.distillation_loss
        name = "config field 'distillation.distillation_loss."
        if loss.loss_mode not in LOSS_MODES:
            raise ConfigError(f"{name}loss_mode': one of {', '.join(LOSS_MODES)} (got {loss.loss_mode!r})")
        if loss.use_topk and (loss.topk is None or loss.topk < 1):
            raise ConfigError(f"{name}topk': must be >= 1 for loss_mode {loss.loss_mode} (got {loss.topk!r})")
        if loss.policy_loss_mode != "vanilla":
            raise ConfigError(f"{name}policy_loss_mode': only vanilla, as in verl (got {loss.policy_loss_mode!r})")
        if not loss.use_policy_gradient and loss.loss_mode == "k1":  # verl refuses the literal k1 alone
            raise ConfigError(f"{name}loss_mode': k1 backpropagated directly has a gradient that does "
                              "not depend on the teacher (verl refuses it too): set use_policy_gradient true, "
                              "or use k3 / forward_kl_topk")
        if loss.loss_max_clamp is not None and not loss.loss_max_clamp > 0:
            raise ConfigError(f"{name}loss_max_clamp': must be > 0 or null (got {loss.loss_max_clamp!r})")
        if loss.distillation_loss_coef < 0:
            raise ConfigError(f"{name}distillation_loss_coef': must be >= 0 (got {loss.distillation_loss_coef!r})")
        return self


@dataclass
class TeacherConfig:
    """The teacher stage (``streamrl teacher``): a consumer group that attaches the teacher's
    log-probs to each record, scaled like the reward group (more members, KEDA on its lag)."""

    # transformers: a local model ("tiny", a Hugging Face directory or id that loads offline);
    # openai: a fleet of OpenAI-compatible servers (vLLM) asked for prompt_logprobs
    backend: str = "transformers"
    model: str = "tiny"  # the teacher (verl's distillation.teacher_models.teacher_model.model_path)
    device: str = "cpu"  # transformers: where the teacher runs (cpu, cuda, cuda:N)
    dtype: str = "float32"  # transformers: the teacher's parameters' dtype (bfloat16 for big teachers)
    seed: int = 0  # the tiny teacher's init
    temperature: float = 1.0  # log-probs of logits / temperature (the student's learner.temperature)
    servers: list[str] = field(default_factory=list)  # openai: base URLs (http://host:port/v1)
    timeout_s: float = 60.0  # openai: per request
    batch_size: int = 8  # records per forward pass (the transformers backend batches what is in flight)
    batch_wait_ms: float = 20.0  # how long the first record of a batch waits for others
    max_in_flight: int = 32  # records held at once by one member (back-pressure on the consumer)
    drain_timeout_s: float = 30.0  # at a stop, how long in-flight records may take
    max_attempts: int = 3  # a failing annotation is retried this many times, then dead-lettered
    group: str = ""  # consumer group id; "": <bus.topic_prefix>-teacher

    def validate(self) -> "TeacherConfig":
        if self.backend not in TEACHER_BACKENDS:
            raise ConfigError(f"config field 'teacher.backend': one of {', '.join(TEACHER_BACKENDS)} "
                              f"(got {self.backend!r})")
        if self.backend == "openai" and not self.servers:
            raise ConfigError("config field 'teacher.servers': the openai backend needs at least one server URL")
        for name in ("batch_size", "max_in_flight", "max_attempts"):
            if getattr(self, name) < 1:
                raise ConfigError(f"config field 'teacher.{name}': must be >= 1 (got {getattr(self, name)!r})")
        if not self.temperature > 0:
            raise ConfigError(f"config field 'teacher.temperature': must be > 0 (got {self.temperature!r})")
        return self
