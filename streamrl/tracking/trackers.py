"""Experiment trackers: a run's figures in TensorBoard, MLflow and W&B under verl's names.

One process logs (``streamrl run``'s supervisor, or ``streamrl track`` beside stages deployed
one by one): it reads the ``policy`` topic (each version's training figures, which the learner
summarises into the record) and the ``eval`` topic (the eval stage's validation figures), and
logs each version once, with the version as the step. Why from the topics and not from the
learner: N learner ranks, a restarted learner that announces a version again, or an eval stage
killed mid-run never make a step appear twice, and the figures of the last evaluation, which
finishes after the learner has stopped, still arrive. A ledger beside the trackers' files
(``logged.json``: what was logged, the MLflow run and W&B run ids) makes a resumed run go on in
the same tracker runs without logging a step again.

Each tracker is an extra, imported when configured: ``tensorboard`` (torch's
``SummaryWriter``), ``mlflow`` (``mlflow-skinny``), ``wandb``; ``console`` and ``file`` (verl's
JSON lines) need nothing. A missing one is one line naming
the extra.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import json
import logging
import os
import re
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from streamrl.bus import Bus, Message, Reader
from streamrl.errors import StreamrlError
from streamrl.evaluation.scores import tracker_names
from streamrl.records import EvalResult, PolicyVersion, RecordError
from streamrl.tracking.config import TrackingConfig

__all__ = ["Tracker", "TrackingStage", "VERL_NAMES", "train_figures", "follow"]

log = logging.getLogger(__name__)

#: the learner's per-version summary (``PolicyVersion.metrics``) -> verl's tracker names; a key
#: not here is logged as ``streamrl/<key>``, but one already in verl's terms (``VERL_PREFIXES``) as it is
VERL_NAMES = {
    "pg_loss": "actor/pg_loss",
    "clip_fraction": "actor/pg_clipfrac",
    "ppo_kl": "actor/ppo_kl",
    "entropy": "actor/entropy",
    "grad_norm": "actor/grad_norm",
    "lr": "actor/lr",
    "kl": "actor/kl_loss",
    "reward_kl_penalty": "actor/reward_kl_penalty",
    "reward_kl_penalty_coeff": "actor/reward_kl_penalty_coeff",
    **{f"score_{s}": f"critic/score/{s}" for s in ("mean", "max", "min")},
    **{f"rewards_{s}": f"critic/rewards/{s}" for s in ("mean", "max", "min")},
    **{f"advantages_{s}": f"critic/advantages/{s}" for s in ("mean", "max", "min")},
    **{f"response_length_{s}": f"response_length/{s}" for s in ("mean", "max", "min", "clip_ratio")},
    **{f"prompt_length_{s}": f"prompt_length/{s}" for s in ("mean", "max", "min")},
    "version_seconds": "timing_s/step",
    "step_seconds": "timing_s/update_actor",
    "throughput": "perf/throughput",
    "total_tokens": "perf/total_num_tokens",
    "staleness_mean": "streamrl/staleness/mean",
    "staleness_max": "streamrl/staleness/max",
    "staleness_worst": "streamrl/staleness/worst",
    "span_mean": "streamrl/staleness/span_mean",
    "span_max": "streamrl/staleness/span_max",
    "reward_lag_s": "streamrl/reward_lag",
    "dead_letters": "streamrl/dead_letters",
    "filtered_groups": "streamrl/filtered_groups",
}


VERL_PREFIXES = ("rollout_corr/", "critic/", "gdpo/")


def train_figures(metrics: dict[str, float]) -> dict[str, float]:
    """A policy record's summary under verl's names (``VERL_NAMES``)."""
    return {VERL_NAMES.get(k, k if k.startswith(VERL_PREFIXES) else f"streamrl/{k}"): float(v)
            for k, v in sorted(metrics.items())}


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A config as ``section/key`` -> scalar (lists as their JSON text): the hyper-parameters."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(flatten(v, f"{prefix}/{k}" if prefix else str(k)))
        return out
    if isinstance(tree, (list, tuple)):
        return {prefix: json.dumps(tree)}
    return {prefix: tree}


# -- the trackers --------------------------------------------------------------------------------
class _Console:
    def __init__(self, ctx: "_Context") -> None:
        self.write = ctx.show

    def log(self, figures: dict[str, float], step: int) -> None:
        self.write(f"step:{step} - " + " - ".join(f"{k}:{v:.4g}" for k, v in figures.items()))

    def close(self) -> None:
        return None


class _TensorBoard:
    def __init__(self, ctx: "_Context") -> None:
        _need("tensorboard", "tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: a supervisor killed between writing a step and the ledger's line for it
        # wrote that step once already; TensorBoard hides what was written from there on
        self.writer = SummaryWriter(log_dir=str(ctx.directory / "tensorboard" / ctx.experiment),
                                    purge_step=ctx.next_step)
        if ctx.first:
            from torch.utils.tensorboard.summary import hparams

            scalars = {k: v for k, v in ctx.hparams.items() if isinstance(v, (int, float, str, bool))}
            for summary in hparams(scalars, {}):
                self.writer.file_writer.add_summary(summary)

    def log(self, figures: dict[str, float], step: int) -> None:
        for k, v in figures.items():
            self.writer.add_scalar(k, v, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


_MLFLOW_BAD = re.compile(r"[^/\w.\- :]")


def mlflow_key(key: str) -> str:
    """A figure's name as MLflow accepts it, as verl writes it: ``@`` -> ``_at_``, other
    characters MLflow refuses -> ``_`` (``val-core/digits/reward/mean_at_1``)."""
    return _MLFLOW_BAD.sub("_", re.sub(r"/+", "/", key.replace("@", "_at_")))


def mlflow_store_uri(directory: Path) -> str:
    """MLflow's store when neither ``tracking.mlflow_tracking_uri`` nor ``MLFLOW_TRACKING_URI``
    names one: as verl, a SQLite store in the run's directory (``sqlite:///.../mlruns.db``; MLflow
    3 keeps the file store in maintenance mode and its client refuses to read one unless
    ``MLFLOW_ALLOW_FILE_STORE`` is set). SQLite needs SQLAlchemy and Alembic (the ``mlflow`` extra
    brings them, mlflow-skinny alone does not): without them, a file store in ``mlruns/``."""
    if all(importlib.util.find_spec(m) is not None for m in ("sqlalchemy", "alembic")):
        return f"sqlite:///{(directory / 'mlruns.db').resolve()}"
    return (directory / "mlruns").resolve().as_uri()


class _MLflow:
    def __init__(self, ctx: "_Context") -> None:
        _need("mlflow", "mlflow")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        uri = ctx.cfg.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or mlflow_store_uri(ctx.directory)
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 asks for it: a local run is fine
        self.mlflow = MlflowClient(tracking_uri=uri)
        self.run_id = ctx.ledger.get("mlflow_run_id")
        if not self.run_id:
            found = self.mlflow.get_experiment_by_name(ctx.cfg.project)
            experiment = found.experiment_id if found else self.mlflow.create_experiment(ctx.cfg.project)
            self.run_id = self.mlflow.create_run(experiment, run_name=ctx.experiment).info.run_id
            ctx.ledger["mlflow_run_id"] = self.run_id
            params = [Param(mlflow_key(k)[:250], str(v)[:6000]) for k, v in ctx.hparams.items()]
            for i in range(0, len(params), 100):
                self.mlflow.log_batch(self.run_id, params=params[i:i + 100])

    def log(self, figures: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.mlflow.log_batch(self.run_id, metrics=[Metric(mlflow_key(k), v, now, step) for k, v in figures.items()])

    def close(self) -> None:
        self.mlflow.set_terminated(self.run_id)


class _WandB:
    """Figures are logged against ``streamrl/version`` (``define_metric``), not W&B's own step:
    the validation of a version arrives after later versions' training figures, and W&B drops a
    step lower than one it has seen."""

    def __init__(self, ctx: "_Context") -> None:
        wandb = _need("wandb", "wandb")
        run_id = ctx.ledger.get("wandb_run_id") or uuid.uuid4().hex[:8]
        ctx.ledger["wandb_run_id"] = run_id
        mode = ctx.cfg.wandb_mode or os.environ.get("WANDB_MODE") or "online"
        (ctx.directory / "wandb").mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(project=ctx.cfg.project, name=ctx.experiment, id=run_id, resume="allow",
                              dir=str(ctx.directory), mode=mode, config=ctx.hparams if ctx.first else None,
                              settings=wandb.Settings(silent=True, console="off"))
        self.run.define_metric("streamrl/version")
        self.run.define_metric("*", step_metric="streamrl/version")

    def log(self, figures: dict[str, float], step: int) -> None:
        self.run.log({**figures, "streamrl/version": step})

    def close(self) -> None:
        self.run.finish()


class _File:
    """verl's ``file`` logger: one JSON line per logged step, ``{"step": N, "data": {...}}``, in
    ``$VERL_FILE_LOGGER_PATH`` or ``<tracking dir>/<project>/<experiment>.jsonl`` (appended: a
    resumed run goes on in the same file, the ledger keeping a step from appearing twice)."""

    def __init__(self, ctx: "_Context") -> None:
        path = os.environ.get("VERL_FILE_LOGGER_PATH")
        self.path = Path(path) if path else ctx.directory / ctx.cfg.project / f"{ctx.experiment}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fp = open(self.path, "ab", buffering=0)

    def log(self, figures: dict[str, float], step: int) -> None:
        self.fp.write(json.dumps({"step": step, "data": figures}).encode() + b"\n")

    def close(self) -> None:
        self.fp.close()


_TRACKERS: dict[str, Callable[["_Context"], Any]] = {
    "console": _Console, "tensorboard": _TensorBoard, "mlflow": _MLflow, "wandb": _WandB, "file": _File}


def _need(module: str, extra: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise StreamrlError(f"tracking.loggers names {module}, which is not installed: "
                            f"pip install 'streamrl[{extra}]'") from None


class _Context:
    """What a tracker is opened with."""

    def __init__(self, cfg: TrackingConfig, directory: Path, experiment: str, hparams: dict[str, Any],
                 ledger: dict[str, Any], show: Callable[[str], None]):
        self.cfg, self.directory, self.experiment, self.hparams = cfg, directory, experiment, hparams
        self.ledger, self.show = ledger, show
        self.first = not ledger.get("policy") and not ledger.get("eval")
        logged = [*ledger.get("policy", []), *(int(k.split("/", 1)[0]) for k in ledger.get("eval", []))]
        self.next_step = max(logged) + 1 if logged else None


class Tracker:
    """The configured trackers and the ledger of what they hold.

    ``log_policy`` / ``log_eval`` log a record's figures unless the ledger has them (a version
    announced twice, an evaluation published twice) and return whether they did."""

    def __init__(self, cfg: TrackingConfig, directory: str | Path, experiment: str, hparams: dict[str, Any],
                 show: Callable[[str], None] | None = None):
        self.cfg = cfg.validate()
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.ledger_path = self.directory / "logged.json"
        try:
            self.ledger: dict[str, Any] = json.loads(self.ledger_path.read_text())
        except (OSError, ValueError):
            self.ledger = {}
        self.policy: set[int] = set(self.ledger.setdefault("policy", []))
        self.eval: set[str] = set(self.ledger.setdefault("eval", []))
        ctx = _Context(self.cfg, self.directory, experiment, flatten(hparams), self.ledger,
                       show or (lambda line: print(line, file=sys.stderr, flush=True)))
        self.trackers = [_TRACKERS[name](ctx) for name in self.cfg.loggers]
        self._save()
        self.counts: dict[str, int] = {}  # figure name -> times logged by this process

    @property
    def enabled(self) -> bool:
        return bool(self.trackers)

    def log_policy(self, record: PolicyVersion) -> bool:
        """A version's training figures (none for an announcement without updates: version 0,
        a restarted learner's start)."""
        if not record.metrics or record.version in self.policy:
            return False
        self._log(train_figures(record.metrics), record.version)
        self.policy.add(record.version)
        self.ledger["policy"] = sorted(self.policy)
        self._save()
        return True

    def log_eval(self, record: EvalResult) -> bool:
        key = f"{record.version}/{record.data_source}"
        if key in self.eval:
            return False
        self._log(tracker_names(record.data_source, record.metrics, record.core), record.version)
        self.eval.add(key)
        self.ledger["eval"] = sorted(self.eval)
        self._save()
        return True

    def _log(self, figures: dict[str, float], step: int) -> None:
        for tracker in self.trackers:
            tracker.log(figures, step)
        for k in figures:
            self.counts[k] = self.counts.get(k, 0) + 1

    def _save(self) -> None:
        tmp = self.ledger_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.ledger))
        os.replace(tmp, self.ledger_path)

    def close(self) -> None:
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as exc:  # a tracker that fails to close loses nothing already flushed
                log.warning("tracking: closing %s failed: %s", type(tracker).__name__, exc)


def take(tracker: Tracker, bus: Bus, messages: list[Message]) -> None:
    """Log what ``messages`` (of the policy and eval topics) carry."""
    eval_topic = bus.topic("eval")
    for msg in messages:
        try:
            if msg.topic == eval_topic:
                tracker.log_eval(EvalResult.decode(msg.value))
            else:
                tracker.log_policy(PolicyVersion.decode(msg.value))
        except RecordError as exc:
            log.warning("tracking: %s offset %d unreadable (%s); not logged", msg.topic, msg.offset, exc)


async def follow(tracker: Tracker, bus: Bus, stop: asyncio.Event, poll_ms: int = 500) -> None:
    """Log the policy and eval topics from their beginning until ``stop`` is set, then what they
    hold up to their end (the last version's evaluation lands after the learner stops)."""
    async with Reader(bus, ["policy", "eval"], "tracking") as reader:
        while not stop.is_set():
            batch = await reader.fetch(timeout_ms=poll_ms)
            await asyncio.to_thread(take, tracker, bus, batch)
        async for batch in reader.read():
            await asyncio.to_thread(take, tracker, bus, batch)


class TrackingStage:
    """``streamrl track``: ``follow`` as a stage of its own (signals, metrics, the broker watch)."""

    name = "track"

    def __init__(self, bus: Bus, tracker: Tracker):
        self.bus, self.tracker = bus, tracker

    @classmethod
    def from_config(cls, cfg: Any, bus: Bus) -> "TrackingStage":
        from omegaconf import OmegaConf

        tc = cfg.tracking.validate()
        if not tc.loggers:
            raise StreamrlError("config field 'tracking.loggers': empty; name console, tensorboard, mlflow, wandb or file")
        directory = Path(tc.dir or "tracking").resolve()
        experiment = tc.experiment or directory.parent.name
        return cls(bus, Tracker(tc, directory, experiment, OmegaConf.to_container(OmegaConf.structured(cfg))))

    def validate(self) -> None:
        self.tracker.cfg.validate()

    def describe(self) -> str:
        return (f"{', '.join(self.tracker.cfg.loggers)} in {self.tracker.directory}: "
                f"{len(self.tracker.policy)} versions and {len(self.tracker.eval)} evaluations logged")

    async def run(self, stop: asyncio.Event) -> None:
        try:
            await follow(self.tracker, self.bus, stop)
        finally:
            await asyncio.to_thread(self.tracker.close)
