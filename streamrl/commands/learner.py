"""``streamrl learner``: the one learner (consumer group on ``rewarded``; publishes versions)."""

from __future__ import annotations

import argparse

from streamrl.commands.common import add_config_arguments, serve_stage

HELP = "train the policy from rewarded records (GRPO / PPO, bounded staleness) and publish versions"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def main(args: argparse.Namespace) -> int:
    from streamrl.learner.stage import Learner

    return serve_stage(Learner, args)
