"""``streamrl bench NAME``: the benchmarks. Each is a module in ``streamrl.bench`` with
``HELP``, ``add_arguments(parser)`` and ``main(args) -> int``; each prints its figures and, as its
last line of stdout, one JSON object (ratios measured side by side in one run)."""

from __future__ import annotations

import argparse
import importlib

HELP = "run a benchmark (figures as ratios measured side by side in one run)"

BENCHES = {
    "bus": "streamrl.bench.bus",
    "learner": "streamrl.bench.learner_speed",
    "rollout": "streamrl.bench.rollout",
    "reward": "streamrl.bench.reward",
    "pipeline": "streamrl.bench.pipeline",
    "scale": "streamrl.bench.scale",
    "ablation": "streamrl.bench.ablation",
    "archive": "streamrl.bench.archive",
    "learning": "streamrl.bench.learning",
    "run": "streamrl.bench.run",
    "weights": "streamrl.bench.weights",
    "sandbox": "streamrl.bench.sandbox",
    "gateway": "streamrl.bench.gateway",
    "routing": "streamrl.bench.routing",
    "soak": "streamrl.bench.soak",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True, metavar="NAME")
    for name, module_name in BENCHES.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_bench_main=module.main)


def main(args: argparse.Namespace) -> int:
    return int(args._bench_main(args) or 0)
