"""``streamrl topics create|describe``: the topics of ``topics/*.json`` on a broker."""

from __future__ import annotations

import argparse
import asyncio
import json

from streamrl.commands.common import add_config_arguments, load

HELP = "create missing topics from topics/*.json, or describe them and report drift"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=["create", "describe"])
    add_config_arguments(parser)
    parser.add_argument("--json", action="store_true", help="one JSON object per topic")


def main(args: argparse.Namespace) -> int:
    from streamrl.runtime import Runtime, probe_bootstrap

    runtime = Runtime(load(args), "topics")
    probe_bootstrap(runtime.cfg.bus.bootstrap_servers)
    states = asyncio.run(runtime.topics(create=args.action == "create"))
    for s in states:
        if args.json:
            print(json.dumps(s.__dict__))
            continue
        status = "created" if s.created else ("exists" if s.exists else "MISSING")
        parts = f"{s.partitions}/{s.spec_partitions} partitions" if s.exists else f"spec {s.spec_partitions} partitions"
        drift = ("  DRIFT: " + "; ".join(s.drift)) if s.drift else ""
        print(f"{s.topic:28s} {status:8s} {parts}{drift}")
    return 1 if any(s.drift or not s.exists for s in states) else 0
