"""``streamrl run [CONFIG]``: the whole pipeline on the embedded broker (or ``--bootstrap-servers``):
broker, topics, learner, reward group, rollout workers and the prompt feed, each its own process
(or Ray actor), with a live status line; at the end a summary, a plot, and one JSON line."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
from pathlib import Path

from streamrl.commands.common import add_bootstrap_argument

HELP = "run the whole pipeline (embedded broker by default) and print a JSON summary"
DEFAULT_CONFIG = "local.yaml"  # the packaged embedded default (streamrl.packaged)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default=DEFAULT_CONFIG,
                        help=f"pipeline YAML: a file or a packaged name (default {DEFAULT_CONFIG}, the embedded default)")
    add_bootstrap_argument(parser)
    parser.add_argument("--run-dir", metavar="DIR", help="where runs go (run.out_dir, default ./runs): DIR/<run id>/")
    parser.add_argument("--launcher", choices=["local", "ray"], help="run.launcher: processes here, or Ray actors")
    parser.add_argument("--autoscale", metavar="MIN:MAX", help="size the reward group by its consumer lag")
    parser.add_argument("overrides", nargs="*", metavar="key.path=value")


def main(args: argparse.Namespace) -> int:
    from streamrl.commands.common import broker_for, load, run_until_signalled
    from streamrl.errors import StreamrlError, need
    from streamrl.packaged import resolve_config

    if "=" in args.config and not Path(args.config).exists():  # `streamrl run a.b=c`: no config given
        args.overrides, args.config = [args.config, *args.overrides], DEFAULT_CONFIG
    args.config = str(resolve_config(args.config).resolve())  # the stages get the same file, by path
    cfg = load(args)
    if args.run_dir:
        cfg.run.out_dir = args.run_dir
    need("torch", "cpu", "streamrl run")  # the learner and the transformers rollout backend
    if args.launcher:
        cfg.run.launcher = args.launcher
    if args.autoscale:
        low, _, high = args.autoscale.partition(":")
        if not (low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high)):
            raise StreamrlError(f"--autoscale wants MIN:MAX with 1 <= MIN <= MAX, got {args.autoscale!r}")
        cfg.run.autoscale.min_members, cfg.run.autoscale.max_members = int(low), int(high)
        cfg.run.reward_members = min(max(cfg.run.reward_members, int(low)), int(high))
    out = Path(cfg.run.out_dir).resolve() / time.strftime("%Y%m%d-%H%M%S")  # absolute: stages run elsewhere
    (out / "logs").mkdir(parents=True, exist_ok=True)
    if cfg.run.warm_start_steps:
        args.overrides = [*args.overrides, *warm_start(cfg, out / "warm_start")]
    # Ray: join the cluster and check it (the broker's reach, every stage's resources) before
    # the broker or any stage starts
    launcher = make_launcher(cfg, out / "logs") if cfg.run.launcher == "ray" else None
    with broker_for(cfg) as bootstrap:
        result = run_until_signalled(lambda stop: _run(cfg, args, bootstrap, out, stop, launcher))
    print(json.dumps(result), flush=True)
    return {"done": 0, "interrupted": 130}.get(result["ended"], 1)


def warm_start(cfg, directory: Path) -> list[str]:
    """``run.warm_start_steps``: the feed's task teaches the policy its format (streamrl.tasks);
    the overrides that make the learner and the rollout workers start from it."""
    from streamrl.errors import ConfigError
    from streamrl.tasks import TASKS, task_name

    task = TASKS.get(task_name(cfg.feed.dataset))
    if task is None:
        raise ConfigError(f"config field 'run.warm_start_steps': needs a generated task as feed.dataset "
                          f"({', '.join(TASKS)}), not {cfg.feed.dataset!r}")
    started = time.time()
    path = task.warm_start(directory, policy=cfg.learner.policy, seed=cfg.learner.seed, steps=cfg.run.warm_start_steps)
    print(f"run: warm start ({cfg.run.warm_start_steps} supervised steps on the {task.NAME} format) "
          f"in {time.time() - started:.1f}s: {path}", file=sys.stderr, flush=True)
    return [f"learner.policy={path}", f"rollout.policy={path}"]


def make_launcher(cfg, log_dir: Path):
    from streamrl.launching import LocalLauncher

    run = cfg.run
    if run.launcher == "local":
        return LocalLauncher(log_dir, run.restart, run.stop_timeout_s)
    if run.launcher == "ray":
        from streamrl.ray_launcher import RayLauncher

        launcher = RayLauncher.for_run(cfg, log_dir, embedded_broker=not cfg.bus.bootstrap_servers)
        for note in launcher.notes:
            print(note, file=sys.stderr, flush=True)
        return launcher
    from streamrl.errors import ConfigError

    raise ConfigError(f"config field 'run.launcher': {cfg.run.launcher!r} is not local or ray")


async def _run(cfg, args, bootstrap: str, out: Path, stop: asyncio.Event, launcher=None) -> dict:
    from streamrl.bus import Bus
    from streamrl.launching import LagAutoscaler
    from streamrl.observing import Observer, observe_until, status_line, summarise
    from streamrl.topics import ensure_topics

    bus = Bus(cfg.bus)
    await ensure_topics(bus)
    # every stage gets the run's directories: rollout workers load weights only from there
    common = ["--bootstrap-servers", bootstrap, "--config", args.config, *args.overrides, "metrics.port=0",
              f"learner.checkpoint_dir={out}/checkpoints", f"learner.weights_dir={out}/weights"]
    launcher = launcher or make_launcher(cfg, out / "logs")
    interactive = sys.stderr.isatty()

    def show(line: str) -> None:
        if interactive:
            print("\r\033[K" + line, end="", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)

    reward_ids = itertools.count()

    def start_reward() -> None:
        launcher.start(f"reward-{next(reward_ids)}", ["reward", *common], "reward")

    auto = cfg.run.autoscale
    scaler = LagAutoscaler(auto.min_members, auto.max_members, auto.scale_up_lag, auto.scale_down_lag,
                           auto.window_s, auto.cooldown_s) if auto.max_members else None
    observer = Observer(bus, reward_group=cfg.bus.group("reward", cfg.reward.group))
    await observer.start()
    ended = "interrupted"
    try:
        launcher.start("learner", ["learner", *common], "learner")
        for _ in range(cfg.run.reward_members):
            start_reward()
        for i in range(cfg.run.rollout_workers):
            launcher.start(f"rollout-{i}", ["rollout", *common], "rollout")
        launcher.start("feed", ["feed", *common], "feed")
        print(f"run: {out} ({cfg.run.launcher} launcher, logs in {out / 'logs'}); Ctrl-C stops every stage",
              file=sys.stderr, flush=True)
        interval = cfg.run.status_interval_s if interactive else max(5.0, cfg.run.status_interval_s)
        ended = await asyncio.wait_for(
            observe_until(observer, launcher, cfg.learner.versions, stop, show, interval, scaler, start_reward),
            timeout=cfg.run.timeout_s)
    except asyncio.TimeoutError:
        ended = "timeout"
    finally:
        await asyncio.to_thread(launcher.stop_all)
        show(status_line(await observer.poll(timeout_ms=200), cfg.learner.versions, launcher.restart_count()))
        if interactive:
            print(file=sys.stderr)
        await observer.stop()
    if ended.startswith("failed:"):
        name = ended.split(":", 1)[1]
        print(f"run: {name} exited with {launcher.returncode(name)}; its log ends:\n{launcher.log_tail(name)}",
              file=sys.stderr)
    summary = summarise(observer.obs, out / "reward.png")
    summary.update(ended=ended, out=str(out), launcher=cfg.run.launcher, restarts=launcher.restart_count())
    print(f"run {ended}: {summary['versions']} versions, reward {summary['reward_first']} -> "
          f"{summary['reward_last']}, {summary['records']['rewarded']} rewarded, "
          f"{summary['deadletters']} dead letters, plot {summary['plot']}", file=sys.stderr, flush=True)
    return summary
