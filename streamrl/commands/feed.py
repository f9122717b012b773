"""``streamrl feed``: publish a dataset (JSONL or parquet) to the prompts topic."""

from __future__ import annotations

import argparse
import asyncio

from streamrl.commands.common import add_config_arguments, load, require_bootstrap

HELP = "publish a dataset to the prompts topic, one record per row and epoch (GSM8K as verl prepares it)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", help="a .jsonl or .parquet file (feed.dataset)")
    parser.add_argument("--epochs", type=int, help="feed.epochs")
    parser.add_argument("--limit", type=int, help="rows per epoch (feed.limit)")
    parser.add_argument("--group-size", type=int, help="samples per prompt (feed.group_size)")
    add_config_arguments(parser)


def main(args: argparse.Namespace) -> int:
    from streamrl.bus import Bus
    from streamrl.errors import ConfigError
    from streamrl.rollout.feed import FeedError, publish_feed

    cfg = load(args)
    require_bootstrap(cfg)
    for flag, name in (("dataset", "dataset"), ("epochs", "epochs"), ("limit", "limit"), ("group_size", "group_size")):
        value = getattr(args, flag)
        if value is not None:
            setattr(cfg.feed, name, value)
    try:
        count = asyncio.run(publish_feed(Bus(cfg.bus), cfg.feed))
    except (ConfigError, FeedError) as exc:
        raise SystemExit(f"streamrl feed: {exc}") from None
    print(f"feed: published {count} prompts to {cfg.bus.topic('prompts')}", flush=True)
    return 0
