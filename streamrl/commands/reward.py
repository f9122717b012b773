"""``streamrl reward``: one member of the reward consumer group (run more for more throughput;
Kafka spreads the ``rollouts`` partitions over them)."""

from __future__ import annotations

import argparse
import sys

from streamrl.commands.common import add_config_arguments, load, require_bootstrap, run_until_signalled

HELP = "score trajectories from rollouts into rewarded (one member of the reward consumer group)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--group", default="", help="consumer group id (default: reward.group)")


def main(args: argparse.Namespace) -> int:
    from streamrl import metrics
    from streamrl.errors import ConfigError
    from streamrl.reward.stage import RewardStage

    cfg = load(args)
    require_bootstrap(cfg)
    if args.group:
        cfg.reward.group = args.group
    try:
        stage = RewardStage(cfg)
    except ConfigError as exc:
        print(f"streamrl reward: {exc}", file=sys.stderr)
        return 2
    port = metrics.serve(cfg.metrics.port, cfg.metrics.host)
    print(f"metrics: http://{cfg.metrics.host}:{port}/metrics", flush=True)
    print(f"reward: group {cfg.reward.group}, scorers {', '.join(stage.table.entries)}", flush=True)
    run_until_signalled(stage.run)
    return 0
