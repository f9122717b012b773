"""Launching the stages of ``streamrl run`` and keeping them running.

A ``Launcher`` starts each stage with the same command a user, compose and Kubernetes run
(``python -m streamrl VERB ...``): as child processes here (``LocalLauncher``), or as Ray actors
with resources (``streamrl.supervisor.ray_launcher.RayLauncher``). It supervises them: a stage that exits
unexpectedly is restarted with exponential backoff, up to ``run.restart.max_restarts`` in
``run.restart.window_s``; the run fails only past that limit. Deliberate stops (scale-down,
Ctrl-C, the end of the run) wait ``run.stop_timeout_s``, longer than a stage's drain or
checkpoint, and never count as crashes. (``streamrl.supervisor.autoscale`` sizes the reward group by lag.)

Nothing is lost by a restart: a stage commits offsets only after its outputs are acknowledged,
so a restarted stage (or the member that took its partitions) redoes what was not committed, and
the learner de-duplicates by ``id``.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from streamrl import metrics
from streamrl.broker import die_with_parent, stop_process
from streamrl.config import RestartConfig

log = logging.getLogger(__name__)

#: stages whose exit 0 means "finished" (the feed published everything, the learner reached its
#: versions, the eval stage evaluated the last version), not a crash; the others run until they are stopped
JOBS = ("feed", "learner", "eval")
#: stages stopped after all the others, so they see everything the others wrote (the archive
#: and the trackers read their topics to their end before they exit)
LAST = ("archive", "track")


def stage_command(argv: list[str]) -> list[str]:
    """How every launcher runs a stage: the same CLI as a user, compose and Kubernetes."""
    return [sys.executable, "-m", "streamrl", *argv]


@dataclass
class _Stage:
    argv: list[str]
    kind: str  # feed | rollout | reward | learner
    restarts: list[float] = field(default_factory=list)  # monotonic times of restarts
    restart_at: float | None = None  # a restart is due then
    stopping: bool = False  # asked to stop: its exit is not a crash


class Launcher:
    """Starts, supervises and stops named stages. Subclasses say how a stage runs (``_spawn``,
    ``_poll``, ``_stop``, ``log_tail``); this class decides when one is restarted."""

    def __init__(self, restart: RestartConfig | None = None, stop_timeout_s: float = 90.0):
        self.policy = restart or RestartConfig()
        self.stop_timeout_s = stop_timeout_s
        self.stages: dict[str, _Stage] = {}
        self.gave_up: str | None = None  # a stage past its restart limit

    # -- what a subclass provides --------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str], kind: str) -> None:
        raise NotImplementedError

    def _poll(self, name: str) -> int | None:
        raise NotImplementedError

    def _stop(self, name: str, timeout_s: float) -> None:
        raise NotImplementedError

    def log_tail(self, name: str, lines: int = 20) -> str:
        raise NotImplementedError

    # -- the common part -----------------------------------------------------------------------
    def start(self, name: str, argv: list[str], stage: str) -> None:
        self.stages[name] = _Stage(argv, stage)
        self._spawn(name, argv, stage)

    def names(self) -> list[str]:
        return list(self.stages)

    def returncode(self, name: str) -> int | None:
        """None while running (or waiting for its restart)."""
        st = self.stages[name]
        return None if st.restart_at is not None else self._poll(name)

    def restart_count(self) -> int:
        return sum(len(st.restarts) for st in self.stages.values())

    def supervise(self, now: float | None = None) -> list[str]:
        """Restart what crashed (after its backoff), give up past the limit; returns what
        happened, one line each, for the status output."""
        now = time.monotonic() if now is None else now
        events = []
        for name, st in self.stages.items():
            if st.stopping:
                continue
            if st.restart_at is not None:
                if now >= st.restart_at:
                    st.restart_at = None
                    st.restarts.append(now)
                    metrics.RUN_RESTARTS.labels(st.kind).inc()
                    self._spawn(name, st.argv, st.kind)
                    events.append(f"{name}: restarted ({len(st.restarts)} so far)")
                continue
            code = self._poll(name)
            if code is None or (code == 0 and st.kind in JOBS):
                continue
            recent = [t for t in st.restarts if now - t < self.policy.window_s]
            # exit 2 is a bad config or argument (one line in its log): a restart cannot fix it;
            # a feed is not re-run either: it would publish its prompts twice
            if code == 2 or st.kind == "feed" or len(recent) >= self.policy.max_restarts:
                self.gave_up = self.gave_up or name
                continue
            delay = self.policy.backoff_s * 2 ** len(recent)
            st.restart_at = now + delay
            events.append(f"{name}: exited with {code}; restarting in {delay:.1f} s")
            log.warning("%s exited with %s; restart %d of %d in %.1f s", name, code, len(recent) + 1,
                        self.policy.max_restarts, delay)
        return events

    def failed(self) -> str | None:
        """A stage the run cannot go on without: past its restart limit (or a failed feed).
        Supervises first, so a caller that only asks this (a benchmark with ``max_restarts`` 0)
        still sees a crash."""
        self.supervise()
        return self.gave_up

    def stop(self, name: str, timeout_s: float | None = None) -> None:
        """A deliberate stop (scale-down): SIGTERM, wait for the drain, never a crash."""
        st = self.stages[name]
        st.stopping, st.restart_at = True, None
        self._stop(name, self.stop_timeout_s if timeout_s is None else timeout_s)

    def stop_all(self, timeout_s: float | None = None, names: list[str] | None = None) -> None:
        """Stop every stage (or the ``names`` given) at once: SIGTERM, wait for their drains."""
        names = list(self.stages) if names is None else [n for n in names if n in self.stages]
        for name in names:
            st = self.stages[name]
            st.stopping, st.restart_at = True, None
        timeout_s = self.stop_timeout_s if timeout_s is None else timeout_s
        last = [name for name in names if self.stages[name].kind in LAST]
        self._stop_all(timeout_s, [name for name in names if name not in last])
        if last:
            self._stop_all(timeout_s, last)

    def _stop_all(self, timeout_s: float, names: list[str]) -> None:
        for name in names:
            self._stop(name, timeout_s)

    def metrics_url(self, name: str) -> str | None:
        """Where stage ``name`` serves its metrics now: the last ``metrics: URL`` line it printed
        (a restart prints a new one)."""
        try:
            tail = self.log_tail(name, 2000)
        except (OSError, KeyError, NotImplementedError):
            return None
        found = re.findall(r"^metrics: (http://\S+)$", tail, re.M)
        return found[-1] if found else None


class LocalLauncher(Launcher):
    """Child processes, output appended to ``<log_dir>/<name>.log`` (a restart's output follows
    its predecessor's). Children get SIGTERM if this process dies (``PR_SET_PDEATHSIG``), so no
    stage outlives the run."""

    def __init__(self, log_dir: Path, restart: RestartConfig | None = None, stop_timeout_s: float = 90.0):
        super().__init__(restart, stop_timeout_s)
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}

    def _spawn(self, name: str, argv: list[str], kind: str) -> None:
        with open(self.log_dir / f"{name}.log", "ab") as out:
            self.procs[name] = subprocess.Popen(
                stage_command(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=dict(os.environ, PYTHONUNBUFFERED="1"), preexec_fn=die_with_parent)

    def _poll(self, name: str) -> int | None:
        return self.procs[name].poll()

    def pid(self, name: str) -> int:
        return self.procs[name].pid

    def _stop(self, name: str, timeout_s: float) -> None:
        stop_process(self.procs[name], timeout_s)

    def _stop_all(self, timeout_s: float, names: list[str]) -> None:
        procs = [self.procs[name] for name in names if name in self.procs]
        for proc in procs:  # all at once, then wait
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            stop_process(proc, timeout_s)

    def log_tail(self, name: str, lines: int = 20) -> str:
        text = (self.log_dir / f"{name}.log").read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])
