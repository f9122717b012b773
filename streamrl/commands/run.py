"""``streamrl run [CONFIG]``: the whole pipeline on the embedded broker (or ``--bootstrap-servers``):
broker, topics, learner, reward group, rollout workers and the prompt feed, each a process, with a
live status line; at the end a summary, a plot, and one JSON line."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from streamrl.commands.common import add_bootstrap_argument

HELP = "run the whole pipeline (embedded broker by default) and print a JSON summary"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", default="configs/local.yaml", help="pipeline YAML")
    add_bootstrap_argument(parser)
    parser.add_argument("overrides", nargs="*", metavar="key.path=value")


def main(args: argparse.Namespace) -> int:
    from streamrl.commands.common import broker_for, load, run_until_signalled

    if "=" in args.config and not Path(args.config).exists():  # `streamrl run a.b=c`: no config given
        args.overrides, args.config = [args.config, *args.overrides], "configs/local.yaml"
    cfg = load(args)
    run_id = time.strftime("%Y%m%d-%H%M%S")
    out = Path(cfg.run.out_dir) / run_id
    (out / "logs").mkdir(parents=True, exist_ok=True)
    with broker_for(cfg) as bootstrap:
        result = run_until_signalled(lambda stop: _run(cfg, args, bootstrap, out, stop))
    print(json.dumps(result), flush=True)
    return {"done": 0, "interrupted": 130}.get(result["ended"], 1)


async def _run(cfg, args, bootstrap: str, out: Path, stop: asyncio.Event) -> dict:
    from streamrl.bus import Bus
    from streamrl.run import Observer, Supervisor, observe_until, summarise
    from streamrl.topics import ensure_topics

    bus = Bus(cfg.bus)
    await ensure_topics(bus)
    common = ["--bootstrap-servers", bootstrap, "--config", args.config, *args.overrides, "metrics.port=0"]
    sup = Supervisor(out / "logs")
    interactive = sys.stderr.isatty()

    def show(line: str) -> None:
        if interactive:
            print("\r\033[K" + line, end="", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)

    observer = Observer(bus)
    await observer.start()
    ended = "interrupted"
    try:
        learner = sup.start("learner", ["learner", *common, f"learner.checkpoint_dir={out}/checkpoints",
                                        f"learner.weights_dir={out}/weights"])
        for i in range(cfg.run.reward_members):
            sup.start(f"reward-{i}", ["reward", *common])
        for i in range(cfg.run.rollout_workers):
            sup.start(f"rollout-{i}", ["rollout", *common])
        sup.start("feed", ["feed", *common])
        print(f"run: {out} (logs in {out / 'logs'}); Ctrl-C stops every stage", file=sys.stderr, flush=True)
        interval = cfg.run.status_interval_s if interactive else max(5.0, cfg.run.status_interval_s)
        ended = await asyncio.wait_for(
            observe_until(observer, sup, learner, cfg.learner.versions, stop, show, interval),
            timeout=cfg.run.timeout_s)
    except asyncio.TimeoutError:
        ended = "timeout"
    finally:
        if interactive:
            print(file=sys.stderr)
        sup.stop_all()
        await observer.poll(timeout_ms=200)
        await observer.stop()
    if ended.startswith("failed:"):
        child = next(c for c in sup.children if c.name == ended.split(":", 1)[1])
        print(f"run: {child.name} exited with {child.proc.returncode}; its log ends:\n{sup.tail(child)}",
              file=sys.stderr)
    summary = summarise(observer.obs, out / "reward.png")
    summary["ended"] = ended
    summary["out"] = str(out)
    print(f"run {ended}: {summary['versions']} versions, reward {summary['reward_first']} -> "
          f"{summary['reward_last']}, {summary['records']['rewarded']} rewarded, "
          f"{summary['deadletters']} dead letters, plot {summary['plot']}", file=sys.stderr, flush=True)
    return summary
