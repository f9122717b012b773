"""The experiment trackers' config section (``tracking:``); verl's ``trainer.logger``,
``trainer.project_name`` and ``trainer.experiment_name`` map onto it."""

from __future__ import annotations

from dataclasses import dataclass, field

from streamrl.errors import ConfigError

LOGGERS = ("console", "tensorboard", "mlflow", "wandb", "file")


@dataclass
class TrackingConfig:
    """Where a run's figures go besides Prometheus: one process (``streamrl run``'s supervisor, or
    ``streamrl track``) reads the policy and eval topics and logs each version once."""

    # console | tensorboard | mlflow | wandb | file (verl's trainer.logger); empty: none
    loggers: list[str] = field(default_factory=list)
    project: str = "streamrl"  # the project (verl's trainer.project_name): a W&B project, an MLflow experiment
    experiment: str = ""  # the run's name (verl's trainer.experiment_name); empty: the run directory's name
    # Where tensorboard, the MLflow store and W&B write; empty: <run dir>/tracking
    dir: str = ""
    # MLflow: a tracking server (http://...) or store URI; empty: MLFLOW_TRACKING_URI, else a
    # SQLite store under dir (mlruns.db, as verl; a file store, mlruns/, without SQLAlchemy)
    mlflow_tracking_uri: str = ""
    # W&B: online | offline (no network; `wandb sync` uploads later); empty: WANDB_MODE, else
    # online. The API key comes from WANDB_API_KEY (never from a config, never logged)
    wandb_mode: str = ""

    def validate(self) -> "TrackingConfig":
        for name in self.loggers:
            if name not in LOGGERS:
                raise ConfigError(f"config field 'tracking.loggers': {name!r} is not one of {', '.join(LOGGERS)}")
        if self.wandb_mode not in ("", "online", "offline"):
            raise ConfigError(f"config field 'tracking.wandb_mode': {self.wandb_mode!r} is not online or offline")
        return self
