"""``streamrl eval``: the eval stage, a consumer group on ``policy`` that evaluates the asked
versions on ``eval.dataset`` and publishes verl's validation figures on ``eval``
(``streamrl.evaluation``). ``streamrl run`` starts it when ``eval.dataset`` is set."""

from __future__ import annotations

import argparse

from streamrl.commands.common import add_config_arguments, load

HELP = "evaluate policy versions on a validation set (verl's val-core figures) and publish them on eval"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--dataset", metavar="DATASET", help="the validation set (eval.dataset): a file, gsm8k:test, digits@1")


def main(args: argparse.Namespace) -> int:
    from streamrl.evaluation.stage import Evaluator
    from streamrl.runtime import serve_stage

    return serve_stage(Evaluator, load(args, eval__dataset=args.dataset))
