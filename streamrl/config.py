"""The pipeline's one config schema, with defaults.

Each section is a dataclass; ``PipelineConfig`` composes them. YAML files (``configs/*.yaml``)
and command-line ``key.path=value`` overrides (as verl users write them) are merged onto the
defaults by OmegaConf, which rejects an unknown key or a wrong type naming the field, at start.
Secrets never live here: a config names the *environment variable* that holds them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence, TypeVar

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from streamrl.learner.config import LearnerConfig
from streamrl.reward.config import RewardConfig
from streamrl.rollout.config import FeedConfig, RolloutConfig

T = TypeVar("T")


class ConfigError(ValueError):
    """A bad config: the message names the field."""


@dataclass
class BusConfig:
    """How every stage talks to Kafka. ``bootstrap_servers`` empty means: the embedded broker."""

    bootstrap_servers: str = ""
    topic_prefix: str = "streamrl"
    client_id: str = "streamrl"
    replication_factor: int = 0  # 0: take each topic file's own
    # Security. The password is read from the environment variable named here, never from a file.
    security_protocol: str = "PLAINTEXT"  # PLAINTEXT | SSL | SASL_PLAINTEXT | SASL_SSL
    sasl_mechanism: str = ""  # PLAIN | SCRAM-SHA-256 | SCRAM-SHA-512
    sasl_username: str = ""
    sasl_password_env: str = "STREAMRL_SASL_PASSWORD"
    # Records of tens of KB to several MB (a 32k-token trajectory is ~400 KB).
    max_record_bytes: int = 16 * 1024 * 1024
    compression: str = "lz4"  # none | gzip | lz4 | zstd
    linger_ms: int = 5
    max_batch_bytes: int = 1024 * 1024
    # Consumer groups. Short sessions: the embedded broker holds each JoinGroup for half the
    # session timeout (DESIGN.md), and a dead member should be noticed in seconds, not a minute.
    session_timeout_ms: int = 6000
    heartbeat_interval_ms: int = 1000
    max_poll_interval_ms: int = 600_000
    commit_interval_s: float = 1.0

    def topic(self, name: str) -> str:
        return f"{self.topic_prefix}.{name}" if self.topic_prefix else name

    def sasl_password(self) -> str | None:
        return os.environ.get(self.sasl_password_env) if self.sasl_mechanism else None


@dataclass
class MetricsConfig:
    port: int = 0  # 0: pick a free port and print it
    host: str = "0.0.0.0"


@dataclass
class PipelineConfig:
    bus: BusConfig = field(default_factory=BusConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    feed: FeedConfig = field(default_factory=FeedConfig)


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (),
                schema: type[T] = PipelineConfig) -> T:  # type: ignore[assignment]
    """Defaults <- YAML file <- ``key.path=value`` overrides, checked against ``schema``."""
    try:
        merged = OmegaConf.structured(schema)
        if path:
            merged = OmegaConf.merge(merged, OmegaConf.load(Path(path)))
        if overrides:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None)
        msg = getattr(exc, "msg", str(exc)).splitlines()[0]
        where = f" in {path}" if path else ""
        raise ConfigError(f"config field {key!r}{where}: {msg}" if key else f"config{where}: {msg}") from None
    except FileNotFoundError as exc:
        raise ConfigError(f"config file not found: {exc.filename}") from None


def to_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))
