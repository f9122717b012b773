"""``streamrl bench archive``: what archiving costs against the bus, and what it takes on disk.

Per round, over fresh topics on one broker, one after the other in this process (so neither
competes with the other for the cores): the bus's producer publishes N rewarded records of a
realistic shape (``bench bus``'s: 2k tokens with ids, fp32 log-probs, a mask, and text; every
record its own random tokens, so nothing compresses better than real data would); then the
archive stage (``streamrl.archive.stage``) reads them all and writes them to Parquet in a
temporary directory, timed until every record is in a durable file; then, without a broker,
the same records are only converted and written (``store``). Figures are medians over rounds:
records/s of each, their ratio to the bus's, and the archive's bytes per 1,000 trajectories
against the records' own bytes on the topic.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from streamrl.bench import harness
from streamrl.bench.bus import sample_trajectory
from streamrl.topics import ensure_topics

HELP = "archive write throughput against the bus's, and its size per 1,000 trajectories (one run)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_common_arguments(parser, quick="a short run (about a minute)")
    parser.add_argument("--records", type=int, default=0, help="records per round (default 4000; --quick 1000)")
    parser.add_argument("--rounds", type=int, default=0, help="rounds (default 3; --quick 1)")
    parser.add_argument("--response-tokens", type=int, default=1536)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--compression", default="zstd", help="archive.compression (default zstd)")


def _records(n: int, shape: tuple[int, int]) -> list[Any]:
    from streamrl.records import Rewarded

    out = []
    for i in range(n):
        t = sample_trajectory(*shape, seed=i)
        t.group_id = f"g{i // 16}"
        out.append(Rewarded.from_trajectory(t, reward=float(i % 2), reward_info={"rule": float(i % 2)},
                                            scorer={"name": "gsm8k", "version": "1"}))
    return out


def _size(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*.parquet"))


async def _round(bus_cfg: Any, records: list[Any], compression: str) -> dict[str, float]:
    from streamrl.archive.stage import ArchiveStage
    from streamrl.archive.store import Batch, Writer, to_row
    from streamrl.bus import Bus
    from streamrl.pipeline_config import PipelineConfig

    n = len(records)
    cfg = PipelineConfig(bus=dataclasses.replace(bus_cfg, topic_prefix=f"bench{uuid.uuid4().hex[:8]}"))
    bus = Bus(cfg.bus)
    await ensure_topics(bus)
    payloads = [r.encode() for r in records]
    topic_bytes = sum(len(p) for p in payloads)
    async with bus.producer("bench") as producer:
        started = time.perf_counter()
        await producer.send_all(records)
        bus_s = time.perf_counter() - started

    with tempfile.TemporaryDirectory(prefix="streamrl-bench-archive-") as tmp:
        cfg.archive.uri, cfg.archive.topics, cfg.archive.compression = tmp, ["rewarded"], compression
        cfg.archive.roll_seconds = 3600.0  # rolled by size only, as a busy pipeline's files are
        stage = ArchiveStage(cfg.archive.validate() and cfg)
        stop = asyncio.Event()
        started = time.perf_counter()
        task = asyncio.create_task(stage.run(stop))
        first_at = None
        while stage.written["rewarded"] < n:
            if task.done():
                task.result()
                raise RuntimeError(f"the archive stage ended with {stage.written['rewarded']} of {n} records")
            taken = stage.checkpoint.partitions if hasattr(stage, "checkpoint") else set()
            if first_at is None and taken:
                first_at = time.perf_counter()  # joined the group, records arriving
            if taken and sum(len(b.rows) for b in stage.batches.values()) + stage.written["rewarded"] >= n:
                stop.set()  # every record read: the stage writes what it holds and stops
            await asyncio.sleep(0.02)
        archive_s = time.perf_counter() - (first_at or started)
        stop.set()
        await task
        archive_bytes = _size(Path(tmp))

    with tempfile.TemporaryDirectory(prefix="streamrl-bench-archive-") as tmp:
        writer = Writer(tmp, compression)
        started = time.perf_counter()
        batch = Batch("rewarded")
        for i, p in enumerate(payloads):
            batch.add(to_row("rewarded", 0, i, 0, p), 0.0)
            if batch.bytes >= cfg.archive.roll_bytes:
                writer.write("rewarded", batch.table())
                batch = Batch("rewarded")
        if batch.rows:
            writer.write("rewarded", batch.table())
        write_s = time.perf_counter() - started
    return {"bus_rps": n / bus_s, "archive_rps": n / archive_s, "write_rps": n / write_s,
            "archive_bytes_per_1000": archive_bytes / n * 1000, "topic_bytes_per_1000": topic_bytes / n * 1000}


class ArchiveBench(harness.Bench):
    """One variant, ``--rounds`` rounds, medians."""

    name = "archive"
    broker = True
    seconds_key = None

    def __init__(self, args: argparse.Namespace):
        super().__init__(args)
        self.n, self.rounds = args.records or (1000 if args.quick else 4000), args.rounds or (1 if args.quick else 3)
        print(f"bench archive: {self.n} records of {args.prompt_tokens}+{args.response_tokens} tokens, "
              f"{self.rounds} rounds", file=sys.stderr, flush=True)
        self.records = _records(self.n, (args.prompt_tokens, args.response_tokens))

    def measure(self, variant: str, round: int) -> dict[str, float]:
        out = asyncio.run(_round(self.bus, self.records, self.args.compression))
        self.note(f"round {round + 1}/{self.rounds}: " + ", ".join(f"{k} {v:.0f}" for k, v in out.items()))
        return out

    def summary(self, runs: harness.Runs) -> dict[str, Any]:
        med = runs.medians("run")
        return {
            "records": self.n, "rounds": self.rounds, "compression": self.args.compression,
            "bus_records_per_s": round(med["bus_rps"], 1),
            "archive_records_per_s": round(med["archive_rps"], 1),
            "archive_write_only_records_per_s": round(med["write_rps"], 1),
            "ratio_archive_to_bus": round(med["archive_rps"] / med["bus_rps"], 3),
            "ratio_write_only_to_bus": round(med["write_rps"] / med["bus_rps"], 3),
            "archive_mb_per_1000": round(med["archive_bytes_per_1000"] / 1e6, 3),
            "topic_mb_per_1000": round(med["topic_bytes_per_1000"] / 1e6, 3),
            "ratio_archive_to_topic_bytes": round(med["archive_bytes_per_1000"] / med["topic_bytes_per_1000"], 3),
        }

    def report(self, runs: harness.Runs, summary: dict[str, Any]) -> None:
        s = summary
        print(f"bus produce {s['bus_records_per_s']:.0f} rec/s | archive stage {s['archive_records_per_s']:.0f} "
              f"rec/s ({s['ratio_archive_to_bus']}x) | write only {s['archive_write_only_records_per_s']:.0f} "
              f"rec/s | {s['archive_mb_per_1000']} MB per 1,000 trajectories "
              f"({s['ratio_archive_to_topic_bytes']}x their JSON on the topic)", file=sys.stderr)


def main(args: argparse.Namespace) -> int:
    return harness.run(ArchiveBench(args))
