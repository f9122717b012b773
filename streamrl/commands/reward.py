"""``streamrl reward``: one member of the reward consumer group (run more for more throughput;
Kafka spreads the ``rollouts`` partitions over them)."""

from __future__ import annotations

import argparse

from streamrl.commands.common import add_config_arguments, load

HELP = "score trajectories from rollouts into rewarded (one member of the reward consumer group)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--group", default="", help="consumer group id (default: reward.group)")


def main(args: argparse.Namespace) -> int:
    from streamrl.reward.stage import RewardStage
    from streamrl.runtime import serve_stage

    return serve_stage(RewardStage, load(args, reward__group=args.group))
