"""``streamrl gateway``: an OpenAI-compatible chat endpoint whose episodes become trajectories."""

from __future__ import annotations

import argparse

from streamrl.commands.common import add_config_arguments, load

HELP = ("serve OpenAI-compatible chat completions to agents at /episodes/<id>/v1 and publish each ended "
        "episode's exact tokens to rollouts (rollout.gateway)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def main(args: argparse.Namespace) -> int:
    from streamrl.rollout.gateway import Gateway
    from streamrl.runtime import serve_stage

    return serve_stage(Gateway, load(args))
