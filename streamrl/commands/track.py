"""``streamrl track``: the experiment trackers (TensorBoard, MLflow, W&B; ``tracking.loggers``)
fed from the ``policy`` and ``eval`` topics, each version logged once (``streamrl.tracking``).
``streamrl run`` starts it when ``tracking.loggers`` is set; beside stages deployed one by one,
run one of it."""

from __future__ import annotations

import argparse

from streamrl.commands.common import add_config_arguments, load

HELP = "log the run's figures to TensorBoard, MLflow or W&B under verl's names (from the policy and eval topics)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--dir", metavar="DIR", help="where the trackers' files and the ledger go (tracking.dir)")


def main(args: argparse.Namespace) -> int:
    from streamrl.runtime import serve_stage
    from streamrl.tracking.trackers import TrackingStage

    return serve_stage(TrackingStage, load(args, tracking__dir=args.dir))
