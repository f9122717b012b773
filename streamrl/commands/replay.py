"""``streamrl replay``: offline evaluation from topics (``streamrl.replay``)."""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys
from pathlib import Path

from streamrl.commands.common import add_config_arguments, load
from streamrl.runtime import require_bootstrap, serve_metrics

HELP = "re-score a range of a topic with another scorer, or evaluate a checkpoint; report old vs new"

EPILOG = """\
bounds (--from / --to, inclusive, repeatable; all must hold):
  offset:N          partition offset, in every partition
  time:T            the record's own time (scored_at of rewarded records, else created_at);
                    T in unix seconds or ISO 8601, e.g. time:2026-11-21T12:00:00Z (no zone: UTC)
  version:N         the record's policy_version
  e.g. --from version:3 --to version:5 --from time:1763700000

--scorer:
  NAME              a built-in scorer (gsm8k, math) or an entry of reward.scorers in --config;
                    it scores every record, whatever its data_source
  FILE.yaml         a scorer config in the reward config's format (a pipeline YAML's reward:
                    section, or the section alone); records are routed by data_source
  FILE.py:FUNCTION  a function with verl's scorer signature (or MODULE:FUNCTION)

The replay joins no consumer group and commits nothing; it stops at the end offsets it finds at
start. Records are de-duplicated by id. Writes report.json, report.md, report.png and the
per-record results to --out (default: a new runs/replay/<time>/ for each replay); the last line
of stdout is the path of report.json.

--generate evaluates a checkpoint instead: it samples --samples responses per prompt of
--prompts (a dataset as feed.dataset names one: gsm8k:test from the Hugging Face hub, or a JSONL /
parquet file, read like the prompt feed: feed.*) with
--policy through the rollout backend (rollout.backend, rollout.temperature, rollout.max_new_tokens
as overrides) and scores them; there is no old reward. No broker is needed unless publishing.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = EPILOG
    add_config_arguments(parser)
    parser.add_argument("--topic", default="rewarded",
                        help="topic to replay, short name without the prefix (default: rewarded)")
    parser.add_argument("--from", dest="lo", action="append", default=[], metavar="KIND:VALUE",
                        help="lower bound: offset:N, time:T or version:N (see below)")
    parser.add_argument("--to", dest="hi", action="append", default=[], metavar="KIND:VALUE",
                        help="upper bound, inclusive: offset:N, time:T or version:N")
    parser.add_argument("--scorer", default="", metavar="NAME|FILE",
                        help="the scorer to re-score with (see below); without it, report what is stored: "
                             "rewards by version and data source, dead letters by reason")
    parser.add_argument("--archive", default="", metavar="PATH|URI",
                        help="read an archive (a run's <run dir>/archive, s3://..., gs://...) instead of a "
                             "broker; default with no broker: ./archive, else the newest run's under run.out_dir")
    parser.add_argument("--out", default="", metavar="DIR",
                        help="output directory (default: a new runs/replay/<time>/ per replay)")
    parser.add_argument("--format", choices=("jsonl", "parquet"), default="jsonl",
                        help="per-record results file format (default: jsonl)")
    parser.add_argument("--publish-topic", default="", metavar="NAME",
                        help="also publish the re-scored records to this topic (short name; created "
                             "like rewarded if missing)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars on stderr")
    gen = parser.add_argument_group("checkpoint evaluation")
    gen.add_argument("--generate", action="store_true", help="generate with --policy instead of reading a topic")
    gen.add_argument("--policy", default="", metavar="URI", help="'tiny' or a Hugging Face directory")
    gen.add_argument("--prompts", default="", metavar="DATASET",
                     help="held-out prompts: gsm8k:test (Hugging Face openai/gsm8k) or a .jsonl / .parquet file")
    gen.add_argument("--samples", type=int, default=1, help="responses per prompt (default 1)")
    gen.add_argument("--limit", type=int, default=0, help="first N prompts only (default: all)")
    gen.add_argument("--policy-version", type=int, default=0,
                     help="version to stamp the generated records with (default 0)")


def main(args: argparse.Namespace) -> int:
    from streamrl.errors import ConfigError
    from streamrl.replay import BoundError, Range, evaluate_policy, parse_bound, replay_topic
    from streamrl.feed.prompts import FeedError

    cfg = load(args)
    given_out = Path(args.out) if args.out else None
    out = None
    try:
        if args.generate:
            if not args.policy or not args.prompts:
                raise ConfigError("--generate needs --policy and --prompts")
            if args.lo or args.hi:
                raise ConfigError("--from / --to bound a topic replay; --generate reads --prompts")
            if args.samples < 1 or args.limit < 0:
                raise ConfigError("--samples must be >= 1 and --limit >= 0")
            if not args.scorer:
                raise ConfigError("--generate needs --scorer")
            if args.publish_topic:
                require_bootstrap(cfg)
            out = given_out or new_replay_dir(Path("runs") / "replay")
            job = functools.partial(
                evaluate_policy, cfg, policy=args.policy, prompts=args.prompts, scorer=args.scorer,
                out=out, samples=args.samples, limit=args.limit, policy_version=args.policy_version,
                fmt=args.format, publish_topic=args.publish_topic or None, progress=not args.no_progress)
        else:
            archive = _source(cfg, args.archive)
            bounds = Range(tuple(parse_bound(b) for b in args.lo), tuple(parse_bound(b) for b in args.hi))
            if args.publish_topic:
                require_bootstrap(cfg)
            if not args.scorer:
                return _inventory(cfg, args.topic, bounds, archive)
            if archive and not args.config:
                _run_reward_config(cfg, archive)
            out = given_out or new_replay_dir(Path("runs") / "replay")
            job = functools.partial(
                replay_topic, cfg, topic=args.topic, scorer=args.scorer, out=out, bounds=bounds,
                fmt=args.format, publish_topic=args.publish_topic or None, progress=not args.no_progress,
                archive=archive)
        serve_metrics(cfg)
        path = asyncio.run(job())
    except (ConfigError, BoundError, FeedError, LookupError, FileNotFoundError) as exc:
        print(f"streamrl replay: {exc}", file=sys.stderr)
        if out is not None and given_out is None and not any(out.iterdir()):
            out.rmdir()  # the directory this replay made, left empty
        return 2
    _summary(path)
    print(path, flush=True)
    return 0


def new_replay_dir(parent: Path) -> Path:
    """``parent/<YYYYmmdd-HHMMSS>`` (``-2``, ``-3``, ... when one replay follows another within
    the second), never a directory an earlier replay wrote: one directory per replay."""
    import time

    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1, 10_000):
        path = parent / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"{parent}: no free directory for {stamp}")


def _source(cfg, archive: str) -> str | None:
    """The archive to read (None: the broker). Without ``--archive`` and without a broker, the
    archive of the run directory this is run in, or the newest run's; it says which."""
    from streamrl.archive import store
    from streamrl.archive.config import check_uri
    from streamrl.errors import StreamrlError
    from streamrl.replay.sources import find_archive

    if archive:
        check_uri(archive, "--archive")
        if not store.is_archive(archive):
            raise FileNotFoundError(f"--archive {archive}: no archive there (expected rollouts/, rewarded/ "
                                    f"or deadletter/ with .parquet files)")
        return archive
    if cfg.bus.bootstrap_servers:
        require_bootstrap(cfg)
        return None
    found = find_archive(cfg.run.out_dir)
    if found is None:
        raise StreamrlError(f"no broker and no archive: pass --archive PATH|URI (a run's <run dir>/archive), "
                            f"run this in a run directory or where `streamrl run` wrote {cfg.run.out_dir}/, "
                            f"or pass --bootstrap-servers HOST:PORT (env STREAMRL_BOOTSTRAP_SERVERS)")
    print(f"replay: no broker given: reading the archive {found} (--archive or --bootstrap-servers to "
          f"read another)", file=sys.stderr, flush=True)
    return found


def _run_reward_config(cfg, archive: str) -> None:
    """Without ``--config``, a scorer name means what it meant in the archived run: its reward
    config is kept in the archive (``streamrl.archive.store.REWARD_CONFIG``)."""
    from streamrl.archive import store

    rc = store.reward_config(archive)
    if rc is not None:
        cfg.reward = rc
        print(f"replay: scorer names as the archived run configured them ({archive.rstrip('/')}/"
              f"{store.REWARD_CONFIG}; --config to use another)", file=sys.stderr, flush=True)


def _inventory(cfg, topic: str, bounds, archive: str | None) -> int:
    """``streamrl replay`` without ``--scorer``: what is stored, as tables, then one JSON line."""
    import orjson

    from streamrl.replay.inventory import inventory, render
    from streamrl.replay.sources import archive_dead_letters, read_archive, read_range, topic_dead_letters

    if archive:
        read = read_archive(archive, topic, bounds)
        from streamrl.archive import store

        dead = archive_dead_letters(archive) if store.files(archive, "deadletter") else []
        source = {"archive": archive, "topic": read.topic, **bounds.describe()}
    else:
        from streamrl.bus import Bus

        async def both():
            bus = Bus(cfg.bus)
            return await read_range(bus, topic, bounds), await topic_dead_letters(bus)

        read, dead = asyncio.run(both())
        source = {"topic": read.topic, **bounds.describe()}
    inv = inventory(read.records, dead, source=source, duplicates=read.duplicates)
    print(render(inv), file=sys.stderr, flush=True)
    print(orjson.dumps(inv).decode(), flush=True)
    return 0


def _summary(path: Path) -> None:
    import orjson

    r = orjson.loads(path.read_bytes())
    fmt = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
    print(f"replay: {r['records']} records ({r['duplicates']} duplicates, {r['failed']} failed), "
          f"mean old {fmt(r['mean_old'])}, mean new {fmt(r['mean_new'])}, "
          f"agreement {fmt(r['agreement'])}, pearson {fmt(r['pearson'])}", file=sys.stderr)
