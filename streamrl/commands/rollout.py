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
    from streamrl.errors import ConfigError
    from streamrl.rollout.backends import make_backend
    from streamrl.rollout.worker import RolloutWorker

    cfg = load(args)
    require_bootstrap(cfg)
    try:
        backend = make_backend(cfg.rollout.check())  # loads the model: before the loop starts
    except ConfigError as exc:
        raise SystemExit(f"streamrl rollout: {exc}") from None

    async def run(stop):
        worker = RolloutWorker(Bus(cfg.bus), cfg.rollout, backend)  # aiokafka wants a running loop
        port = metrics.serve(cfg.metrics.port, cfg.metrics.host)
        print(f"rollout: backend {cfg.rollout.backend}, policy {cfg.rollout.policy}, group "
              f"{worker.group}, metrics on port {port}", flush=True)
        await worker.run(stop)

    try:
        run_until_signalled(run)
    except ConfigError as exc:
        raise SystemExit(f"streamrl rollout: {exc}") from None
    print("rollout: stopped", file=sys.stderr, flush=True)
    return 0
