"""``streamrl bench bus``: what the record codec and the bus cost over the bare Kafka client.

One producer process and one consumer process move N trajectory records of a realistic size
(~32 KB: 2k prompt+response tokens with ids, fp32 log-probs and a mask, plus the text) through
the broker, twice per round: once as streamrl records (encode, schema check at decode, the bus's
producer) and once as the same bytes through the bare aiokafka producer (``streamrl.bus._bare``);
both are read by the bus's ``Reader``. Rounds alternate the two so that noise on a shared
machine falls on both; the figures are medians over rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import time
import uuid
from dataclasses import asdict
from typing import Any

HELP = "bus throughput and latency against the bare Kafka client (one run, side by side)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from streamrl.commands.common import add_bootstrap_argument

    add_bootstrap_argument(parser)
    parser.add_argument("--records", type=int, default=0, help="records per run (default 10000; --quick 3000)")
    parser.add_argument("--rounds", type=int, default=0, help="alternating raw/bus rounds (default 3; --quick 2)")
    parser.add_argument("--quick", action="store_true", help="a short run (under a minute)")
    parser.add_argument("--response-tokens", type=int, default=1536)
    parser.add_argument("--prompt-tokens", type=int, default=512)


def sample_trajectory(prompt_tokens: int, response_tokens: int, seed: int = 0):
    """A trajectory shaped like a real one: token ids, fp32 log-probs, a mask, and text of
    about 4 characters per token."""
    import numpy as np

    from streamrl.records import Trajectory

    rng = np.random.default_rng(seed)
    words = "the of and to in is that for it as with was on be by at this have from".split()
    text = lambda n: " ".join(rng.choice(words, n))  # noqa: E731
    return Trajectory(
        group_id="g0", group_size=16, policy_version=3, data_source="gsm8k",
        prompt=text(prompt_tokens), response=text(response_tokens), ground_truth="42",
        extra_info={"index": 0, "split": "train"},
        prompt_ids=rng.integers(0, 150_000, prompt_tokens, dtype=np.int32),
        response_ids=rng.integers(0, 150_000, response_tokens, dtype=np.int32),
        response_logprobs=-rng.exponential(1.0, response_tokens).astype(np.float32),
        response_mask=np.ones(response_tokens, dtype=np.uint8),
        timings={"generation_started_at": time.time(), "generation_s": 1.5},
    )


# -- the two processes ---------------------------------------------------------------------------

def _producer(mode: str, bus_cfg: dict, n: int, shape: tuple[int, int], go, out) -> None:
    asyncio.run(_produce(mode, bus_cfg, n, shape, go, out))


async def _produce(mode: str, bus_cfg: dict, n: int, shape: tuple[int, int], go, out) -> None:
    import dataclasses

    from streamrl.bus import Bus
    from streamrl.bus._bare import bare_producer
    from streamrl.config import BusConfig

    bus = Bus(BusConfig(**bus_cfg))
    template = sample_trajectory(*shape)
    payload = template.encode()  # raw mode sends these exact bytes: same size, same compressibility
    if mode == "bus":
        producer = bus.producer("bench")
        await producer.start()
    else:
        raw = bare_producer(bus.config)
        await raw.start()
    topic = bus.topic("rollouts")
    go.wait()
    started = time.time()
    futures = []
    for i in range(n):
        if mode == "bus":
            traj = dataclasses.replace(template, id=uuid.uuid4().hex, group_id=f"g{i // 16}")
            futures.append(await producer.send(traj))
        else:
            futures.append(await raw.send(topic, payload, key=f"g{i // 16}".encode()))
    await asyncio.gather(*futures)
    out.put(("produced", started, time.time(), len(payload)))
    await (producer.stop() if mode == "bus" else raw.stop())


def _consumer(mode: str, bus_cfg: dict, n: int, ready, out) -> None:
    asyncio.run(_consume(mode, bus_cfg, n, ready, out))


async def _consume(mode: str, bus_cfg: dict, n: int, ready, out) -> None:
    from streamrl.bus import Bus, Reader
    from streamrl.config import BusConfig
    from streamrl.records import Trajectory

    bus = Bus(BusConfig(**bus_cfg))
    reader = await Reader(bus, ["rollouts"], "bench").start()
    await reader.fetch(timeout_ms=500)  # fetch metadata and positions before the clock runs
    ready.set()
    got = nbytes = 0
    latencies: list[float] = []
    last = time.time()
    while got < n:
        msgs = await reader.fetch(timeout_ms=1000)
        now = time.time()
        for m in msgs:
            if mode == "bus":
                Trajectory.decode(m.value)
            nbytes += len(m.value)
            latencies.append(now * 1000 - m.timestamp)
        got += len(msgs)
        if msgs:
            last = time.time()
    await reader.stop()
    out.put(("consumed", last, nbytes, latencies))


def run_once(mode: str, bus_cfg: dict, n: int, shape: tuple[int, int]) -> dict[str, float]:
    """One producer/consumer pair over fresh topics; returns throughput and latencies."""
    from streamrl.bus import Bus
    from streamrl.config import BusConfig
    from streamrl.topics import ensure_topics

    bus_cfg = dict(bus_cfg, topic_prefix=f"bench{uuid.uuid4().hex[:8]}")
    asyncio.run(ensure_topics(Bus(BusConfig(**bus_cfg))))
    ctx = mp.get_context("spawn")
    ready, go, out = ctx.Event(), ctx.Event(), ctx.Queue()
    consumer = ctx.Process(target=_consumer, args=(mode, bus_cfg, n, ready, out))
    producer = ctx.Process(target=_producer, args=(mode, bus_cfg, n, shape, go, out))
    consumer.start()
    producer.start()
    if not ready.wait(60):
        raise RuntimeError("the bench consumer did not start")
    go.set()
    msgs = [out.get(timeout=600), out.get(timeout=600)]
    producer.join(30)
    consumer.join(30)
    produced = next(m for m in msgs if m[0] == "produced")
    consumed = next(m for m in msgs if m[0] == "consumed")
    _, started, _, record_bytes = produced
    _, last, nbytes, latencies = consumed
    elapsed = last - started
    latencies.sort()
    return {
        "records_per_s": n / elapsed,
        "mb_per_s": nbytes / elapsed / 1e6,
        "record_bytes": record_bytes,
        "p50_latency_ms": latencies[len(latencies) // 2],
        "p99_latency_ms": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
        "seconds": elapsed,
    }


def main(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from streamrl.runtime import broker_for
    from streamrl.pipeline_config import PipelineConfig

    n = args.records or (3000 if args.quick else 10000)
    rounds = args.rounds or (2 if args.quick else 3)
    shape = (args.prompt_tokens, args.response_tokens)
    cfg = PipelineConfig()
    cfg.bus.bootstrap_servers = args.bootstrap_servers
    runs: dict[str, list[dict[str, float]]] = {"raw": [], "bus": []}
    with broker_for(cfg):
        bus_cfg = asdict(cfg.bus)
        steps = [mode for _ in range(rounds) for mode in ("raw", "bus")]
        for mode in tqdm(steps, desc=f"bench bus ({n} records/run)", file=sys.stderr):
            runs[mode].append(run_once(mode, bus_cfg, n, shape))
    med = {mode: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for mode, rs in runs.items()}
    print(f"{'':6s} {'records/s':>10s} {'MB/s':>8s} {'p50 ms':>8s} {'p99 ms':>8s}")
    for mode in ("raw", "bus"):
        m = med[mode]
        print(f"{mode:6s} {m['records_per_s']:10.0f} {m['mb_per_s']:8.1f} {m['p50_latency_ms']:8.1f} {m['p99_latency_ms']:8.1f}")
    summary: dict[str, Any] = {
        "records": n, "rounds": rounds, "record_bytes": int(med["bus"]["record_bytes"]),
        "records_per_s": round(med["bus"]["records_per_s"], 1),
        "mb_per_s": round(med["bus"]["mb_per_s"], 2),
        "raw_mb_per_s": round(med["raw"]["mb_per_s"], 2),
        "ratio_to_raw": round(med["bus"]["mb_per_s"] / med["raw"]["mb_per_s"], 3),
        "p50_latency_ms": round(med["bus"]["p50_latency_ms"], 1),
        "p99_latency_ms": round(med["bus"]["p99_latency_ms"], 1),
        "raw_p50_latency_ms": round(med["raw"]["p50_latency_ms"], 1),
        "raw_p99_latency_ms": round(med["raw"]["p99_latency_ms"], 1),
    }
    print(json.dumps(summary), flush=True)
    return 0
