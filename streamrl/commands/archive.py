"""``streamrl archive``: the archive stage, a consumer group writing ``rollouts``, ``rewarded``
and ``deadletter`` to Parquet files (``streamrl.archive``).

A verb like every other stage because everything that starts stages starts verbs: the image's
entrypoint is ``streamrl``, compose and Kubernetes run ``streamrl VERB``, and both launchers of
``streamrl run`` run ``python -m streamrl VERB``."""

from __future__ import annotations

import argparse
import os

from streamrl.commands.common import add_config_arguments, load

HELP = "archive rollouts, rewarded and deadletter to Parquet files (a path or s3://, gs:// URI) for replay"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--uri", default=os.environ.get("STREAMRL_ARCHIVE_URI", ""), metavar="PATH|URI",
                        help="where the files go (archive.uri; env STREAMRL_ARCHIVE_URI): a directory, "
                             "file://, s3://BUCKET/PATH, gs://...")


def main(args: argparse.Namespace) -> int:
    from streamrl.archive.stage import ArchiveStage
    from streamrl.runtime import serve_stage

    return serve_stage(ArchiveStage, load(args, archive__uri=args.uri))
