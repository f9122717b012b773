"""The run's plan, before anything starts: the command line read (``plan``), the config resolved
and every stage's section checked (``resolve``; ``--dry-run`` prints it), the run's directory
chosen (a new one, or the run to resume), the topics checked, the warm start made."""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

DEFAULT_CONFIG = "local.yaml"  # the packaged embedded default (streamrl.packaged)

#: how a finished run ended: ``--resume``/``run.resume=auto`` do not pick it again
FINISHED = ("done", "data_exhausted")


def plan(args: argparse.Namespace):
    """``(resolution, resume)``: the command line read as the user meant it (``streamrl run
    a.b=c`` gives no config; ``--resume a.b=c`` and ``--resume x.yaml`` name no run directory),
    the config file resolved to a path (the stages get the same file), then ``resolve``."""
    from streamrl.packaged import resolve_config

    if "=" in args.config and not Path(args.config).exists():  # `streamrl run a.b=c`: no config given
        args.overrides, args.config = [args.config, *args.overrides], DEFAULT_CONFIG
    resume = getattr(args, "resume", None)
    if resume not in (None, "auto") and not Path(resume).is_dir():  # `--resume a.b=c`, `--resume x.yaml`
        if "=" in resume:
            args.overrides, resume = [resume, *args.overrides], "auto"
        elif resume.endswith((".yaml", ".yml")) and args.config == DEFAULT_CONFIG:
            args.config, resume = resume, "auto"
    if getattr(args, "verl_entry", None):  # an override: the stages resolve the same config
        args.overrides = [f"run.verl_entry={args.verl_entry}", *args.overrides]
    args.config = str(resolve_config(args.config).resolve())  # the stages get the same file, by path
    return resolve(args, resume), resume


def choose_run_dir(cfg, required: bool):
    """``(run directory, learner state to resume from or None)`` by ``run.resume``: ``never``
    (a new directory), ``auto`` (the unfinished run under ``run.out_dir`` with the newest
    readable checkpoint, else a new one; ``required``: else an error), or a directory."""
    from streamrl.errors import ConfigError, StreamrlError
    from streamrl.resume import latest_good

    root = Path(cfg.run.out_dir).resolve()
    mode = cfg.run.resume
    if mode not in ("auto", "never"):
        path = Path(mode).resolve()
        good = latest_good(path / "checkpoints")
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
            good = latest_good(path / "checkpoints") if ended not in FINISHED else None
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
    command line's own flags, then every stage's checks (each section's ``validate``, the reward
    stage's scorer table built and closed), each problem collected, none raised."""
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
                  cfg.teacher.validate, cfg.run.validate):
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
        for note in run_length(resolution.cfg) + teacher_notes(resolution.cfg) + rollout_notes(resolution.cfg):
            print(f"# {note}")
    sys.stdout.flush()
    if resolution.problems:
        error = resolution.error()
        print(f"streamrl run: {error}", file=sys.stderr)
        return 2
    return 0


def rollout_notes(cfg) -> list[str]:
    """What is said at start about the rollout: a quantised rollout (``rollout.quantization``)
    samples from a quantised copy of each version while the learner trains the full-precision one,
    a rollout/learner mismatch that rollout correction is for; said when no correction is on."""
    r, learner = cfg.rollout, cfg.learner
    if not r.quantization or learner.rollout_correction.enabled or learner.decoupled:
        return []
    return [f"rollout.quantization {r.quantization}: the rollout samples from a {r.quantization} copy of each "
            "version while the learner trains it in full precision, a rollout/learner mismatch that rollout "
            "correction is for (learner.rollout_correction, verl's algorithm.rollout_correction: rollout_is "
            "token or sequence, rollout_rs); it is off"]


def teacher_notes(cfg) -> list[str]:
    """What is said at start about the teachers (verl's drop of ``teacher_model``, its engine
    keys not applicable here) and the groups the run starts, one per teacher."""
    from streamrl.errors import StreamrlError

    if not cfg.distillation.enabled:
        return []
    try:
        teachers = cfg.distillation.teachers(cfg.teacher)
    except StreamrlError:
        return []  # reported as a problem
    groups = [f"{t.label} ({t.key}: {t.config.backend} {t.config.model}, {t.members or cfg.run.teacher_members} "
              f"members, group {t.group(cfg.bus.group('teacher', ''))})" for t in teachers.values()]
    return [*cfg.distillation.notes(), "teachers: " + "; ".join(groups)]


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
    from streamrl.feed.prompts import read_feed_rows
    from streamrl.learner.schedule import data_versions

    rows = len(read_feed_rows(cfg.feed))
    versions = -(-rows * cfg.feed.epochs // per_version)
    lines = [f"the run: until the data ends: {rows} rows x {cfg.feed.epochs} epochs / {per_version} prompts per "
             f"version = {versions} versions (before max_prompt_length's filter)"]
    critic = cfg.learner.adv_estimator == "gae" and cfg.learner.critic.needs_total()
    if cfg.learner.end_with_data and (cfg.learner.needs_total() or critic):
        # verl counts its total_training_steps from a dataloader that drops each epoch's last
        # partial batch: the schedule's total can be below the versions the run trains
        lines.append(f"the lr schedule's total: {data_versions(rows, cfg.feed.epochs, per_version)} versions "
                     f"({rows} // {per_version} x {cfg.feed.epochs} epochs, verl's total_training_steps; "
                     "counted again at the learner's start, after the filter)")
    return lines


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

