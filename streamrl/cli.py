"""``streamrl VERB ...``: each verb is a module in ``streamrl.commands`` with ``HELP``,
``add_arguments(parser)`` and ``main(args) -> int``. Modules import their heavy dependencies
inside ``main`` so ``streamrl --help`` stays fast."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import sys

VERBS = {
    "broker": "streamrl.commands.broker",
    "topics": "streamrl.commands.topics",
    "reward": "streamrl.commands.reward",
    "learner": "streamrl.commands.learner",
    "bench": "streamrl.commands.bench",
    "rollout": "streamrl.commands.rollout",
    "feed": "streamrl.commands.feed",
    "run": "streamrl.commands.run",
    "replay": "streamrl.commands.replay",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamrl", description=__doc__.split("\n")[0])
    parser.add_argument("--log-level", default=os.environ.get("STREAMRL_LOG_LEVEL", "WARNING"))
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")
    for verb, module_name in VERBS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(verb, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_main=module.main)
    return parser


#: ``key.path=value``: a config override (verl style), anywhere on the command line.
OVERRIDE = re.compile(r"^[A-Za-z_][\w.]*=")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # argparse cannot take positionals after options (`topics create --bootstrap-servers X
    # a.b=c`), so overrides are collected from what it leaves over.
    args, extra = parser.parse_known_args(argv)
    unknown = [a for a in extra if not OVERRIDE.match(a)]
    if unknown or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args._main(args) or 0)
    except KeyboardInterrupt:
        return 130
