"""``streamrl learner``: the one learner (consumer group on ``rewarded``; publishes versions).

With ``learner.parallel.nproc > 1`` it starts that many ranks through torch's elastic launcher
(each runs this same command): rank 0 is the stage, the others follow it
(``streamrl.learner.distributed``). Under ``torchrun`` (a cluster, one pod per node) each
process is already a rank and goes straight to its role."""

from __future__ import annotations

import argparse
import os
import sys

from streamrl.commands.common import add_config_arguments, load

HELP = "train the policy from rewarded records (GRPO / PPO, bounded staleness) and publish versions"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def main(args: argparse.Namespace) -> int:
    from streamrl.learner import distributed
    from streamrl.learner.stage import Learner
    from streamrl.runtime import serve_stage

    pipeline = load(args)
    cfg = pipeline.learner.validate()
    if not distributed.launched():
        if cfg.parallel.nproc > 1 or cfg.parallel.nnodes > 1:
            # a limit that cannot hold the model is a user error (exit 2), found before any rank starts
            distributed.check_memory(cfg, cfg.policy, cfg.parallel.nproc * cfg.parallel.nnodes)
            return distributed.launch(cfg, _rank_argv(args))
        return serve_stage(Learner, pipeline)
    group = distributed.init(cfg)
    if not group.leader:
        from streamrl.learner.ranks import follow

        code = follow(cfg)
        # A follower has nothing left to write once its group is gone. It leaves without the
        # interpreter's teardown, whose C++ destructors now and then abort a rank that stopped
        # cleanly ("terminate called without an active exception", seen on a loaded machine).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    try:
        return serve_stage(Learner, pipeline)
    finally:
        distributed.finish()


def _rank_argv(args: argparse.Namespace) -> list[str]:
    """This command again, for each rank."""
    argv = ["--log-level", getattr(args, "log_level", "WARNING"), "learner"]
    if args.config:
        argv += ["--config", args.config]
    if args.bootstrap_servers:
        argv += ["--bootstrap-servers", args.bootstrap_servers]
    return argv + list(args.overrides or ())
