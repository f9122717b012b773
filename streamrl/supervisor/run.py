"""``streamrl run``'s steps, one function each: plan the run (``streamrl.supervisor.plan``), open
its run directory, broker and runtime, start the stages, watch them until the run ends, stop them
in pipeline order, report a failed stage, summarise.

The run's life (docs/guides/lifecycle.md): it ends when the learner ends (its data is
exhausted, or ``learner.versions`` is reached); the stages then stop in pipeline order (feed and
rollout workers, then the reward group once it has scored what is in ``rollouts``, then the
learner). The embedded broker is supervised: if it dies, every stage is stopped and the run fails
naming it."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import itertools
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from streamrl.errors import StreamrlError
from streamrl.supervisor.autoscale import Autoscale, GroupAutoscale, LagAutoscaler
from streamrl.supervisor.display import make_show, status_line, summarise, summary_line
from streamrl.supervisor.launcher import Launcher
from streamrl.supervisor.observer import Observation, Observer
from streamrl.supervisor.plan import (FINISHED, archive_uri, check_topics, choose_run_dir, dry_run, plan, rollout_notes,
                                      teacher_notes, warm_start)
from streamrl.supervisor.watch import Watch, cancelling, observe_until
from streamrl.verl import ignored_line

#: the process's exit code by how the run ended (any other end: 1)
EXIT_CODES = {"done": 0, "data_exhausted": 0, "interrupted": 130}


def run(args: argparse.Namespace) -> int:
    """``streamrl run``: the plan (``--dry-run`` stops there), then the run; its summary is
    written to ``<run dir>/summary.json`` and printed as one JSON line, the only line on stdout
    (``summary_stdout``). The run never deletes its directory: a run that fails keeps what it
    had, and its summary (``ended: failed`` and why) says how to continue it (``kept``)."""
    from streamrl.errors import need

    resolution, resume = plan(args)
    if getattr(args, "dry_run", False):
        return dry_run(resolution)
    cfg = resolution.config()  # every problem at once, each naming its key as typed
    accepted = ignored_line(resolution.verl)
    if accepted:
        print(f"run: verl keys accepted as not applicable here: {accepted}", file=sys.stderr, flush=True)
    for note in teacher_notes(cfg) + rollout_notes(cfg):  # (verl's drop of teacher_model, the teacher groups,
        # a quantised rollout without rollout correction)
        print(f"run: {note}", file=sys.stderr, flush=True)
    need("torch", "cpu", "streamrl run")  # the learner and the transformers rollout backend
    out, state = open_run_dir(cfg, resume)
    with summary_stdout() as stdout:
        try:
            result = run_in_runtime(cfg, args, out, state)
        except (Exception, KeyboardInterrupt) as exc:
            result = kept(cfg, out, state, exc)
            if result is not None:
                print(json.dumps(result), file=stdout, flush=True)
            raise  # the command's own report: one line and exit 2 for a StreamrlError
        write_summary(out, result)
        print(json.dumps(result), file=stdout, flush=True)
    return EXIT_CODES.get(result["ended"], 1)


def write_summary(out: Path, summary: dict[str, Any]) -> None:
    """``summary.json`` whole, unless its storage is full: then the summary's JSON line on stdout
    is the record of the run's end (a full disk must not turn the end's report into a traceback)."""
    from streamrl.errors import storage_full

    tmp = out / "summary.json.tmp"
    try:
        tmp.write_text(json.dumps(summary, indent=1))
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if not storage_full(exc):
            raise
        summary["summary_json"] = f"not written: {exc.strerror or exc} in {out}"
        return
    os.replace(tmp, out / "summary.json")  # whole or not at all: an earlier session's stays if this fails


@contextlib.contextmanager
def summary_stdout() -> Iterator[Any]:
    """While the run runs, this process's stdout (``sys.stdout`` and file descriptor 1, which
    Ray's driver threads, native libraries and any child without a log of its own write to) goes
    to stderr; yields a file on the real stdout, for the summary's JSON line alone."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    before, sys.stdout = sys.stdout, sys.stderr
    real = os.fdopen(os.dup(saved), "w")
    try:
        yield real
    finally:
        sys.stdout.flush()
        real.close()
        sys.stdout = before
        os.dup2(saved, 1)
        os.close(saved)


def kept(cfg, out: Path, state, exc: BaseException) -> dict | None:
    """A run that failed outside its stages (Ray, the broker, a check, a bug): its directory
    kept with what it had, ``summary.json`` written (``ended: failed`` and why), how to
    continue it printed. None (and the directory gone) only for a new run that wrote nothing
    (a start refused before anything ran)."""
    from streamrl.resume import latest_good

    if state is None and not any(p.is_file() for p in out.rglob("*")):
        shutil.rmtree(out, ignore_errors=True)
        return None
    why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if isinstance(exc, KeyboardInterrupt):
        why = "interrupted"
    elif not isinstance(exc, StreamrlError):
        why = f"{type(exc).__name__}: {why}"
    good = latest_good(out / "checkpoints")
    summary: dict[str, Any] = {"ended": "failed", "failure": {"stage": "run", "error": why}, "out": str(out),
                               "launcher": cfg.run.launcher, "versions": good[1].version if good else 0}
    with contextlib.suppress(OSError, ValueError):  # what the watch saw before, if it saved it
        summary["records"] = json.loads((out / "observation.json").read_text())["sessions"][-1]
    if good is not None:
        summary["resume"] = f"streamrl run --resume {out}  (from version {good[1].version})"
    write_summary(out, summary)
    print(f"run failed: {why}; {out} is kept"
          + (f"; continue with: {summary['resume']}" if good else
             " (no learner checkpoint yet: a new run starts over)"), file=sys.stderr, flush=True)
    return summary


def open_run_dir(cfg, resume: str | None):
    """``(run directory, learner state to resume from or None)`` (``choose_run_dir``), its
    ``logs/`` made."""
    from streamrl.resume import finished_count

    out, state = choose_run_dir(cfg, required=resume is not None)  # absolute: stages run elsewhere
    (out / "logs").mkdir(parents=True, exist_ok=True)
    if state is not None:
        print(f"run: resuming {out} from version {state.version} ({state.trained_records} records trained, "
              f"{finished_count(state)} prompt groups finished)", file=sys.stderr, flush=True)
    return out, state


def run_in_runtime(cfg, args: argparse.Namespace, out: Path, state) -> dict:
    """The run's summary: Ray joined and checked (``--launcher ray``), the embedded broker
    started, the warm start made, then ``supervise`` in a ``Runtime``."""
    from streamrl.runtime import Runtime, open_broker

    # Ray: join the cluster and check it (the broker's reach, every stage's resources) before
    # the broker or any stage starts
    launcher = make_launcher(cfg, out / "logs") if cfg.run.launcher == "ray" else None
    # the embedded broker ends with this process: a SIGKILLed run leaves none behind
    with open_broker(cfg, die_with_parent=True) as (_, broker):
        if cfg.run.warm_start_steps:  # after the broker answered; reused when the run resumes
            args.overrides = [*args.overrides, *warm_start(cfg, out / "warm_start")]
        return Runtime(cfg, "run").run(lambda runtime: supervise(runtime, args, out, launcher, state, broker))


def make_launcher(cfg, log_dir: Path) -> Launcher:
    """The launcher ``run.launcher`` names: processes here, or Ray actors (Ray joined and checked)."""
    from streamrl.supervisor.launcher import LocalLauncher

    run = cfg.run
    if run.launcher == "local":
        return LocalLauncher(log_dir, run.restart, run.stop_timeout_s, run.stage_timeout_s)
    if run.launcher == "ray":
        from streamrl.supervisor.ray_launcher import RayLauncher

        launcher = RayLauncher.for_run(cfg, log_dir, embedded_broker=not cfg.bus.bootstrap_servers)
        for note in launcher.notes:
            print(note, file=sys.stderr, flush=True)
        return launcher
    from streamrl.errors import ConfigError

    raise ConfigError(f"config field 'run.launcher': {cfg.run.launcher!r} is not local or ray")


@dataclass
class Session:
    """One session of a run (a resumed run has several) in its runtime: what its steps share."""

    cfg: Any  # the PipelineConfig
    out: Path  # the run directory
    launcher: Launcher
    observer: Observer
    watch: Watch
    common: list[str]  # every stage's arguments
    archive: str | None  # where the archive stage writes (None: no archive)
    interactive: bool  # stderr is a terminal: the status line is redrawn in place
    ended: str = "interrupted"  # why the run ended, once it has
    ids: dict[str, Iterator[int]] = field(default_factory=dict)  # reward-N, teacher-N: the next N

    def start(self, name: str, verb: str, *extra: str) -> None:
        self.launcher.start(name, [verb, *self.common, *extra], verb)

    def start_member(self, verb: str, teacher: str = "") -> None:
        """One more member of a consumer group (``reward``, ``teacher``): ``<verb>-<n>``; with
        several teachers, one of teacher ``NAME``'s group: ``teacher-<NAME>-<n>``."""
        self.start(*self._member(verb, teacher))

    def add_member(self, verb: str, teacher: str = "") -> None:
        """``start_member`` from the run's loop: started by the launcher's next supervision, in
        its thread (the loop never waits on the launcher)."""
        name, verb, *extra = self._member(verb, teacher)
        self.launcher.add(name, [verb, *self.common, *extra], verb)

    def _member(self, verb: str, teacher: str) -> tuple[str, ...]:
        """``(name, verb, *extra arguments)`` of the group's next member."""
        group = f"{verb}-{teacher}" if teacher else verb
        return (f"{group}-{next(self.ids.setdefault(group, itertools.count()))}", verb,
                *(["--teacher", teacher] if teacher else []))


async def supervise(runtime, args: argparse.Namespace, out: Path, launcher: Launcher | None = None,
                    state=None, broker=None) -> dict:
    """The supervisor's loop, in the runtime (its bus, topics, signals; the stages serve the
    metrics): start the stages, watch the pipeline until it ends, stop them in order, summarise."""
    await runtime.start(metrics=False)
    fresh = await check_topics(runtime.bus, state, out)
    session = await open_session(runtime, args, out, launcher, state, fresh, broker)
    try:
        start_stages(session)
        session.ended = await asyncio.wait_for(observe_until(session.observer, session.launcher, session.watch),
                                               timeout=session.cfg.run.timeout_s)
    except asyncio.TimeoutError:
        session.ended = "timeout"
    finally:
        await finish(session)
    return summarise_run(session, failure_report(session))


def stage_arguments(cfg, args: argparse.Namespace, out: Path, state,
                    fresh: bool) -> tuple[list[str], Observation | None]:
    """``(every stage's arguments, the observation a resumed run's earlier sessions left or
    None)``. Every stage gets the run's directories: rollout workers load weights only from
    there."""
    common = ["--bootstrap-servers", cfg.bus.bootstrap_servers, "--config", args.config, *args.overrides,
              "metrics.port=0", f"learner.checkpoint_dir={out}/checkpoints", f"learner.weights_dir={out}/weights"]
    carried = None
    if state is not None:
        common.append("feed.resume=true")  # what the checkpoint finished (or the topic holds) is not fed again
        if fresh:  # new topics (the embedded broker): the checkpoint's offsets and counts were of the old ones
            common += ["learner.checkpoint_offsets=false", f"rollout.gate_baseline={-state.trained_records}"]
            try:
                before = json.loads((out / "observation.json").read_text())
            except (OSError, ValueError, TypeError):
                before = {}  # none written (killed before its figures first moved): the summary starts here
            carried = Observation.carried_over(before, state.trained_records)
    return common, carried


def teacher_input(cfg) -> str:
    """The teacher group's input topic: ``rewarded``, ``rollouts`` (distillation without task
    rewards: no reward group runs), or "" without distillation."""
    if not cfg.distillation.enabled:
        return ""
    return "rewarded" if cfg.distillation.distillation_loss.use_task_rewards else "rollouts"


def teacher_groups(cfg) -> dict[str, str]:
    """Each teacher's consumer group by its label (``teacher`` for a run's only one); {} without
    distillation."""
    if not cfg.distillation.enabled:
        return {}
    return {t.label: t.group(cfg.bus.group("teacher", "")) for t in cfg.distillation.teachers(cfg.teacher).values()}


def learner_ended(out: Path) -> str:
    """Why the learner exited 0, from its last checkpoint: ``data_exhausted`` or ``done``."""
    from streamrl.resume import latest_good

    good = latest_good(out / "checkpoints")
    return "data_exhausted" if good and good[1].ended == "data_exhausted" else "done"


async def open_session(runtime, args: argparse.Namespace, out: Path, launcher: Launcher | None, state,
                       fresh: bool, broker) -> Session:
    """The session's launcher, observer (started) and watch; no stage started yet."""
    cfg = runtime.cfg
    common, carried = stage_arguments(cfg, args, out, state, fresh)
    observer = Observer(runtime.bus, reward_group=cfg.bus.group("reward", cfg.reward.group), carried=carried,
                        teacher_groups=teacher_groups(cfg), teacher_input=teacher_input(cfg))
    interactive = sys.stderr.isatty()
    watch = Watch(target_versions=cfg.learner.versions, stop=runtime.stop_event,
                  broker_exited=broker.exited if broker is not None else (lambda: None),
                  bootstrap=cfg.bus.bootstrap_servers, learner_ended=functools.partial(learner_ended, out),
                  show=make_show(interactive),
                  status_interval_s=cfg.run.status_interval_s if interactive else max(5.0, cfg.run.status_interval_s),
                  keep=lambda obs: obs.save(out / "observation.json"), stall_warn_s=cfg.run.stall_warn_s,
                  stall_timeout_s=cfg.run.stall_timeout_s, unavailable_timeout_s=cfg.bus.unavailable_timeout_s)
    session = Session(cfg, out, launcher or make_launcher(cfg, out / "logs"), observer, watch, common,
                      archive_uri(cfg, out), interactive)
    groups = []
    auto = cfg.run.autoscale
    if auto.max_members and teacher_input(cfg) != "rollouts":  # distillation alone: no reward group
        scaler = LagAutoscaler(auto.min_members, auto.max_members, auto.scale_up_lag, auto.scale_down_lag,
                               auto.window_s, auto.cooldown_s)
        groups.append(GroupAutoscale("reward", scaler, functools.partial(session.add_member, "reward"),
                                     observer.reward_lag))
    auto = cfg.run.teacher_autoscale
    for teacher in cfg.distillation.teachers(cfg.teacher).values() if auto.max_members and teacher_input(cfg) else ():
        scaler = LagAutoscaler(auto.min_members, auto.max_members, auto.scale_up_lag, auto.scale_down_lag,
                               auto.window_s, auto.cooldown_s)  # each teacher's group on its own lag
        groups.append(GroupAutoscale(f"teacher-{teacher.name}" if teacher.name else "teacher", scaler,
                                     functools.partial(session.add_member, "teacher", teacher.name),
                                     functools.partial(observer.teacher_lag, teacher.label)))
    if groups:
        watch.autoscale = Autoscale(groups)
    await observer.start()
    return session


def start_stages(session: Session) -> None:
    """Every stage, in the order the placement check assumes: the learner, the archive, eval and
    track stages, the reward group, the teacher group, the rollout workers, the feed."""
    cfg, out = session.cfg, session.out
    distill = teacher_input(cfg)
    session.start("learner", "learner")
    if session.archive:  # stopped after the others (launcher.LAST): it reads what they wrote to the end
        keep = [] if not distill or "distilled" in cfg.archive.topics else \
            [f"archive.topics=[{','.join([*cfg.archive.topics, 'distilled'])}]"]  # the teacher's annotations too
        session.start("archive", "archive", f"archive.uri={session.archive}", *keep)
    if cfg.eval.enabled:  # evaluates versions as they come; ends after the last one
        session.start("eval", "eval")
    if cfg.tracking.loggers:  # one process logs each version once (stopped last: reads to the end)
        session.start("track", "track", f"tracking.dir={cfg.tracking.dir or out / 'tracking'}",
                      f"tracking.experiment={cfg.tracking.experiment or out.name}")
    for _ in range(cfg.run.reward_members if distill != "rollouts" else 0):  # distillation alone: no reward group
        session.start_member("reward")
    for teacher in cfg.distillation.teachers(cfg.teacher).values() if distill else ():  # one group per teacher
        for _ in range(teacher.members or cfg.run.teacher_members):
            session.start_member("teacher", teacher.name)
    for i in range(cfg.run.rollout_workers):
        session.start(f"rollout-{i}", "rollout")
    session.start("feed", "feed")
    print(f"run: {out} ({cfg.run.launcher} launcher, logs in {out / 'logs'}); Ctrl-C stops every stage",
          file=sys.stderr, flush=True)


async def finish(session: Session) -> None:
    """After the watch: the stages stopped (``stop_in_order``), a last poll and status line
    while the broker answers (after a normal end, every rollout's id read for the summary), the
    observer closed."""
    ended, watch, observer = session.ended, session.watch, session.observer
    if ended == "failed:broker":
        print(f"run: {watch.failure}", file=sys.stderr, flush=True)
    await stop_in_order(session.launcher, observer, session.cfg, "failed:broker" if watch.unreachable else ended)
    gone = ended == "failed:broker" or watch.unreachable  # nothing to read: do not wait for it
    if not gone and await bounded(observer.poll(timeout_ms=200), 5) is not None:
        if ended in FINISHED:
            await bounded(observer.read_ids(), 60)
        watch.show(status_line(observer.obs, session.cfg.learner.versions, session.launcher.restart_count()))
    if session.interactive:
        print(file=sys.stderr)
    await bounded(observer.stop(), 1 if gone else 5)


def failure_report(session: Session) -> dict | None:
    """A stage that failed the run: its exit code and the last line of its log (its log's tail
    printed); None when none did (the broker's failure is the watch's)."""
    ended, launcher = session.ended, session.launcher
    if not ended.startswith("failed:") or ended == "failed:broker":
        return None
    name = ended.split(":", 1)[1]
    tail = launcher.log_tail(name)
    why = launcher.failure(name) or f"exited with {launcher.returncode(name)}"
    print(f"run: {name} {why}; its log ends:\n{tail}", file=sys.stderr)
    last = next((line.strip() for line in reversed(tail.splitlines()) if line.strip()), "")
    said = launcher.failure(name)  # the launcher's own reason (not placed, silent), else its log's
    return {"stage": name, "returncode": launcher.returncode(name), "why": why,
            "error": said if said and not said.startswith("exited with") else last}


def summarise_run(session: Session, failure: dict | None) -> dict:
    """The run's summary (``display.summarise`` and the run's own fields), its plot and
    observation saved, the command that resumes it when it did not finish, its last line printed."""
    from streamrl.resume import latest_good

    cfg, out, ended, observer = session.cfg, session.out, session.ended, session.observer
    summary = summarise(observer.obs, out / "reward.png")
    observer.obs.save(out / "observation.json")
    summary.update(ended=ended, out=str(out), launcher=cfg.run.launcher, restarts=session.launcher.restart_count(),
                   archive=session.archive)
    if failure:
        summary["failure"] = failure
    elif session.watch.failure:
        summary["failure"] = {"stage": "broker" if ended == "failed:broker" else "run", "error": session.watch.failure}
    good = latest_good(out / "checkpoints")
    if ended not in FINISHED and good is not None:
        summary["resume"] = f"streamrl run --resume {out}  (from version {good[1].version})"
        print(f"run: checkpoints stay in {out / 'checkpoints'}; continue with: {summary['resume']}",
              file=sys.stderr, flush=True)
    print(summary_line(summary, cfg.run.timeout_s), file=sys.stderr, flush=True)
    return summary


async def bounded(coro, timeout_s: float):
    """``coro``'s result, or None if it failed or took longer than ``timeout_s`` (the broker may
    be gone: a Kafka client's calls then fail, hang, or end in its own cancellations)."""
    try:
        return await asyncio.wait_for(coro, timeout_s)
    except (Exception, asyncio.CancelledError):
        if cancelling():
            raise  # this task itself is being cancelled
        return None


async def stop_in_order(launcher: Launcher, observer: Observer, cfg, ended: str) -> None:
    """After a normal end, stop in pipeline order: the feed and the rollout workers (nothing new
    enters ``rollouts``), then the reward group once it has scored or dead-lettered what is
    there (up to ``run.drain_timeout_s``), then the teacher group likewise, then the learner,
    then (up to ``eval.end_timeout_s``) the eval stage once it has evaluated the last version:
    the summary accounts for every record. Ctrl-C and failures stop everything at once; with the
    broker gone, the stages get 5 s (nothing can drain) before SIGKILL."""
    if ended == "failed:broker":  # or unreachable when stopped
        await asyncio.to_thread(launcher.stop_all, min(5.0, cfg.run.stop_timeout_s))
        return
    if ended not in FINISHED:
        await asyncio.to_thread(launcher.stop_all)
        return
    names = launcher.names()
    members = observer.obs.members  # each member's last count, before it stops: the summary's
    await bounded(members.scrape(launcher, force=True), 10)
    await asyncio.to_thread(launcher.stop_all, None, [n for n in names if n == "feed" or n.startswith("rollout-")])
    rewards = [n for n in names if n.startswith("reward-")]
    # the group committed everything: each record is rewarded or dead-lettered (commits follow
    # the acknowledgements of outputs); exact with duplicates, unlike a count
    await drain(observer, launcher, observer.reward_lag, cfg.run.drain_timeout_s,
                lambda: any(launcher.returncode(n) is None for n in rewards))
    await asyncio.sleep(0.5)  # the members count a commit just after the broker has it
    await bounded(members.scrape(launcher, force=True), 10)
    await asyncio.to_thread(launcher.stop_all, None, rewards)
    teachers = [n for n in names if n.startswith("teacher-")]
    # then the teacher group, likewise, on its input
    await drain(observer, launcher, observer.teacher_lag, cfg.run.drain_timeout_s, lambda: bool(teachers))
    await asyncio.to_thread(launcher.stop_all, None, teachers)
    if "eval" in names:  # the run ends after the last version's evaluation (the stage then exits)
        await asyncio.to_thread(launcher.stop_all, None, ["learner"])
        deadline = time.monotonic() + cfg.eval.end_timeout_s
        while time.monotonic() < deadline and launcher.returncode("eval") is None:
            await asyncio.sleep(0.5)
            await supervise_once(launcher)  # an eval stage that crashes now is restarted
        await bounded(observer.poll(), 5)
    await asyncio.to_thread(launcher.stop_all)


async def drain(observer: Observer, launcher: Launcher, lag: Callable[[], Any], timeout_s: float,
                waiting: Callable[[], bool]) -> None:
    """Wait (up to ``timeout_s``, while ``waiting()``) until a consumer group's ``lag()`` is 0:
    it has committed everything on its input. A member that crashes meanwhile is restarted."""
    deadline = time.monotonic() + timeout_s
    while waiting() and time.monotonic() < deadline:
        await bounded(observer.poll(), 5)
        left = await bounded(lag(), 5)
        if left is None or left <= 0:
            break
        await supervise_once(launcher)


async def supervise_once(launcher: Launcher) -> None:
    """One supervision while the run stops (no status line then): its events on stderr."""
    for event in await asyncio.to_thread(launcher.supervise):
        print(event, file=sys.stderr, flush=True)
