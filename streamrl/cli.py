"""The ``streamrl`` command: one verb per stage or tool.

Each verb is a module in ``streamrl.commands`` with ``HELP`` (its one-line description),
``add_arguments(parser)`` and ``main(args) -> int``; modules import their heavy dependencies inside
``main`` so ``streamrl --help`` stays fast. An error the user can act on (``StreamrlError``: a bad
config field, an unreachable broker, a missing extra) is printed on one line, without a
traceback, and exits 2.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import sys

from streamrl import __version__
from streamrl.errors import StreamrlError

VERBS = {
    "broker": "streamrl.commands.broker",
    "topics": "streamrl.commands.topics",
    "feed": "streamrl.commands.feed",
    "rollout": "streamrl.commands.rollout",
    "gateway": "streamrl.commands.gateway",
    "reward": "streamrl.commands.reward",
    "sandbox": "streamrl.commands.sandbox",
    "teacher": "streamrl.commands.teacher",
    "learner": "streamrl.commands.learner",
    "archive": "streamrl.commands.archive",
    "eval": "streamrl.commands.eval",
    "track": "streamrl.commands.track",
    "run": "streamrl.commands.run",
    "replay": "streamrl.commands.replay",
    "bench": "streamrl.commands.bench",
    "export": "streamrl.commands.export",
}

DESCRIPTION = ("streamrl: a Kafka streaming pipeline for RL post-training of language models. "
               "`streamrl run` runs it all on the embedded broker; each stage is also its own verb.")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="streamrl", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"streamrl {__version__}")
    parser.add_argument("--log-level", default=os.environ.get("STREAMRL_LOG_LEVEL", "WARNING"))
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB", title="verbs")
    for verb, module_name in VERBS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(verb, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_main=module.main)
    return parser


#: ``key.path=value``: a config override (verl style, Hydra's ``+key`` / ``++key`` too: verl adds a
#: second teacher as ``+distillation.teacher_models.NAME.key=...``), anywhere on the command line.
OVERRIDE = re.compile(r"^\+{0,2}[A-Za-z_][\w.]*=")


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
    from streamrl.logrates import limit_client_logs

    limit_client_logs()  # a broker that went away: one line per kind and interval, not ten a second
    try:
        return int(args._main(args) or 0)
    except KeyboardInterrupt:
        return 130
    except StreamrlError as exc:
        print(f"streamrl {args.verb}: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        # The transport's errors, and a Kafka client's own that escaped it (named by module, so
        # only the bus imports the client): one line naming the broker, not a 30-line traceback.
        from streamrl.bus.base import TransportError

        if not isinstance(exc, TransportError) and \
                type(exc).__module__.split(".")[0] not in ("aiokafka", "kafka", "confluent_kafka", "cimpl"):
            raise
        servers = getattr(args, "bootstrap_servers", "") or os.environ.get("STREAMRL_BOOTSTRAP_SERVERS", "")
        print(f"streamrl {args.verb}: Kafka error talking to {servers or 'the broker'}: "
              f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
