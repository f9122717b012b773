"""The distillation sections of a pipeline config: ``distillation:`` (verl's keys and meaning:
``enabled`` and ``distillation_loss.*``) and ``teacher:`` (streamrl's teacher stage: which model
annotates, how many records at once, its consumer group).

Torch-free: ``streamrl run --dry-run`` and the learner's config check read it where torch is not
installed. The loss names are those ``streamrl.learner.losses.DISTILLATION_LOSSES`` registers
(``tests/distillation/test_distillation_losses.py`` checks the two agree).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from streamrl.errors import ConfigError

#: verl's single-sample KL estimators (the teacher's log-prob of the sampled token is enough)
ESTIMATOR_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
#: losses over the teacher's top-k distribution (the teacher's top-k log-probs and token ids)
TOPK_MODES = ("forward_kl_topk",)
LOSS_MODES = TOPK_MODES + ESTIMATOR_MODES
TEACHER_BACKENDS = ("transformers", "openai")
#: what becomes of a record whose data source no teacher serves (several teachers)
UNSERVED = ("train", "deadletter")
#: verl's name of the single teacher's entry, dropped when others are added (verl's note)
DEFAULT_TEACHER = "teacher_model"


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
class TeacherModelConfig:
    """One entry of verl's ``distillation.teacher_models`` (``key`` and ``model_path``, verl's
    names and meaning), with streamrl's settings for this teacher's consumer group over the
    ``teacher:`` section's (empty / 0 / null: the section's)."""

    key: Optional[str] = None  # the value of distillation.teacher_key (data_source) whose records it annotates
    model_path: Optional[str] = None  # the teacher model (teacher.model for this teacher)
    # verl's engine and replicas for the teacher, which verl launches: not applicable here (named
    # at start): the engine is backend / servers below, the replicas this teacher's group members
    num_replicas: Optional[int] = 0
    inference: dict[str, Any] = field(default_factory=dict)
    members: int = 0  # processes in this teacher's consumer group; 0: run.teacher_members
    backend: str = ""  # transformers | openai; "": teacher.backend
    servers: list[str] = field(default_factory=list)  # openai: this teacher's fleet; []: teacher.servers
    device: str = ""  # "": teacher.device
    dtype: str = ""  # "": teacher.dtype
    seed: Optional[int] = None  # the tiny teacher's init; null: teacher.seed
    group: str = ""  # consumer group id; "": <bus.topic_prefix>-teacher-<name>


@dataclass
class Teacher:
    """One teacher as it runs: its name (``--teacher NAME``; "" for a run's only teacher given
    by ``teacher:``), the routing key it serves ("default": every record, verl's single
    teacher), its stage settings (``teacher:`` with its entry's over them) and its group's size
    (0: ``run.teacher_members``)."""

    name: str
    key: str
    config: "TeacherConfig"
    members: int = 0
    own_group: str = ""  # its entry's group ("": named after the teacher section's)

    @property
    def label(self) -> str:
        """How figures and the status line name it (``teacher`` for the only one)."""
        return self.name or "teacher"

    def group(self, prefix_group: str) -> str:
        """The consumer group: its entry's, else ``<teacher.group or prefix-teacher>[-<name>]``:
        one group per teacher, whatever ``teacher.group`` says."""
        base = self.config.group or prefix_group
        return self.own_group or (f"{base}-{self.name}" if self.name else base)


@dataclass
class DistillationConfig:
    """verl's ``distillation`` section: on when ``enabled``; the teachers are verl's
    ``teacher_models`` (several: one per data source, routed by ``teacher_key``), or, without
    any, the one ``teacher:`` describes."""

    enabled: bool = False  # on: streamrl run starts the teacher groups, the learner reads the distilled topic
    distillation_loss: DistillationLossConfig = field(default_factory=DistillationLossConfig)  # verl's loss keys
    # verl's teachers by entry name: {key, model_path} each (and streamrl's per-teacher settings).
    # As in verl, the entry named teacher_model is the single teacher, dropped when others are
    # added (said at start): name several teacher_model1, teacher_model2, ...
    # (each entry read as a TeacherModelConfig, a bad field named, by ``entries``)
    teacher_models: dict[str, Any] = field(default_factory=dict)
    teacher_key: str = "data_source"  # the record field whose value picks the teacher (verl's)

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
        if not loss.use_policy_gradient and loss.loss_mode in ("k1", "kl"):
            raise ConfigError(f"{name}loss_mode': {loss.loss_mode} backpropagated directly has a gradient that does "
                              "not depend on the teacher (verl refuses it too): set use_policy_gradient true, "
                              "or use k3 / forward_kl_topk")
        if loss.loss_max_clamp is not None and not loss.loss_max_clamp > 0:
            raise ConfigError(f"{name}loss_max_clamp': must be > 0 or null (got {loss.loss_max_clamp!r})")
        if loss.distillation_loss_coef < 0:
            raise ConfigError(f"{name}distillation_loss_coef': must be >= 0 (got {loss.distillation_loss_coef!r})")
        if self.teacher_key not in _ROUTABLE:
            raise ConfigError(f"config field 'distillation.teacher_key': a record field of {', '.join(_ROUTABLE)} "
                              f"(got {self.teacher_key!r})")
        return self

    def entries(self) -> dict[str, TeacherModelConfig]:
        """verl's ``_resolve_teacher_models``: ``teacher_model`` alone is the single teacher;
        beside others it is dropped (``dropped``)."""
        from streamrl.config import load_section

        names = [n for n in self.teacher_models if n != DEFAULT_TEACHER or len(self.teacher_models) == 1]
        return {str(n): e if isinstance(e, TeacherModelConfig) else
                load_section(TeacherModelConfig, e or {}, f"distillation.teacher_models.{n}")
                for n, e in ((n, self.teacher_models[n]) for n in names)}

    @property
    def dropped(self) -> bool:
        """Whether verl's rule drops the ``teacher_model`` entry (others were added beside it)."""
        return DEFAULT_TEACHER in self.teacher_models and len(self.teacher_models) > 1

    @property
    def routed(self) -> bool:
        """Several teachers: each record goes to the one its ``teacher_key`` names."""
        return len(self.entries()) > 1

    def teachers(self, base: "TeacherConfig") -> dict[str, Teacher]:
        """Every teacher by name, its settings ``base`` (the ``teacher:`` section) with its
        entry's over them. No entry: one teacher, ``base`` itself (name ""). One entry: it
        serves every record, whatever its key (verl's routing with one teacher; its
        ``teacher_model`` entry's key is "default"); several: each its key's records, keys
        unique (verl's checks)."""
        entries = self.entries()
        if not entries:
            return {"": Teacher("", "default", base)}
        if len(entries) > 1 and base.unserved == "train" and not self.distillation_loss.use_task_rewards:
            raise ConfigError("config field 'teacher.unserved': train leaves a record no teacher serves nothing to "
                              "train on without task rewards (distillation_loss.use_task_rewards is false): "
                              "set deadletter")
        out: dict[str, Teacher] = {}
        keys: dict[str, str] = {}
        for name, entry in entries.items():
            where = f"config field 'distillation.teacher_models.{name}"
            if not _NAME.fullmatch(name):
                raise ConfigError(f"{where}': a teacher's name is letters, digits, _ and - (it names its consumer "
                                  f"group and processes)")
            if not entry.model_path:
                raise ConfigError(f"{where}.model_path': must be specified for a teacher (verl's check)")
            alone = name == DEFAULT_TEACHER  # verl's single teacher: key "default"
            if not alone and not entry.key:
                raise ConfigError(f"{where}.key': must be specified for a teacher: the {self.teacher_key} whose "
                                  f"records it annotates (verl's check)")
            key = "default" if alone else str(entry.key)
            if key in keys:
                raise ConfigError(f"{where}.key': duplicate teacher key {key!r} (also teacher {keys[key]!r})")
            keys[key] = name
            if entry.members < 0:
                raise ConfigError(f"{where}.members': must be >= 0 (got {entry.members})")
            over = {k: v for k, v in (("backend", entry.backend), ("servers", list(entry.servers)),
                                      ("device", entry.device), ("dtype", entry.dtype), ("seed", entry.seed))
                    if v not in ("", [], None)}
            config = replace(base, model=entry.model_path, **over)
            try:
                config.validate()
            except ConfigError as exc:
                raise ConfigError(str(exc).replace("config field 'teacher.", f"{where}.")) from None
            out[name] = Teacher(name, key, config, entry.members, entry.group)
        return out

    def notes(self) -> list[str]:
        """What is said at start about the teachers: verl's drop of ``teacher_model``, and the
        verl engine keys that are not applicable here."""
        out = []
        if self.dropped:
            others = ", ".join(n for n in self.teacher_models if n != DEFAULT_TEACHER)
            out.append(f"distillation.teacher_models.{DEFAULT_TEACHER} is dropped: as in verl, the single teacher's "
                       f"entry is removed when others are added ({others}); name it {DEFAULT_TEACHER}1 (or any "
                       f"other name) to keep it")
        for name, entry in self.entries().items():
            unused = [f"inference.{k}" for k in entry.inference] + (["num_replicas"] if entry.num_replicas else [])
            if unused:
                out.append(f"distillation.teacher_models.{name}.{{{','.join(unused)}}}: not applicable here (verl's "
                           f"engine and replicas: here backend / servers, and the group's members)")
        return out


#: record fields a teacher may be routed by (distillation.teacher_key)
_ROUTABLE = ("data_source",)
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*")


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
    # several teachers: which one of distillation.teacher_models this process is (streamrl teacher --teacher NAME)
    name: str = ""
    # several teachers (distillation.teacher_models): a record whose data source no teacher
    # serves is trained without distillation (train: its tokens add nothing to the distillation
    # loss) or dead-lettered (deadletter, reason no_teacher); the first teacher's group handles it
    unserved: str = "train"

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
        if self.unserved not in UNSERVED:
            raise ConfigError(f"config field 'teacher.unserved': one of {', '.join(UNSERVED)} (got {self.unserved!r})")
        return self
