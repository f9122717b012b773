"""``streamrl rollout``: one rollout worker (a member of the prompts consumer group)."""

from __future__ import annotations

import argparse
import sys

from streamrl.commands.common import add_config_arguments, load, require_bootstrap, run_until_signalled

HELP = "run a rollout worker: prompts -> sampled trajectories (transformers, vLLM or an OpenAI-compatible server)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def main(args: argparse.Namespace) -> int:
    from streamrl import metrics
    from streamrl.bus import Bus
    from streamrl.config import ConfigError
    from streamrl.rollout.worker import RolloutWorker

    cfg = load(args)
    require_bootstrap(cfg)
    try:
        worker = RolloutWorker(Bus(cfg.bus), cfg.rollout)
    except ConfigError as exc:
        raise SystemExit(f"streamrl rollout: {exc}") from None
    port = metrics.serve(cfg.metrics.port, cfg.metrics.host)
    print(f"rollout: backend {cfg.rollout.backend}, policy {cfg.rollout.policy}, group {cfg.rollout.group}, "
          f"metrics on port {port}", flush=True)
    run_until_signalled(worker.run)
    print("rollout: stopped", file=sys.stderr, flush=True)
    return 0
