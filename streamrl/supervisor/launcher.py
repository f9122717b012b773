"""Launching the stages of ``streamrl run`` and keeping them running.

A ``Launcher`` starts each stage with the same command a user, compose and Kubernetes run
(``python -m streamrl VERB ...``): as child processes here (``LocalLauncher``), or as Ray actors
with resources (``streamrl.supervisor.ray_launcher.RayLauncher``). It supervises them: a stage that exits
unexpectedly is restarted with exponential backoff, up to ``run.restart.max_restarts`` in
``run.restart.window_s``; the run fails only past that limit. A stage that stops answering (a
SIGSTOPped process, a frozen node: its metrics, or its Ray actor, silent for
``run.stage_timeout_s``) is killed and restarted the same way: a frozen process never exits, so
waiting for its exit would wait forever. Deliberate stops (scale-down, Ctrl-C, the end of the
run) wait ``run.stop_timeout_s``, longer than a stage's drain or checkpoint, and never count as
crashes. (``streamrl.supervisor.autoscale`` sizes the reward group by lag.)

The supervisor's loop never waits on a stage: ``supervise`` (which probes, kills and spawns, each
call bounded) runs in a thread of its own (``streamrl.supervisor.watch``), and what the loop asks
between two supervisions (``returncode``, ``metrics_url``, ``names``) is answered from what the
last one saw, at once.

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
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from streamrl import metrics
from streamrl.broker import die_with_parent, stop_process
from streamrl.config import RestartConfig
from streamrl.errors import StreamrlError

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
    restart_at: float | None = None  # a (re)start is due then
    stopping: bool = False  # asked to stop: its exit is not a crash
    answered_at: float = field(default_factory=time.monotonic)  # it last showed it is alive (or was spawned)
    probed_at: float = 0.0
    url: str | None = None  # where its current process serves its metrics, once it said
    failure: str = ""  # why the run cannot go on with it (one line), once it gave up


class Launcher:
    """Starts, supervises and stops named stages. Subclasses say how a stage runs (``_spawn``,
    ``_poll``, ``_stop``, ``log_tail``); this class decides when one is restarted."""

    def __init__(self, restart: RestartConfig | None = None, stop_timeout_s: float = 90.0,
                 stage_timeout_s: float = 30.0):
        self.policy = restart or RestartConfig()
        self.stop_timeout_s = stop_timeout_s
        self.stage_timeout_s = stage_timeout_s  # run.stage_timeout_s: silent this long is dead
        self.stages: dict[str, _Stage] = {}
        self.gave_up: str | None = None  # a stage past its restart limit
        self._events: list[str] = []  # what a supervision made by ``failed`` saw, for the next caller
        # one supervision, start or stop at a time (the loop's reads take no lock)
        self._lock = threading.RLock()

    # -- what a subclass provides --------------------------------------------------------------
    def _spawn(self, name: str, argv: list[str], kind: str) -> None:
        raise NotImplementedError

    def _poll(self, name: str) -> int | None:
        raise NotImplementedError

    def _stop(self, name: str, timeout_s: float) -> None:
        raise NotImplementedError

    def log_tail(self, name: str, lines: int = 20) -> str:
        raise NotImplementedError

    def _refresh(self, name: str) -> None:
        """Ask the running stage how it is, without waiting for the answer (``_poll`` reads it)."""

    def _placing(self, name: str) -> bool:
        """Whether the stage waits for a place to run (it cannot answer yet)."""
        return False

    def _alive(self, name: str) -> bool | None:
        """Whether the running stage answers now (bounded: about a second at most): True, False,
        or None when no answer is due yet (a probe in flight). Says True by default."""
        return True

    def _kill(self, name: str) -> None:
        """End a stage that does not answer, at once and without a drain (it cannot drain)."""
        self._stop(name, 0.0)

    def _find_url(self, name: str) -> str | None:
        """The ``metrics: URL`` line its current process printed, if it has."""
        return None

    # -- the common part -----------------------------------------------------------------------
    def start(self, name: str, argv: list[str], stage: str) -> None:
        with self._lock:
            self.stages[name] = _Stage(argv, stage)
            self._spawn(name, argv, stage)

    def add(self, name: str, argv: list[str], stage: str) -> None:
        """A stage started by the next ``supervise`` (off the caller's thread): the run's loop
        adds a reward member so, never waiting on the launcher."""
        with self._lock:
            self.stages[name] = _Stage(argv, stage, restart_at=0.0)

    def names(self) -> list[str]:
        return list(self.stages)

    def returncode(self, name: str) -> int | None:
        """None while running (or waiting for its restart); at once (the last supervision's
        view where asking the stage would wait)."""
        st = self.stages[name]
        if st.restart_at is not None:
            return None
        try:
            return self._poll(name)
        except StageLost:
            return -1

    def restart_count(self) -> int:
        return sum(len(st.restarts) for st in self.stages.values())

    def supervise(self, now: float | None = None) -> list[str]:
        """Restart what crashed or stopped answering (after its backoff), give up past the
        limit; returns what happened, one line each, for the status output (and what a
        supervision made by ``failed`` saw since the last call: each event is returned once)."""
        with self._lock:
            now = time.monotonic() if now is None else now
            events, self._events = self._events, []
            for name, st in list(self.stages.items()):
                if st.stopping or name == self.gave_up:
                    continue
                try:
                    events += self._supervise_one(name, st, now)
                except StageLost as exc:  # it cannot run here (e.g. no node can take it)
                    st.failure, st.restart_at = str(exc), None
                    self.gave_up = self.gave_up or name
            return events

    def _supervise_one(self, name: str, st: _Stage, now: float) -> list[str]:
        if st.restart_at is not None:
            if now < st.restart_at:
                return []
            first = st.restart_at == 0.0 and not st.restarts  # added: its first start
            st.restart_at, st.url, st.answered_at = None, None, now
            if not first:
                st.restarts.append(now)
                metrics.RUN_RESTARTS.labels(st.kind).inc()
            self._spawn(name, st.argv, st.kind)
            return [] if first else [f"{name}: restarted ({len(st.restarts)} so far)"]
        self._refresh(name)
        code = self._poll(name)
        why = f"exited with {code}"
        if code is None and self._placing(name):  # not running yet: the placement has its own timeout
            st.answered_at = time.monotonic()
            return []
        if code is None:
            if st.url is None:
                st.url = self._find_url(name)
            if now - st.probed_at >= self.probe_every_s():
                st.probed_at = now
                if self._alive(name):
                    st.answered_at = time.monotonic()
            silent = time.monotonic() - st.answered_at
            if silent < self.stage_timeout_s:
                return []
            log.warning("%s did not answer for %.0f s (run.stage_timeout_s): killing it", name, silent)
            self._kill(name)
            code, why = -9, f"did not answer for {silent:.0f} s (run.stage_timeout_s), killed"
        if code == 0 and st.kind in JOBS:
            return []
        recent = [t for t in st.restarts if now - t < self.policy.window_s]
        # exit 2 is a bad config or argument (one line in its log): a restart cannot fix it;
        # a feed is not re-run either: it would publish its prompts twice
        if code == 2 or st.kind == "feed" or len(recent) >= self.policy.max_restarts:
            st.failure = st.failure or why
            self.gave_up = self.gave_up or name
            return []
        delay = self.policy.backoff_s * 2 ** len(recent)
        st.restart_at = now + delay
        log.warning("%s %s; restart %d of %d in %.1f s", name, why, len(recent) + 1, self.policy.max_restarts, delay)
        return [f"{name}: {why}; restarting in {delay:.1f} s"]

    def probe_every_s(self) -> float:
        """How often a running stage is asked whether it is alive: a few times per timeout."""
        return min(2.0, self.stage_timeout_s / 5)

    def failed(self) -> str | None:
        """A stage the run cannot go on without: past its restart limit (or a failed feed, or
        one that cannot run). Supervises first, so a caller that only asks this (a benchmark
        with ``max_restarts`` 0) still sees a crash; the events go to the next ``supervise``."""
        events = self.supervise()
        with self._lock:
            self._events = events + self._events
        return self.gave_up

    def failure(self, name: str) -> str:
        """Why stage ``name`` failed the run, in one line ("" if it did not say)."""
        st = self.stages.get(name)
        return st.failure if st is not None else ""

    def metrics_url(self, name: str) -> str | None:
        """Where stage ``name``'s current process serves its metrics, as the last supervision
        found it (a restart prints a new one): the loop never reads a log for it."""
        st = self.stages.get(name)
        return st.url if st is not None else None

    def stop(self, name: str, timeout_s: float | None = None) -> None:
        """A deliberate stop (scale-down): SIGTERM, wait for the drain, never a crash."""
        with self._lock:
            st = self.stages[name]
            never = st.restart_at == 0.0  # added, not started yet: nothing to stop
            st.stopping, st.restart_at = True, None
            if not never:
                self._stop(name, self.stop_timeout_s if timeout_s is None else timeout_s)

    def stop_all(self, timeout_s: float | None = None, names: list[str] | None = None) -> None:
        """Stop every stage (or the ``names`` given) at once: SIGTERM, wait for their drains."""
        with self._lock:
            names = list(self.stages) if names is None else [n for n in names if n in self.stages]
            never = [name for name in names if self.stages[name].restart_at == 0.0]  # added, never started
            for name in names:
                st = self.stages[name]
                st.stopping, st.restart_at = True, None
            names = [name for name in names if name not in never]
            timeout_s = self.stop_timeout_s if timeout_s is None else timeout_s
            last = [name for name in names if self.stages[name].kind in LAST]
            self._stop_all(timeout_s, [name for name in names if name not in last])
            if last:
                self._stop_all(timeout_s, last)

    def _stop_all(self, timeout_s: float, names: list[str]) -> None:
        for name in names:
            self._stop(name, timeout_s)



class StageLost(StreamrlError):
    """A stage that cannot run at all (no node can take it): the run fails naming it."""


class LocalLauncher(Launcher):
    """Child processes, output appended to ``<log_dir>/<name>.log`` (a restart's output follows
    its predecessor's). Children get SIGTERM if this process dies (``PR_SET_PDEATHSIG``), so no
    stage outlives the run. A stage is alive while its metrics answer, or while it uses CPU when
    they do not; silent while its process is stopped (``_alive``)."""

    def __init__(self, log_dir: Path, restart: RestartConfig | None = None, stop_timeout_s: float = 90.0,
                 stage_timeout_s: float = 30.0):
        super().__init__(restart, stop_timeout_s, stage_timeout_s)
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self._log_from: dict[str, int] = {}  # where the current process's output begins in its log
        self._cpu: dict[str, int] = {}  # CPU ticks of a stage whose metrics did not answer, at that look

    def _spawn(self, name: str, argv: list[str], kind: str) -> None:
        self._cpu.pop(name, None)
        with open(self.log_dir / f"{name}.log", "ab") as out:
            self._log_from[name] = out.tell()
            self.procs[name] = subprocess.Popen(
                stage_command(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=dict(os.environ, PYTHONUNBUFFERED="1"), preexec_fn=die_with_parent)

    def _poll(self, name: str) -> int | None:
        return self.procs[name].poll()

    def pid(self, name: str) -> int:
        return self.procs[name].pid

    def _stop(self, name: str, timeout_s: float) -> None:
        stop_process(self.procs[name], timeout_s)

    def _kill(self, name: str) -> None:
        """SIGKILL the stage and every process under it (a stopped process takes no SIGTERM;
        its children would wait for one), then reap it."""
        proc = self.procs[name]
        for pid in [proc.pid, *_descendants(proc.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:  # gone already
                pass
        proc.wait()

    def _alive(self, name: str) -> bool | None:
        """Stopped (SIGSTOP, a debugger): no. Its metrics answer: yes. They do not (not served
        yet, or slow on a loaded machine): yes while it or a process under it uses CPU (a hung
        or frozen process uses none), unknown at the first such look."""
        pid = self.procs[name].pid
        if _state(pid) in ("T", "t"):
            return False
        url = self.stages[name].url
        if url is not None:
            try:
                with urllib.request.urlopen(url, timeout=2.0) as reply:
                    reply.read()
                self._cpu.pop(name, None)
                return True
            except OSError:
                pass
        before, self._cpu[name] = self._cpu.get(name), _cpu_ticks([pid, *_descendants(pid)])
        return None if before is None else self._cpu[name] > before

    def _find_url(self, name: str) -> str | None:
        try:
            with open(self.log_dir / f"{name}.log", "rb") as log_file:
                log_file.seek(self._log_from.get(name, 0))
                text = log_file.read().decode(errors="replace")
        except OSError:
            return None
        return _metrics_url(text)

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


def _metrics_url(text: str) -> str | None:
    """The last ``metrics: URL`` line a stage printed (every long-running verb prints one)."""
    found = re.findall(r"^metrics: (http://\S+)$", text, re.M)
    return found[-1] if found else None


def _state(pid: int) -> str:
    """A process's state letter from /proc (``T``: stopped); "" where it cannot be read."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _cpu_ticks(pids: list[int]) -> int:
    """CPU time (user and system, in clock ticks) the processes have used, from /proc."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)
        except (OSError, IndexError, ValueError):
            continue
    return total


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid``, from /proc (Linux; none elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out
