"""The archive stage's config section (``archive:`` in a pipeline YAML)."""

from __future__ import annotations

from dataclasses import dataclass, field

from streamrl.errors import ConfigError

#: The topics an archive keeps (short names): what a replay reads after the broker is gone.
ARCHIVED = ("rollouts", "rewarded", "deadletter", "distilled")
#: what an archive keeps unless configured (``streamrl run`` adds distilled with distillation on)
DEFAULT_ARCHIVED = ("rollouts", "rewarded", "deadletter")


@dataclass
class ArchiveConfig:
    """Where and how the archive stage writes Parquet files (``streamrl.archive``).

    ``uri`` is a local path, ``file://``, ``memory://``, ``s3://BUCKET/PATH`` (extra ``s3``) or
    ``gs://BUCKET/PATH`` (extra ``gcs``); credentials come from the environment as each fsspec
    filesystem reads them, never from here. ``streamrl run`` archives into ``<run dir>/archive``
    unless ``uri`` is set, and not at all with ``enabled: false``."""

    enabled: bool = True  # streamrl run starts the archive stage
    uri: str = ""  # where the files go: a directory, file://, s3://, gs:// (env STREAMRL_ARCHIVE_URI)
    topics: list[str] = field(default_factory=lambda: list(DEFAULT_ARCHIVED))  # of rollouts, rewarded, deadletter, distilled
    group: str = ""  # consumer group; default <prefix>-archive
    # A file is closed (and its records committed) at this many bytes of records, or when its
    # oldest record has waited this long: the bound on how much a crash makes the archive re-read
    roll_bytes: int = 64 * 1024 * 1024
    roll_seconds: float = 60.0  # see roll_bytes
    compression: str = "zstd"  # parquet codec: zstd | snappy | gzip | lz4 | none
    # On stop, keep reading until every partition is read to its end (or this long), so that a
    # run's archive holds what the stages wrote before they stopped
    drain_timeout_s: float = 30.0

    def validate(self) -> "ArchiveConfig":
        if not self.uri:
            raise ConfigError("config field 'archive.uri': empty; set a path or URI "
                              "(e.g. archive.uri=/data/archive or s3://bucket/streamrl)")
        bad = [t for t in self.topics if t not in ARCHIVED]
        if bad or not self.topics:
            raise ConfigError(f"config field 'archive.topics': {bad or '[]'}; choose from {', '.join(ARCHIVED)}")
        if self.roll_bytes <= 0 or self.roll_seconds <= 0:
            raise ConfigError("config field 'archive.roll_bytes' / 'archive.roll_seconds': must be > 0")
        if self.compression not in ("zstd", "snappy", "gzip", "lz4", "none"):
            raise ConfigError(f"config field 'archive.compression': {self.compression!r} is not "
                              f"zstd, snappy, gzip, lz4 or none")
        check_uri(self.uri, "archive.uri")
        return self


def check_uri(uri: str, field_name: str = "archive.uri") -> None:
    """A local path, or a URI whose fsspec filesystem is installed; else ``ConfigError`` naming
    the field and the extra to install."""
    if "://" not in uri:
        return
    protocol = uri.split("://", 1)[0]
    import fsspec

    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        raise ConfigError(f"config field {field_name!r}: fsspec knows no filesystem {protocol!r}") from None
    except ImportError:
        extra = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"}.get(protocol, protocol)
        raise ConfigError(f"config field {field_name!r}: {protocol}:// needs its fsspec filesystem: "
                          f"pip install 'streamrl[{extra}]'") from None
