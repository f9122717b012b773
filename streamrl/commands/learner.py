"""``streamrl learner``: consume ``rewarded``, train the policy, announce versions on ``policy``.
SIGTERM / SIGINT: finish the current update, checkpoint, leave the group, exit 0."""

from __future__ import annotations

import argparse
import sys

from streamrl.commands.common import add_config_arguments, load, require_bootstrap, run_until_signalled

HELP = "train the policy from rewarded records (GRPO / PPO, bounded staleness) and publish versions"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def main(args: argparse.Namespace) -> int:
    from streamrl import metrics
    from streamrl.bus import Bus
    from streamrl.errors import ConfigError
    from streamrl.topics import ensure_topics

    cfg = load(args)
    require_bootstrap(cfg)
    try:
        cfg.learner.validate()
    except ConfigError as exc:
        raise SystemExit(f"streamrl learner: {exc}") from None
    port = metrics.serve(cfg.metrics.port, cfg.metrics.host)
    print(f"metrics: http://{cfg.metrics.host}:{port}/metrics", flush=True)

    async def run(stop):
        from streamrl.learner.stage import Learner

        bus = Bus(cfg.bus)
        await ensure_topics(bus)
        learner = Learner(bus, cfg.learner)
        print(f"learner: version {learner.version}, group {cfg.learner.consumer_group}, "
              f"checkpoints in {cfg.learner.checkpoint_dir}", flush=True)
        state = await learner.run(stop)
        print(f"learner: stopped at version {state.version}, {state.consumed_records} records "
              f"consumed, checkpoint {learner.last_checkpoint}", flush=True)

    try:
        run_until_signalled(run)
    except FileNotFoundError as exc:
        print(f"streamrl learner: {exc}", file=sys.stderr)
        return 1
    return 0
