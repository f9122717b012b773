"""``streamrl rollout``: one rollout worker (a member of the prompts consumer group)."""

from __future__ import annotations

import argparse

from streamrl.commands.common import add_config_arguments, load

HELP = "run a rollout worker: prompts -> sampled trajectories (transformers, vLLM or an OpenAI-compatible server)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def main(args: argparse.Namespace) -> int:
    from streamrl.rollout.worker import RolloutWorker
    from streamrl.runtime import serve_stage

    return serve_stage(RolloutWorker, load(args))
