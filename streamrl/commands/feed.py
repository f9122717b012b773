"""``streamrl feed``: publish a dataset to the prompts topic."""

from __future__ import annotations

import argparse

from streamrl.commands.common import add_config_arguments, load

HELP = "publish a dataset to the prompts topic, one record per row and epoch (GSM8K as verl prepares it)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dataset", help="gsm8k, gsm8k:test (Hugging Face openai/gsm8k), hf:REPO, "
                                           "or a .jsonl[.gz] / .parquet file (feed.dataset)")
    parser.add_argument("--epochs", type=int, help="feed.epochs")
    parser.add_argument("--limit", type=int, help="rows per epoch (feed.limit)")
    parser.add_argument("--group-size", type=int, help="samples per prompt (feed.group_size)")
    add_config_arguments(parser)


def main(args: argparse.Namespace) -> int:
    from streamrl.feed.stage import Feed
    from streamrl.runtime import serve_stage

    return serve_stage(Feed, load(args, feed__dataset=args.dataset, feed__epochs=args.epochs,
                                  feed__limit=args.limit, feed__group_size=args.group_size))
