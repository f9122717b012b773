"""``streamrl bench bus``: what the record codec and the bus cost over the bare Kafka client.

One producer process and one consumer process move N trajectory records of a realistic size
(~32 KB by default: 2k prompt+response tokens with ids, fp32 log-probs and a mask, plus the
text; ``--response-tokens 32768`` for ~525 KB) through the broker. Every record is different
(its own token ids, log-probs and text, drawn from a pool larger than a producer batch holds),
as real trajectories are: an identical payload lets the compressor find the copies inside a
batch and overstates every client 2-3x. Each round runs, in turn:

- ``bus``: streamrl records through the bus's producer (encode, size check, delivery futures,
  metrics), read and decoded (schema check) by the bus's ``Reader``. The records are built
  before the clock runs (building them is the rollout worker's work, not the bus's);
- ``bytes``: the same records' bytes through the bus's producer (``send_bytes``: size check,
  futures, metrics, no encode) and ``Reader`` (no decode): the transport without the codec;
- ``bare``: the same records' bytes through the bare client the bus uses (librdkafka, the bus's
  own producer settings: ``streamrl.bench.bare_clients``), read by the ``Reader``;
- ``aio``: confluent-kafka's own asyncio producer (``confluent_kafka.aio.AIOProducer``), the
  alternative to the bus's way of serving delivery reports (when confluent-kafka has it);
- ``aiokafka``: the other Python client, same settings (when installed: ``streamrl[bench]``).

The producer process measures its event loop's lag (a 1 ms ticker: how late it wakes) and how
long each send holds the loop, in wall time and in the loop thread's own CPU time (the two
differ by the time the OS gave the core to another thread: on a machine with fewer cores than
busy threads, that is most of a long send: the bench counts the sends over 5 ms and how many
of them the thread spent off its core). The rollout worker's loop must not stop for a
send. CPU per record of the producer and consumer processes (librdkafka's threads included)
and of the embedded broker say where the time goes. Rounds alternate the modes so that noise
on a shared machine falls on all; figures are medians.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json as _json
import multiprocessing as mp
import os
import sys
import time
import uuid
from dataclasses import asdict
from typing import Any, Iterator

from streamrl.bench import harness
from streamrl.runtime import open_broker
from streamrl.topics import ensure_topics

HELP = "bus throughput, latency and loop lag against the bare Kafka clients (one run, side by side)"
MODES = ("bus", "bytes", "bare", "aio", "aiokafka")
#: distinct records in the pool (at least 64): far more than a 1 MB producer batch holds
POOL_BYTES = 48 * 1024 * 1024
#: a send that holds the loop longer than this misses issue 24's goal
SLOW_SEND_MS = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    harness.add_common_arguments(parser, quick="a short run")
    parser.add_argument("--records", type=int, default=0,
                        help="records per run (default: 160 MB worth, at least 300; --quick 60 MB)")
    parser.add_argument("--rounds", type=int, default=0, help="rounds of every mode (default 3; --quick 2)")
    parser.add_argument("--response-tokens", type=int, default=1536)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--compression", default="", help="bus.compression for this run (default: the config's)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"which of {','.join(MODES)} to run")
    parser.add_argument("--rate", type=float, default=0.0,
                        help="records per second the producer sends (default: as fast as it can); "
                             "a rollout worker's pace, to measure the loop's lag where the sender "
                             "does not saturate the cores itself")


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

def _pool(shape: tuple[int, int]) -> list:
    """Distinct trajectories, ``POOL_BYTES`` worth (at least 64): records are drawn from it in
    turn, so no two records of a producer batch are the same."""
    first = sample_trajectory(*shape, seed=0)
    size = len(first.encode())
    count = max(64, POOL_BYTES // size)
    return [first] + [sample_trajectory(*shape, seed=i) for i in range(1, count)]


class _LoopLag:
    """How late a 1 ms ticker wakes: how long the event loop was kept from running."""

    def __init__(self) -> None:
        self.lags: list[float] = []
        self._task: asyncio.Task | None = None

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            t = loop.time()
            await asyncio.sleep(0.001)
            self.lags.append((loop.time() - t - 0.001) * 1000)

    def start(self) -> None:
        self._task = asyncio.create_task(self._tick())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


def _switches() -> int:
    """Times the calling thread left its core so far: preempted by the OS (involuntary) or
    waiting (voluntary: a lock inside librdkafka, a page from disk). Linux; 0 elsewhere."""
    try:
        import resource

        usage = resource.getrusage(resource.RUSAGE_THREAD)  # type: ignore[attr-defined]
        return usage.ru_nivcsw + usage.ru_nvcsw
    except (ImportError, AttributeError, OSError):
        return 0


def _producer(mode: str, bus_cfg: dict, n: int, shape: tuple[int, int], go, out, rate: float) -> None:
    asyncio.run(_produce(mode, bus_cfg, n, shape, go, out, rate))


def _bare_send(bus_cfg: dict, topic: str, payloads: list[bytes], n: int, rate: float = 0.0) -> tuple[int, float]:
    """The bare librdkafka producer as its own examples drive it (no event loop): produce,
    serve delivery reports, wait when the queue is full. Returns (payload bytes, wire ratio:
    bytes sent to the broker over message bytes, from librdkafka's statistics)."""
    from streamrl.bench.bare_clients import bare_producer
    from streamrl.config import BusConfig

    stats: dict[str, Any] = {}
    producer = bare_producer(BusConfig(**bus_cfg), **{
        "statistics.interval.ms": 200, "stats_cb": lambda s: stats.update(_json.loads(s))})
    failed: list[Any] = []
    report = lambda err, _msg: failed.append(err) if err is not None else None  # noqa: E731
    sent = 0
    start = time.monotonic()
    for i in range(n):
        value = payloads[i % len(payloads)]
        if rate:
            time.sleep(max(0.0, start + i / rate - time.monotonic()))
        while True:
            try:
                producer.produce(topic, value, f"g{i // 16}".encode(), on_delivery=report)
                break
            except BufferError:
                producer.poll(0.01)
        producer.poll(0)
        sent += len(value)
    producer.flush(120)
    if failed:
        raise RuntimeError(f"bare producer: {len(failed)} records failed, first: {failed[0]}")
    deadline = time.time() + 5
    while stats.get("txmsg_bytes", 0) < sent and time.time() < deadline:
        producer.poll(0.1)  # the statistics after the last delivery
    return sent, stats.get("tx_bytes", 0) / max(1, stats.get("txmsg_bytes", 0))


async def _produce(mode: str, bus_cfg: dict, n: int, shape: tuple[int, int], go, out, rate: float) -> None:
    from streamrl.bench.bare_clients import aio_producer, aiokafka_producer
    from streamrl.bus import Bus
    from streamrl.config import BusConfig

    bus = Bus(BusConfig(**bus_cfg))
    pool = _pool(shape)
    payloads = [t.encode() for t in pool]
    topic = bus.topic("rollouts")
    client: Any = None
    if mode in ("bus", "bytes"):
        client = await bus.producer("bench").start()
    elif mode == "aio":
        client = aio_producer(bus.config)
    elif mode == "aiokafka":
        client = aiokafka_producer(bus.config)
        await client.start()
    lag = _LoopLag()
    send_ms: list[float] = []
    send_cpu_ms: list[float] = []  # the loop thread's own CPU in each send (wall minus time off its core)
    off_core: list[int] = []  # times the loop thread left its core during each send
    go.wait()
    started = time.time()
    cpu0 = time.process_time()
    sent, wire = 0, float("nan")
    if mode == "bare":
        sent, wire = _bare_send(bus_cfg, topic, payloads, n, rate)
    else:
        lag.start()
        futures = []
        for i in range(n):
            key = f"g{i // 16}".encode()
            t0, c0, p0 = time.perf_counter(), time.thread_time(), _switches()
            if mode == "bus":
                # the record as built (distinct from its neighbours), keyed as the others are
                futures.append(await client.send(pool[i % len(pool)], key=key))
            elif mode == "bytes":
                futures.append(await client.send_bytes("rollouts", payloads[i % len(pool)], key))
            elif mode == "aio":
                futures.append(await client.produce(topic, payloads[i % len(pool)], key))
            else:
                futures.append(await client.send(topic, payloads[i % len(pool)], key=key))
            send_ms.append((time.perf_counter() - t0) * 1000)
            send_cpu_ms.append((time.thread_time() - c0) * 1000)
            off_core.append(_switches() - p0)
            sent += len(payloads[i % len(pool)])
            # let the ticker see the loop between sends; at a --rate, wait for the next one's time
            await asyncio.sleep(max(0.0, started + (i + 1) / rate - time.time()) if rate else 0)
        if mode == "aio":
            await client.flush()
        await asyncio.gather(*futures)
        lag.stop()
    cpu_us = (time.process_time() - cpu0) / n * 1e6
    out.put(("produced", started, time.time(), sent / n, lag.lags, send_ms, send_cpu_ms, off_core, wire, cpu_us))
    if mode in ("bus", "bytes"):
        await client.stop()
    elif mode == "aio":
        await client.close()
    elif mode == "aiokafka":
        await client.stop()


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
    cpu0: float | None = None
    got = nbytes = 0
    latencies: list[float] = []
    last = time.time()
    while got < n:
        msgs = await reader.fetch(timeout_ms=1000)
        now = time.time()
        if cpu0 is None and msgs:
            cpu0 = time.process_time()  # from the first record: not the wait for the producer
        for m in msgs:
            if mode == "bus":
                Trajectory.decode(m.value)
            nbytes += len(m.value)
            latencies.append(now * 1000 - m.timestamp)
        got += len(msgs)
        if msgs:
            last = time.time()
    cpu_us = (time.process_time() - (cpu0 or 0.0)) / n * 1e6
    await reader.stop()
    out.put(("consumed", last, nbytes, latencies, cpu_us))


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(len(values) * q))]


def _cpu_s(pid: int | None) -> float:
    """CPU seconds a process has used (Linux ``/proc``; NaN elsewhere or without a pid)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, TypeError):
        return float("nan")


def run_once(mode: str, bus_cfg: dict, n: int, shape: tuple[int, int],
             broker_pid: int | None = None, rate: float = 0.0) -> dict[str, float]:
    """One producer/consumer pair over fresh topics; returns throughput, latencies, loop lag."""
    from streamrl.bus import Bus
    from streamrl.config import BusConfig

    bus_cfg = dict(bus_cfg, topic_prefix=f"bench{uuid.uuid4().hex[:8]}")
    asyncio.run(ensure_topics(Bus(BusConfig(**bus_cfg))))
    ctx = mp.get_context("spawn")
    ready, go, out = ctx.Event(), ctx.Event(), ctx.Queue()
    consumer = ctx.Process(target=_consumer, args=(mode, bus_cfg, n, ready, out))
    producer = ctx.Process(target=_producer, args=(mode, bus_cfg, n, shape, go, out, rate))
    consumer.start()
    producer.start()
    if not ready.wait(120):
        raise RuntimeError("the bench consumer did not start")
    broker_cpu = _cpu_s(broker_pid)
    go.set()
    msgs = [out.get(timeout=900), out.get(timeout=900)]
    broker_cpu = _cpu_s(broker_pid) - broker_cpu
    producer.join(60)
    consumer.join(60)
    produced = next(m for m in msgs if m[0] == "produced")
    consumed = next(m for m in msgs if m[0] == "consumed")
    _, started, acked, record_bytes, lags, send_ms, send_cpu_ms, off_core, wire, produce_cpu = produced
    slow = [i for i, ms in enumerate(send_ms) if ms > SLOW_SEND_MS]
    _, last, nbytes, latencies, consume_cpu = consumed
    elapsed = last - started
    return {
        "records_per_s": n / elapsed, "mb_per_s": nbytes / elapsed / 1e6, "record_bytes": record_bytes,
        "p50_latency_ms": _pct(latencies, 0.5), "p99_latency_ms": _pct(latencies, 0.99),
        "loop_lag_p99_ms": _pct(lags, 0.99), "loop_lag_max_ms": max(lags) if lags else float("nan"),
        "send_p99_ms": _pct(send_ms, 0.99), "send_max_ms": max(send_ms) if send_ms else float("nan"),
        "send_cpu_p99_ms": _pct(send_cpu_ms, 0.99),
        "send_cpu_max_ms": max(send_cpu_ms) if send_cpu_ms else float("nan"),
        "slow_sends": len(slow), "slow_sends_off_core": sum(1 for i in slow if off_core[i] > 0),
        "slow_sends_cpu": sum(1 for ms in send_cpu_ms if ms > SLOW_SEND_MS),
        "seconds": elapsed, "produce_seconds": acked - started, "wire_ratio": wire,
        "producer_cpu_us": produce_cpu, "consumer_cpu_us": consume_cpu, "broker_cpu_us": broker_cpu / n * 1e6,
    }


def _available(modes: list[str]) -> list[str]:
    from streamrl.bench.bare_clients import aio_producer  # noqa: F401 - the bus's own client is there

    out = []
    for mode in modes:
        if mode not in MODES:
            raise SystemExit(f"--modes: unknown mode {mode!r} (choose from {', '.join(MODES)})")
        if mode == "aiokafka" and importlib.util.find_spec("aiokafka") is None:
            print("bench bus: aiokafka not installed (pip install 'streamrl[bench]'): skipped", file=sys.stderr)
            continue
        if mode == "aio" and importlib.util.find_spec("confluent_kafka.aio") is None:
            print("bench bus: this confluent-kafka has no asyncio producer: skipped", file=sys.stderr)
            continue
        out.append(mode)
    return out


class BusBench(harness.Bench):
    """Rounds alternate the modes (``--modes``); medians."""

    name = "bus"
    seconds_key = None

    def __init__(self, args: argparse.Namespace):
        from streamrl.pipeline_config import PipelineConfig

        super().__init__(args)
        self.shape = (args.prompt_tokens, args.response_tokens)
        self.record_bytes = len(sample_trajectory(*self.shape).encode())
        self.n = args.records or max(300, int((60e6 if args.quick else 160e6) // self.record_bytes))
        self.rounds = args.rounds or (2 if args.quick else 3)
        self.variants = _available([m.strip() for m in args.modes.split(",") if m.strip()])
        self.cfg = PipelineConfig()
        self.cfg.bus.bootstrap_servers = args.bootstrap_servers
        if args.compression:
            self.cfg.bus.compression = args.compression

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        with open_broker(self.cfg) as (_, broker):  # the broker's process: its CPU per record
            self.bus_cfg, self.broker_pid = asdict(self.cfg.bus), broker.proc.pid if broker is not None else None
            yield

    def measure(self, mode: str, round: int) -> dict[str, float]:
        return run_once(mode, self.bus_cfg, self.n, self.shape, self.broker_pid, self.args.rate)

    def summary(self, runs: harness.Runs) -> dict[str, Any]:
        med = {mode: runs.medians(mode) for mode in runs}
        summary: dict[str, Any] = {"records": self.n, "rounds": self.rounds, "record_bytes": self.record_bytes,
                                   "compression": self.cfg.bus.compression, "rate": self.args.rate}
        summary.update({mode: {k: round(v, 2) for k, v in m.items()} for mode, m in med.items()})
        for a, b in (("bus", "bare"), ("bytes", "bare"), ("bus", "aiokafka")):
            if a in med and b in med:
                summary[f"ratio_{a}_to_{b}"] = round(med[a]["mb_per_s"] / med[b]["mb_per_s"], 3)
        return summary

    def report(self, runs: harness.Runs, summary: dict[str, Any]) -> None:
        rate = self.args.rate
        print(f"compression {self.cfg.bus.compression}, {self.n} distinct-content records of {self.record_bytes} B, "
              f"median of {self.rounds} rounds" + (f", sent at {rate:g} records/s" if rate else ""))
        columns = [("records/s", "records_per_s", ".0f"), ("MB/s", "mb_per_s", ".1f"),
                   ("p50 ms", "p50_latency_ms", ".1f"), ("p99 ms", "p99_latency_ms", ".1f"),
                   ("lag p99", "loop_lag_p99_ms", ".2f"), ("lag max", "loop_lag_max_ms", ".2f"),
                   ("send p99", "send_p99_ms", ".2f"), ("max", "send_max_ms", ".2f"),
                   ("cpu p99", "send_cpu_p99_ms", ".2f"), ("max", "send_cpu_max_ms", ".2f"), ("wire", "wire_ratio", ".3f"),
                   ("cpu/rec us: prod", "producer_cpu_us", ".0f"), ("cons", "consumer_cpu_us", ".0f"),
                   ("broker", "broker_cpu_us", ".0f")]
        medians = {mode: runs.medians(mode) for mode in runs}
        print(harness.table([""] + [c[0] for c in columns],
                            [[mode] + [format(m[key], fmt) for _, key, fmt in columns] for mode, m in medians.items()]))
        for mode in (m for m in runs if m != "bare"):
            slow = {k: sum(int(r[k]) for r in runs[mode]) for k in ("slow_sends", "slow_sends_off_core", "slow_sends_cpu")}
            print(f"{mode}: {slow['slow_sends']} of {self.n * self.rounds} sends held the loop over {SLOW_SEND_MS:.0f} ms; "
                  f"the loop's thread was off its core (preempted or waiting) during {slow['slow_sends_off_core']} of them; "
                  f"{slow['slow_sends_cpu']} sends used over {SLOW_SEND_MS:.0f} ms of CPU")


def main(args: argparse.Namespace) -> int:
    return harness.run(BusBench(args))
