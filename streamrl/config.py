"""The config machinery every section uses, and the sections every stage shares.

Each section is a dataclass with defaults. YAML files (``configs/*.yaml``) and command-line
``key.path=value`` overrides (as verl users write them) are merged onto the defaults by
OmegaConf, which rejects an unknown key or a wrong type naming the field, at start
(``load_section``, ``apply_override``, ``config_errors``). Here: the sections below the stages
(``bus``, ``metrics``, ``streamrl run``'s ``run``); each stage's own section lives with the
stage (``learner/config.py``, ``reward/config.py``, ...), and the whole pipeline's config,
which composes them all, sits above the stages in ``streamrl.pipeline_config``.
Secrets never live here: a config names the *environment variable* that holds them.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from streamrl.errors import ConfigError

T = TypeVar("T")

__all__ = ["ConfigError", "BusConfig", "MetricsConfig", "RunConfig", "TopicsConfig", "apply_override",
           "config_errors", "load_section", "to_yaml"]


@dataclass
class BusConfig:
    """How every stage talks to Kafka. ``bootstrap_servers`` empty means: the embedded broker."""

    # Kafka HOST:PORT[,...] (env STREAMRL_BOOTSTRAP_SERVERS, --bootstrap-servers); empty: the embedded broker
    bootstrap_servers: str = ""
    topic_prefix: str = "streamrl"  # topics <prefix>.prompts, ...; groups <prefix>-<stage>: one namespace per pipeline
    client_id: str = "streamrl"  # every client's Kafka client.id
    replication_factor: int = 0  # 0: take each topic file's own
    # Security. The password is read from the environment variable named here, never from a file.
    security_protocol: str = "PLAINTEXT"  # PLAINTEXT | SSL | SASL_PLAINTEXT | SASL_SSL
    sasl_mechanism: str = ""  # PLAIN | SCRAM-SHA-256 | SCRAM-SHA-512
    sasl_username: str = ""  # with sasl_mechanism set
    sasl_password_env: str = "STREAMRL_SASL_PASSWORD"  # the NAME of the environment variable holding the SASL password
    # Records of tens of KB to several MB (a 32k-token trajectory is ~400 KB).
    max_record_bytes: int = 16 * 1024 * 1024
    compression: str = "lz4"  # none | gzip | lz4 | zstd
    linger_ms: int = 5  # how long a producer waits to fill a batch (librdkafka linger.ms)
    max_batch_bytes: int = 1024 * 1024  # a producer batch's most bytes (librdkafka batch.size)
    # Consumer groups. Short sessions: the embedded broker holds each JoinGroup for half the
    # session timeout (DESIGN.md), and a dead member should be noticed in seconds, not a minute.
    session_timeout_ms: int = 6000
    heartbeat_interval_ms: int = 1000  # consumer-group heartbeats (well under session_timeout_ms)
    max_poll_interval_ms: int = 600_000  # not polling this long takes a member out of its group
    commit_interval_s: float = 1.0  # how often a consuming stage commits the offsets of finished records
    # A broker that does not answer is retried with backoff and reported once per interval;
    # after this long the run (`streamrl run`, and each stage verb) fails naming it. 0: wait forever
    unavailable_timeout_s: float = 300.0

    def topic(self, name: str) -> str:
        """The Kafka name of topic ``name``, given short (``rewarded``) or full
        (``streamrl.rewarded``), as users type either."""
        return self.topic_prefix + "." + self.short_topic(name) if self.topic_prefix else name

    def group(self, stage: str, configured: str = "") -> str:
        """A stage's consumer group: ``configured``, else ``<prefix>-<stage>`` (``streamrl-reward``),
        so two pipelines with different prefixes on one Kafka never share a group."""
        return configured or f"{self.topic_prefix or 'streamrl'}-{stage}"

    def short_topic(self, name: str) -> str:
        """``streamrl.rewarded`` -> ``rewarded``; a short name stays as it is."""
        prefix = self.topic_prefix + "."
        return name[len(prefix):] if self.topic_prefix and name.startswith(prefix) else name

    def sasl_password(self) -> str | None:
        return os.environ.get(self.sasl_password_env) if self.sasl_mechanism else None


@dataclass
class TopicConfig:
    """One topic as streamrl creates it, over its spec in ``topics/<name>.json``."""

    # 0: the spec's (8 for prompts, rollouts and rewarded). A consumer group is as parallel as
    # its topic's partitions: size it to the largest group you will run (docs: concepts/topics-and-records.md).
    partitions: int = 0


@dataclass
class TopicsConfig:
    """``topics.<name>.partitions``: the partitions streamrl creates each topic with (``streamrl
    run``, every stage's start, ``streamrl topics create``, the Kubernetes topics job). A topic
    that exists keeps its partitions: a count that differs is reported as drift, never applied
    (Kafka cannot shrink a topic, and the embedded broker cannot grow one)."""

    prompts: TopicConfig = field(default_factory=TopicConfig)  # streamrl.prompts, the prompt feed
    rollouts: TopicConfig = field(default_factory=TopicConfig)  # streamrl.rollouts: size it to the largest reward group
    rewarded: TopicConfig = field(default_factory=TopicConfig)  # streamrl.rewarded, read by the learner
    policy: TopicConfig = field(default_factory=TopicConfig)  # streamrl.policy (compacted): the versions announced
    deadletter: TopicConfig = field(default_factory=TopicConfig)  # streamrl.deadletter: what failed for good, and why
    eval: TopicConfig = field(default_factory=TopicConfig)  # the eval stage's results (topics/eval.json)
    distilled: TopicConfig = field(default_factory=TopicConfig)  # the teacher's annotated records (distillation)

    def validate(self) -> "TopicsConfig":
        """A ``ConfigError`` naming the field of a negative count (``load_config`` calls it, so
        a bad value fails at start)."""
        for name in ("prompts", "rollouts", "rewarded", "policy", "deadletter", "eval", "distilled"):
            configured = getattr(self, name).partitions
            if configured < 0:
                raise ConfigError(f"config field 'topics.{name}.partitions': {configured}; a topic needs "
                                  f"at least 1 partition (0: its spec's, in topics/{name}.json)")
        return self

    def partitions(self, name: str, spec_partitions: int) -> int:
        """Topic ``name``'s partitions: configured, else ``spec_partitions``."""
        self.validate()
        return getattr(self, name).partitions or spec_partitions


@dataclass
class MetricsConfig:
    """The Prometheus endpoint every long-running process serves (it prints the port at start)."""

    port: int = 0  # 0: pick a free port and print it
    # Loopback unless configured: metrics name topics, groups and hosts. The compose file and the
    # Kubernetes manifests set 0.0.0.0 so Prometheus can scrape them.
    host: str = "127.0.0.1"


@dataclass
class AutoscaleConfig:
    """The reward group sized by its consumer lag (``streamrl run --autoscale MIN:MAX``)."""

    min_members: int = 0  # 0: autoscaling off
    max_members: int = 0  # the most reward members the autoscaler runs
    scale_up_lag: int = 200  # records waiting in rollouts, for window_s, add a member
    scale_down_lag: int = 0  # at or below this, for window_s, remove one
    window_s: float = 5.0  # how long lag must stay above (below) a bound before a member is added (removed)
    cooldown_s: float = 15.0  # at most one change per this long (a rebalance needs a few seconds to settle)


@dataclass
class RayConfig:
    """``streamrl run --launcher ray``: where Ray is, what each stage's actor asks for, and what
    reaches the stages on other nodes (``streamrl.supervisor.ray_launcher``)."""

    address: str = ""  # "" starts a local Ray; "auto", HOST:PORT or ray://HOST:PORT joins a cluster
    # A local Ray's logical CPUs; 0: this machine's, or what the stages ask for in all if more
    # (on one machine they share its cores, as under the local launcher)
    num_cpus: int = 0
    # What each stage's actor asks for, over the defaults (streamrl.supervisor.placement.DEFAULT_RESOURCES:
    # learner 1 CPU, rollout 1 CPU or 0.25 with backend openai, reward and feed 0.25 CPU, no GPU):
    # {feed|rollout|reward|learner: {num_cpus, num_gpus, memory_gb, <custom Ray resource>: n}}
    resources: dict[str, dict[str, float]] = field(default_factory=dict)
    # NAMES of environment variables passed from this shell to every stage (judge keys, the SASL
    # password, S3 credentials); their values are never logged or put in Ray's runtime_env
    env_vars: list[str] = field(default_factory=list)
    # A directory Ray uploads to every node (runtime_env working_dir) and the stages run in: a
    # source checkout, your scorer files. Empty: streamrl is installed on every node, and the
    # stages run in this directory where it exists on their node
    working_dir: str = ""
    # Before anything starts, check that the cluster can hold every stage (off for a cluster that
    # autoscales); a stage Ray has not placed after placement_timeout_s fails the run, named
    check_placement: bool = True
    placement_timeout_s: float = 120.0  # see check_placement


@dataclass
class RestartConfig:
    """``streamrl run`` restarts a stage that exits unexpectedly, with exponential backoff
    (``backoff_s``, doubling), at most ``max_restarts`` times within ``window_s``; past that the
    run fails."""

    max_restarts: int = 5  # restarts of one stage allowed within window_s
    backoff_s: float = 1.0  # the first restart's wait; doubles with each restart
    window_s: float = 300.0  # the window max_restarts counts in


@dataclass
class RunConfig:
    """``streamrl run``: how many processes of each stage, how they are launched, where the run
    writes."""

    launcher: str = "local"  # local | ray
    # The entry module a verl launch script ran (python -m MODULE; --verl-entry): it names the
    # recipe whose trainer it was, whose config defaults then apply before the script's keys; a
    # recipe whose algorithm streamrl does not train is refused naming it (streamrl.verl.entries).
    # Empty: verl.trainer.main_ppo
    verl_entry: str = ""
    reward_members: int = 2  # processes in the reward consumer group (the start size when autoscaling)
    # processes in each teacher's consumer group (distillation.enabled; a teacher_models entry's members overrides)
    teacher_members: int = 1
    rollout_workers: int = 1  # rollout worker processes (a consumer group on prompts)
    out_dir: str = "runs"  # each run writes <out_dir>/<run id>/ (logs, checkpoints, weights, plot)
    status_interval_s: float = 1.0  # how often the live status line is redrawn
    timeout_s: float = 1800.0  # give up (and stop everything) after this long
    # With a generated task as feed.dataset (streamrl.tasks): a supervised pass of this many
    # steps first teaches the policy to read and write the task's format (its module says
    # what, and why RL needs it), written to <run>/warm_start and trained from there as
    # learner.policy and rollout.policy. 0: off, the policies as configured.
    warm_start_steps: int = 0
    autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    # distillation: each teacher's group sized by its own lag on the teacher's input, from its
    # start size (run.teacher_members, or its entry's members) between these bounds; off unless max_members
    teacher_autoscale: AutoscaleConfig = field(default_factory=AutoscaleConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    restart: RestartConfig = field(default_factory=RestartConfig)
    # A deliberate stop (scale-down, Ctrl-C, end of run) waits this long for a stage to drain and
    # checkpoint before SIGKILL: longer than reward.drain_timeout_s and a learner checkpoint.
    stop_timeout_s: float = 90.0
    # Continue a stopped run (verl's trainer.resume_mode / resume_from_path): auto (the newest
    # unfinished run under out_dir, else a new one), never (always a new run), or a run directory
    resume: str = "auto"
    # Nothing waits in silence: when no figure of the status line moves for stall_warn_s, it says
    # which stage waits on what; stall_timeout_s (0: off) ends such a run, rc 1, with that reason
    stall_warn_s: float = 60.0
    stall_timeout_s: float = 0.0  # see stall_warn_s; 0: off
    # At the end of a run, after the rollout workers stop, the reward group scores what is left
    # in rollouts for up to this long before it is stopped (then the learner)
    drain_timeout_s: float = 60.0
    # A stage that does not answer for this long (its metrics, or its Ray actor, silent: a
    # SIGSTOPped process, a frozen node) is killed and restarted like one that crashed; its
    # consumer group's other members take its partitions meanwhile. Well above a stage's
    # longest pause (a checkpoint, a model load), below Ray's own verdict on a node (~60 s).
    stage_timeout_s: float = 30.0

    def validate(self) -> None:
        if not self.stage_timeout_s > 0:
            raise ConfigError(f"config field 'run.stage_timeout_s': must be > 0 (got {self.stage_timeout_s})")


def override_tree(override: str) -> DictConfig:
    """``key.path=value`` as a config tree. ``key=`` is the empty string, as Hydra (and so verl)
    reads it: OmegaConf's dotlist reads it as None, which a string field refuses
    (``feed.data_source=``: every row's own data source)."""
    key, eq, value = override.partition("=")
    if eq and not value.strip():
        tree = OmegaConf.create()
        OmegaConf.update(tree, key.strip(), "", force_add=True)
        return tree
    return OmegaConf.from_dotlist([override])


def apply_override(merged: DictConfig, override: str) -> DictConfig:
    """One ``key.path=value`` onto the config, merged as in verl, except that a mapping given
    for a free-form mapping (``kwargs``, ``fallbacks``, ``run.ray.resources``, the scorer
    table) replaces it: ``reward.scorers.gsm8k.kwargs={}`` clears the kwargs, where a merge
    would keep every key the file gave. A config section (a dataclass) is still merged field by
    field."""
    parsed = override_tree(override)
    key = override.split("=", 1)[0].strip()
    value = OmegaConf.select(parsed, key)
    current = OmegaConf.select(merged, key, default=None)
    if isinstance(value, DictConfig) and isinstance(current, DictConfig) and OmegaConf.get_type(current) is dict:
        OmegaConf.update(merged, key, value, merge=False)
        return merged
    return OmegaConf.merge(merged, parsed)


@contextlib.contextmanager
def config_errors(where: str) -> Iterator[None]:
    """OmegaConf's errors as one-line ``ConfigError``s naming the field and ``where``."""
    try:
        yield
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        msg = getattr(exc, "msg", str(exc)).splitlines()[0]
        raise ConfigError(f"config field {key!r}{where}: {msg}" if key else f"config{where}: {msg}") from None


def load_section(schema: type[T], values: Any, where: str, source: str = "") -> T:
    """One config section (a dict, or a YAML node) checked against its dataclass ``schema``; a bad
    field is a ``ConfigError`` naming ``<where>.<field>`` (and ``source``, the file)."""
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), values))  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        msg = getattr(exc, "msg", str(exc)).splitlines()[0]
        raise ConfigError(f"config field '{where}.{key}'{f' in {source}' if source else ''}: {msg}") from None


def to_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
