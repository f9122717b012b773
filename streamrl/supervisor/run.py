"""``streamrl run [CONFIG]``: the whole pipeline on the embedded broker (or ``--bootstrap-servers``):
broker, topics, learner, reward group, rollout workers and the prompt feed, each its own process
(or Ray actor), with a live status line; at the end a summary, a plot, and one JSON line.

The run's life (docs/guides/lifecycle.md): it ends when the learner ends (its data is
exhausted, or ``learner.versions`` is reached); the stages then stop in pipeline order (feed and
rollout workers, then the reward group once it has scored what is in ``rollouts``, then the
learner). ``--resume [RUN_DIR]`` (``run.resume``) continues a stopped run from its learner's
checkpoint. A fresh run refuses topics that hold another run's records. The embedded broker is
supervised: if it dies, every stage is stopped and the run fails naming it."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import shutil
import sys
import time
from pathlib import Path

from streamrl.commands.common import add_bootstrap_argument
from streamrl.errors import StreamrlError
from streamrl.verl_keys import ignored_line

HELP = "run the whole pipeline (embedded broker by default) and print a JSON summary"
DEFAULT_CONFIG = "local.yaml"  # the packaged embedded default (streamrl.packaged)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default=DEFAULT_CONFIG,
                        help=f"pipeline YAML: a file or a packaged name (default {DEFAULT_CONFIG}, the embedded default)")
    add_bootstrap_argument(parser)
    parser.add_argument("--run-dir", metavar="DIR", help="where runs go (run.out_dir, default ./runs): DIR/<run id>/")
    parser.add_argument("--launcher", choices=["local", "ray"], help="run.launcher: processes here, or Ray actors")
    parser.add_argument("--autoscale", metavar="MIN:MAX", help="size the reward group by its consumer lag")
    parser.add_argument("--resume", nargs="?", const="auto", metavar="RUN_DIR",
                        help="continue a stopped run (run.resume): RUN_DIR, or the newest unfinished one "
                             "under run.out_dir")
    parser.add_argument("--dry-run", action="store_true",
                        help="resolve and check the config without starting anything (no broker, model download or "
                             "network): print it as YAML, then what each verl key given became; exit 0 where "
                             "`streamrl run` would start, 2 otherwise, listing every problem")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value")


def main(args: argparse.Namespace) -> int:
    from streamrl.errors import need
    from streamrl.packaged import resolve_config
    from streamrl.runtime import Runtime, open_broker

    if "=" in args.config and not Path(args.config).exists():  # `streamrl run a.b=c`: no config given
        args.overrides, args.config = [args.config, *args.overrides], DEFAULT_CONFIG
    resume = getattr(args, "resume", None)
    if resume not in (None, "auto") and not Path(resume).is_dir():  # `--resume a.b=c`, `--resume x.yaml`
        if "=" in resume:
            args.overrides, resume = [resume, *args.overrides], "auto"
        elif resume.endswith((".yaml", ".yml")) and args.config == DEFAULT_CONFIG:
            args.config, resume = resume, "auto"
    args.config = str(resolve_config(args.config).resolve())  # the stages get the same file, by path
    resolution = resolve(args, resume)
    if getattr(args, "dry_run", False):
        return dry_run(resolution)
    cfg = resolution.config()  # every problem at once, each naming its key as typed
    accepted = ignored_line(resolution.verl)
    if accepted:
        print(f"run: verl keys accepted as not applicable here: {accepted}", file=sys.stderr, flush=True)
    need("torch", "cpu", "streamrl run")  # the learner and the transformers rollout backend
    out, state = choose_run_dir(cfg, required=resume is not None)  # absolute: stages run elsewhere
    new = state is None
    (out / "logs").mkdir(parents=True, exist_ok=True)
    if state is not None:
        print(f"run: resuming {out} from version {state.version} ({state.trained_records} records trained, "
              f"{len(state.done_groups)} prompt groups finished)", file=sys.stderr, flush=True)
    try:
        # Ray: join the cluster and check it (the broker's reach, every stage's resources) before
        # the broker or any stage starts
        launcher = make_launcher(cfg, out / "logs") if cfg.run.launcher == "ray" else None
        # the embedded broker ends with this process: a SIGKILLed run leaves none behind
        with open_broker(cfg, die_with_parent=True) as (_, broker):
            if cfg.run.warm_start_steps:  # after the broker answered; reused when the run resumes
                args.overrides = [*args.overrides, *warm_start(cfg, out / "warm_start")]
            result = Runtime(cfg, "run").run(lambda runtime: _run(runtime, args, out, launcher, state, broker))
    except StreamrlError:
        if new:  # refused before anything ran: leave no empty run behind
            shutil.rmtree(out, ignore_errors=True)
        raise
    (out / "summary.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result), flush=True)
    return {"done": 0, "data_exhausted": 0, "interrupted": 130}.get(result["ended"], 1)


#: how a finished run ended: ``--resume``/``run.resume=auto`` do not pick it again
FINISHED = ("done", "data_exhausted")


def choose_run_dir(cfg, required: bool):
    """``(run directory, learner state to resume from or None)`` by ``run.resume``: ``never``
    (a new directory), ``auto`` (the unfinished run under ``run.out_dir`` with the newest
    readable checkpoint, else a new one; ``required``: else an error), or a directory."""
    from streamrl.errors import ConfigError, StreamrlError
    from streamrl.learner import checkpoint

    root = Path(cfg.run.out_dir).resolve()
    mode = cfg.run.resume
    if mode not in ("auto", "never"):
        path = Path(mode).resolve()
        good = checkpoint.latest_good(path / "checkpoints")
        if good is None:
            raise ConfigError(f"config field 'run.resume': {path} holds no readable learner checkpoint "
                              f"(checkpoints/ckpt-*): nothing to resume")
        return path, good[1]
    if mode == "auto":
        found = []
        for path in (p for p in root.iterdir() if p.is_dir()) if root.is_dir() else ():
            try:
                ended = json.loads((path / "summary.json").read_text()).get("ended")
            except (OSError, ValueError, AttributeError):
                ended = None
            good = checkpoint.latest_good(path / "checkpoints") if ended not in FINISHED else None
            if good is not None and good[1].ended != "data_exhausted":
                found.append((good[0].stat().st_mtime, path, good[1]))
        if found:
            _, path, state = max(found, key=lambda f: f[0])
            return path, state
        if required:
            raise StreamrlError(f"--resume: no unfinished run with a readable checkpoint under {root} "
                                f"(name one: --resume RUN_DIR)")
    elif required:
        raise ConfigError("config field 'run.resume': never, but --resume was given")
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = root / stamp
    for n in itertools.count(2):
        if not out.exists():
            return out, None
        out = root / f"{stamp}-{n}"


async def topic_contents(bus) -> dict[str, int]:
    """Records on each of the pipeline's topics (end offsets summed)."""
    from streamrl.bus import Reader

    names = ["prompts", "rollouts", "rewarded", "policy", "deadletter", "distilled"]
    async with Reader(bus, names, "run") as reader:
        ends = await reader.end_offsets()
    out = dict.fromkeys(names, 0)
    for tp, end in ends.items():
        out[bus.config.short_topic(tp.topic)] += end
    return out


async def check_topics(bus, state, out: Path) -> bool:
    """Whether the topics are new (empty). A new run refuses topics holding records (another
    run's: sharing them would mix two runs' prompts, versions and weights); a resumed one
    refuses a policy topic of another training line than its checkpoint's."""
    from streamrl.errors import StreamrlError
    from streamrl.learner.versions import read_latest_policy

    held = await topic_contents(bus)
    if not any(held.values()):
        return True
    prefix, where = bus.config.topic_prefix, bus.config.bootstrap_servers
    todo = (f"continue that run with `streamrl run --resume RUN_DIR`, start this one on other topics "
            f"(bus.topic_prefix=NAME), or delete the topics {prefix}.* first")
    if state is None:
        raise StreamrlError(f"the topics {prefix}.* on {where} hold another run's records ({held['prompts']} prompts, "
                            f"{held['rollouts']} rollouts, {held['policy']} policy records): {todo}")
    latest = await read_latest_policy(bus, "run")
    if latest is not None and latest.lineage and latest.lineage != state.lineage and latest.lineage not in state.abandoned:
        raise StreamrlError(f"the topics {prefix}.* on {where} hold another run's policy (line {latest.lineage}, "
                            f"version {latest.version}), not the line of {out} ({state.lineage}): {todo}")
    return False


def resolve(args: argparse.Namespace, resume: str | None):
    """The run's config as ``streamrl.pipeline_config.Resolution``: the file and overrides, the
    command line's own flags, then every stage's checks (``validate_stages``), each problem
    collected, none raised."""
    from streamrl.pipeline_config import resolve_config as resolve_pipeline

    resolution = resolve_pipeline(args.config, args.overrides or ())
    cfg = resolution.cfg
    if cfg is None:
        return resolution
    if args.bootstrap_servers:
        cfg.bus.bootstrap_servers = args.bootstrap_servers
    if args.run_dir:
        cfg.run.out_dir = args.run_dir
    if resume is not None:
        cfg.run.resume = resume
    if args.launcher:
        cfg.run.launcher = args.launcher
    if args.autoscale:
        low, _, high = args.autoscale.partition(":")
        if not (low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high)):
            resolution.problems.append(f"--autoscale wants MIN:MAX with 1 <= MIN <= MAX, got {args.autoscale!r}")
        else:
            cfg.run.autoscale.min_members, cfg.run.autoscale.max_members = int(low), int(high)
            cfg.run.reward_members = min(max(cfg.run.reward_members, int(low)), int(high))
    for check in (cfg.feed.validate, cfg.rollout.validate, cfg.learner.validate, lambda: validate_reward(cfg),
                  cfg.teacher.validate):
        resolution.check(check)
    return resolution


def dry_run(resolution) -> int:
    """``--dry-run``: the resolved config as YAML on stdout, then (as YAML comments) what each
    verl key given became and the run's length; every problem on stderr, one line each. 0
    where ``streamrl run`` would start, 2 otherwise."""
    from streamrl.config import to_yaml

    if resolution.cfg is not None:
        print(to_yaml(resolution.cfg), end="")
        if resolution.verl:
            print(f"# verl keys given: {len(resolution.verl)}")
            for outcome in resolution.verl:
                print(f"#   {outcome.line()}")
        for note in run_length(resolution.cfg):
            print(f"# {note}")
    sys.stdout.flush()
    if resolution.problems:
        error = resolution.error()
        print(f"streamrl run: {error}", file=sys.stderr)
        return 2
    return 0


def run_length(cfg) -> list[str]:
    """How long the run is: ``learner.versions``, or, where it ends with the data (verl's
    ``total_epochs`` alone), the versions the data makes when the dataset can be read here
    (a local file or a generated task: no download)."""
    from streamrl.tasks import is_task

    per_version = cfg.learner.groups_per_mini_batch * cfg.learner.mini_batches_per_version
    if cfg.learner.versions:
        return [f"the run: {cfg.learner.versions} versions of {per_version} prompts x {cfg.feed.group_size} samples"]
    specs = [cfg.feed.dataset, *cfg.feed.more_datasets]
    if not all(Path(s).is_file() or is_task(s) for s in specs):
        return [f"the run: until the data ends ({cfg.feed.epochs} epochs of {', '.join(specs)}, not read here), "
                f"{per_version} prompts x {cfg.feed.group_size} samples per version"]
    from streamrl.rollout.feed import read_feed_rows

    rows = len(read_feed_rows(cfg.feed))
    versions = -(-rows * cfg.feed.epochs // per_version)
    return [f"the run: until the data ends: {rows} rows x {cfg.feed.epochs} epochs / {per_version} prompts per "
            f"version = {versions} versions (before max_prompt_length's filter)"]


def validate_reward(cfg) -> None:
    """The reward stage's scorer table built (user functions loaded, signatures checked) and
    closed. Under Ray with ``run.ray.working_dir`` the stages run in that directory, so relative
    scorer paths are resolved from it."""
    import os

    from streamrl.reward.table import build_table

    here = os.getcwd()
    working_dir = os.path.expanduser(cfg.run.ray.working_dir) if cfg.run.launcher == "ray" else ""
    if working_dir and os.path.isdir(working_dir):
        os.chdir(working_dir)
    try:
        table = build_table(cfg.reward.validate())
    finally:
        os.chdir(here)
    if table.runner is not None:
        table.runner.close()


def validate_stages(cfg) -> None:
    """Every stage's section checked as that stage checks it at its start, and the reward
    stage's scorer table built and closed, before the broker or any stage starts: a bad field
    is one line and exit 2 here, not a stage that fails 15 s later. Nothing heavy loads (no
    policy, dataset or reward-model weights). ``resolve`` does the same, collecting."""
    cfg.feed.validate()
    cfg.rollout.validate()
    cfg.learner.validate()
    validate_reward(cfg)


def warm_start(cfg, directory: Path) -> list[str]:
    """``run.warm_start_steps``: the feed's task teaches the policy its format (streamrl.tasks);
    the overrides that make the learner and the rollout workers start from it."""
    from streamrl.tasks import TASKS, task_name

    task = TASKS.get(task_name(cfg.feed.dataset))
    if task is None:  # a dataset of the user's (local.yaml with feed.dataset=FILE): train it as it is
        print(f"run: no warm start: run.warm_start_steps applies to a generated task ({', '.join(TASKS)}), "
              f"and feed.dataset is {cfg.feed.dataset!r}", file=sys.stderr, flush=True)
        return []
    started = time.time()
    path = task.warm_start(directory, policy=cfg.learner.policy, seed=cfg.learner.seed, steps=cfg.run.warm_start_steps)
    print(f"run: warm start ({cfg.run.warm_start_steps} supervised steps on the {task.NAME} format) "
          f"in {time.time() - started:.1f}s: {path}", file=sys.stderr, flush=True)
    return [f"learner.policy={path}", f"rollout.policy={path}"]


def make_launcher(cfg, log_dir: Path):
    from streamrl.supervisor.launcher import LocalLauncher

    run = cfg.run
    if run.launcher == "local":
        return LocalLauncher(log_dir, run.restart, run.stop_timeout_s)
    if run.launcher == "ray":
        from streamrl.supervisor.ray_launcher import RayLauncher

        launcher = RayLauncher.for_run(cfg, log_dir, embedded_broker=not cfg.bus.bootstrap_servers)
        for note in launcher.notes:
            print(note, file=sys.stderr, flush=True)
        return launcher
    from streamrl.errors import ConfigError

    raise ConfigError(f"config field 'run.launcher': {cfg.run.launcher!r} is not local or ray")


def archive_uri(cfg, out: Path) -> str | None:
    """Where the run's archive stage writes: ``archive.uri``, else ``<run dir>/archive``; None
    when off. Under Ray only with ``archive.uri`` set (a bucket or a path every node shares):
    the run directory is on this machine, the stage's actor maybe on another."""
    if not cfg.archive.enabled:
        return None
    if cfg.archive.uri:
        return cfg.archive.uri
    if cfg.run.launcher == "ray":
        print("run: no archive (with --launcher ray set archive.uri to a bucket or a shared path)",
              file=sys.stderr, flush=True)
        return None
    return str(out / "archive")


async def _run(runtime, args, out: Path, launcher=None, state=None, broker=None) -> dict:
    """The supervisor's loop, in the runtime (its bus, topics, signals; the stages serve the
    metrics): start the stages, watch the pipeline until it ends, stop them in order, summarise."""
    from streamrl.supervisor.launcher import LagAutoscaler
    from streamrl.learner import checkpoint
    from streamrl.supervisor.observer import Observation, Observer, Watch, observe_until, status_line, summarise

    cfg, bus, stop, bootstrap = runtime.cfg, runtime.bus, runtime.stop_event, runtime.cfg.bus.bootstrap_servers
    await runtime.start(metrics=False)
    fresh = await check_topics(bus, state, out)
    # every stage gets the run's directories: rollout workers load weights only from there
    common = ["--bootstrap-servers", bootstrap, "--config", args.config, *args.overrides, "metrics.port=0",
              f"learner.checkpoint_dir={out}/checkpoints", f"learner.weights_dir={out}/weights"]
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
    launcher = launcher or make_launcher(cfg, out / "logs")
    archive = archive_uri(cfg, out)
    interactive = sys.stderr.isatty()

    def show(line: str) -> None:
        if interactive:
            print("\r\033[K" + line, end="", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)

    reward_ids = itertools.count()

    def start_reward() -> None:
        launcher.start(f"reward-{next(reward_ids)}", ["reward", *common], "reward")

    teacher_ids = itertools.count()
    distill = cfg.distillation if cfg.distillation.enabled else None
    task_rewards = distill is None or distill.distillation_loss.use_task_rewards

    def start_teacher() -> None:
        launcher.start(f"teacher-{next(teacher_ids)}", ["teacher", *common], "teacher")

    def learner_ended() -> str:
        good = checkpoint.latest_good(out / "checkpoints")
        return "data_exhausted" if good and good[1].ended == "data_exhausted" else "done"

    auto = cfg.run.autoscale
    scaler = LagAutoscaler(auto.min_members, auto.max_members, auto.scale_up_lag, auto.scale_down_lag,
                           auto.window_s, auto.cooldown_s) if auto.max_members else None
    observer = Observer(bus, reward_group=cfg.bus.group("reward", cfg.reward.group), carried=carried,
                        teacher_group=cfg.bus.group("teacher", cfg.teacher.group),
                        teacher_input="" if distill is None else "rewarded" if task_rewards else "rollouts")
    watch = Watch(broker_exited=broker.exited if broker is not None else (lambda: None), bootstrap=bootstrap,
                  learner_ended=learner_ended, stall_warn_s=cfg.run.stall_warn_s,
                  stall_timeout_s=cfg.run.stall_timeout_s, unavailable_timeout_s=cfg.bus.unavailable_timeout_s)
    await observer.start()
    ended = "interrupted"
    try:
        launcher.start("learner", ["learner", *common], "learner")
        if archive:  # stopped after the others (launching.LAST): it reads what they wrote to the end
            keep = [] if distill is None or "distilled" in cfg.archive.topics else \
                [f"archive.topics=[{','.join([*cfg.archive.topics, 'distilled'])}]"]  # the teacher's annotations too
            launcher.start("archive", ["archive", *common, f"archive.uri={archive}", *keep], "archive")
        if cfg.eval.enabled:  # evaluates versions as they come; ends after the last one
            launcher.start("eval", ["eval", *common], "eval")
        if cfg.tracking.loggers:  # one process logs each version once (stopped last: reads to the end)
            launcher.start("track", ["track", *common, f"tracking.dir={cfg.tracking.dir or out / 'tracking'}",
                                     f"tracking.experiment={cfg.tracking.experiment or out.name}"], "track")
        for _ in range(cfg.run.reward_members if task_rewards else 0):  # distillation alone: no reward group
            start_reward()
        for _ in range(cfg.run.teacher_members if distill is not None else 0):
            start_teacher()
        for i in range(cfg.run.rollout_workers):
            launcher.start(f"rollout-{i}", ["rollout", *common], "rollout")
        launcher.start("feed", ["feed", *common], "feed")
        print(f"run: {out} ({cfg.run.launcher} launcher, logs in {out / 'logs'}); Ctrl-C stops every stage",
              file=sys.stderr, flush=True)
        interval = cfg.run.status_interval_s if interactive else max(5.0, cfg.run.status_interval_s)
        ended = await asyncio.wait_for(
            observe_until(observer, launcher, cfg.learner.versions, stop, show, interval, scaler, start_reward,
                          watch, keep=lambda obs: obs.save(out / "observation.json")),
            timeout=cfg.run.timeout_s)
    except asyncio.TimeoutError:
        ended = "timeout"
    finally:
        if ended == "failed:broker":
            print(f"run: {watch.failure}", file=sys.stderr, flush=True)
        await stop_in_order(launcher, observer, cfg, "failed:broker" if watch.unreachable else ended)
        gone = ended == "failed:broker" or watch.unreachable  # nothing to read: do not wait for it
        if not gone and await bounded(observer.poll(timeout_ms=200), 5) is not None:
            if ended in FINISHED:
                await bounded(observer.read_rollout_ids(), 60)
            show(status_line(observer.obs, cfg.learner.versions, launcher.restart_count()))
        if interactive:
            print(file=sys.stderr)
        await bounded(observer.stop(), 1 if gone else 5)
    failure = None
    if ended.startswith("failed:") and ended != "failed:broker":
        name = ended.split(":", 1)[1]
        tail = launcher.log_tail(name)
        print(f"run: {name} exited with {launcher.returncode(name)}; its log ends:\n{tail}", file=sys.stderr)
        failure = {"stage": name, "returncode": launcher.returncode(name),
                   "error": next((line.strip() for line in reversed(tail.splitlines()) if line.strip()), "")}
    summary = summarise(observer.obs, out / "reward.png")
    observer.obs.save(out / "observation.json")
    summary.update(ended=ended, out=str(out), launcher=cfg.run.launcher, restarts=launcher.restart_count(),
                   archive=archive)
    if failure:
        summary["failure"] = failure
    elif watch.failure:
        summary["failure"] = {"stage": "broker" if ended == "failed:broker" else "run", "error": watch.failure}
    good = checkpoint.latest_good(out / "checkpoints")
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
        from streamrl.supervisor.observer import cancelling

        if cancelling():
            raise  # this task itself is being cancelled
        return None


async def stop_in_order(launcher, observer, cfg, ended: str) -> None:
    """After a normal end, stop in pipeline order: the feed and the rollout workers (nothing new
    enters ``rollouts``), then the reward group once it has scored or dead-lettered what is
    there (up to ``run.drain_timeout_s``), then the learner, then (up to ``eval.end_timeout_s``)
    the eval stage once it has evaluated the last version: the summary accounts for every
    record. Ctrl-C and failures stop everything at once; with the broker gone, the stages get
    5 s (nothing can drain) before SIGKILL."""
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
    deadline = time.monotonic() + cfg.run.drain_timeout_s
    while time.monotonic() < deadline and any(launcher.returncode(n) is None for n in rewards):
        # the group committed everything: each record is rewarded or dead-lettered (commits
        # follow the acknowledgements of outputs); exact with duplicates, unlike a count
        await bounded(observer.poll(), 5)
        lag = await bounded(observer.reward_lag(), 5)
        if lag is None or lag <= 0:
            break
        await asyncio.to_thread(launcher.supervise)  # a reward member that crashes now is restarted
    await asyncio.sleep(0.5)  # the members count a commit just after the broker has it
    await bounded(members.scrape(launcher, force=True), 10)
    await asyncio.to_thread(launcher.stop_all, None, rewards)
    teachers = [n for n in names if n.startswith("teacher-")]
    deadline = time.monotonic() + cfg.run.drain_timeout_s
    while teachers and time.monotonic() < deadline:  # then the teacher group, likewise, on its input
        await bounded(observer.poll(), 5)
        lag = await bounded(observer.teacher_lag(), 5)
        if lag is None or lag <= 0:
            break
        await asyncio.to_thread(launcher.supervise)
    await asyncio.to_thread(launcher.stop_all, None, teachers)
    if "eval" in names:  # the run ends after the last version's evaluation (the stage then exits)
        await asyncio.to_thread(launcher.stop_all, None, ["learner"])
        deadline = time.monotonic() + cfg.eval.end_timeout_s
        while time.monotonic() < deadline and launcher.returncode("eval") is None:
            await asyncio.sleep(0.5)
            await asyncio.to_thread(launcher.supervise)  # an eval stage that crashes now is restarted
        await bounded(observer.poll(), 5)
    await asyncio.to_thread(launcher.stop_all)


def summary_line(summary: dict, timeout_s: float = 0.0) -> str:
    """The run's last line on stderr: what failed, if anything, then what the run did: versions,
    rewards (overall and per data source, with the scorer's extra fields such as ``acc``), and
    every rollout accounted for (rewarded + dead-lettered at the reward stage + left unscored; without task
    rewards, distilled + dead-lettered at the teacher + left undistilled)."""
    ended = summary["ended"]
    f = summary.get("failure") or {}
    if ended.startswith("failed:") or ended == "stalled":
        who = f.get("stage", ended.split(":", 1)[-1])
        what = f"stage {who} exited with {f['returncode']}" if "returncode" in f else who
        head = (f"run {'stalled' if ended == 'stalled' else 'failed'}: {what}"
                + (f" ({f['error']})" if f.get("error") else ""))
    elif ended == "timeout":
        head = f"run timeout: stopped after run.timeout_s ({timeout_s:g} s)"
    else:
        head = f"run {ended}"
    if summary["reward_first"] is None:
        reward = "distillation alone (no task rewards)" if "undistilled" in summary["records"] else "no record rewarded"
    else:
        reward = f"reward {summary['reward_first']} -> {summary['reward_last']}"
    sources = "; ".join(f"{ds}: " + ", ".join(f"{k} {v}" for k, v in stats.items() if k != "records")
                        for ds, stats in (summary.get("by_data_source") or {}).items())
    r = summary["records"]
    if "undistilled" in r:  # distillation without task rewards: the teacher, not a reward group, takes rollouts
        accounted = (f"{r['rollouts']} rollouts = {r['distilled']} distilled + {r['dead_at_teacher']} dead-lettered + "
                     f"{r['undistilled']} undistilled, {r['trained']} trained")
    else:
        accounted = (f"{r['rollouts']} rollouts = {r['rewarded']} rewarded + {r['dead_at_reward']} dead-lettered + "
                     f"{r['unscored']} unscored" if "unscored" in r else f"{r['rewarded']} rewarded")
    validation = "; ".join(f"{name} {curve[max(curve, key=int)]} at v{max(curve, key=int)}"
                           for name, curve in (summary.get("validation_by_version") or {}).items() if curve)
    return (f"{head}: {summary['versions']} versions, {reward}"
            + (f" ({sources})" if sources else "")
            + (f", {validation}" if validation else "")
            + f", {accounted}, {summary['deadletters']} dead letters in all, plot {summary['plot']}"
            + (f", archive {summary['archive']} (replay it: streamrl replay)" if summary.get("archive") else ""))
