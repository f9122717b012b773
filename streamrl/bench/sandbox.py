"""``streamrl bench sandbox``: what isolation costs. The same programs (a Python stdin/stdout case,
as a code reward runs them) executed, in alternating rounds on one machine:

- ``bare``: a plain subprocess with the same rlimits and clean environment (level ``none``, the
  opt-out), the floor any executor pays;
- ``isolated``: the executor under bubblewrap (namespaces, per-slot uid, scratch tmpfs);
- ``service``: the same, through ``streamrl sandbox``'s HTTP API (``/run_code``, in this process).

It prints executions per second for each, the ratios to bare, and the isolation's overhead per
execution (one at a time: the mean latency minus bare's). The last line of stdout is one JSON
object."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any

HELP = "code executions per second isolated (bubblewrap) vs a bare subprocess, side by side"

PROGRAM = "n = int(input())\nxs = list(map(int, input().split()))\nprint(sum(xs))\n"
STDIN = "5\n1 2 3 4 5\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="a short run (under a minute)")
    parser.add_argument("--executions", type=int, default=0, help="executions per variant and round (default 100; "
                                                                   "--quick 20)")
    parser.add_argument("--rounds", type=int, default=0, help="rounds (default 3; --quick 1)")
    parser.add_argument("--concurrency", type=int, default=0, help="executions at once (default: the CPU count)")


async def _throughput(run: Any, n: int, concurrency: int) -> float:
    sem = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with sem:
            out = await run()
            if out != "15\n":
                raise RuntimeError(f"the benchmark program printed {out!r}")

    started = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(n)))
    return n / (time.perf_counter() - started)


async def _latency(run: Any, n: int) -> float:
    times = []
    for _ in range(n):
        started = time.perf_counter()
        await run()
        times.append(time.perf_counter() - started)
    return statistics.mean(times)


async def _bench(executions: int, rounds: int, concurrency: int) -> dict[str, Any]:
    import aiohttp

    from streamrl.sandbox.isolation import Executor, Isolation, Limits, probe
    from streamrl.sandbox.server import ServiceLimits, build_app

    isolation = probe()
    if isolation.level != "namespaces":
        raise SystemExit(f"streamrl bench sandbox: {isolation.describe()}: nothing isolated to measure")
    limits = Limits(wall_s=10, memory_mb=512)
    isolated = Executor(isolation, slots=concurrency)
    bare = Executor(Isolation("none", layers={"rlimits": True}), slots=concurrency, allow_unisolated=True)
    from aiohttp import web

    runner = web.AppRunner(build_app(Executor(isolation, slots=concurrency), ServiceLimits()), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/run_code"
    session = aiohttp.ClientSession()

    async def run_bare() -> str:
        return (await bare.run("python", PROGRAM, STDIN, limits)).stdout

    async def run_isolated() -> str:
        return (await isolated.run("python", PROGRAM, STDIN, limits)).stdout

    async def run_service() -> str:
        body = {"code": PROGRAM, "stdin": STDIN, "language": "python", "run_timeout": 10, "memory_limit_MB": 512}
        async with session.post(url, json=body) as resp:
            return (await resp.json())["run_result"]["stdout"]

    variants = {"bare": run_bare, "isolated": run_isolated, "service": run_service}
    rates: dict[str, list[float]] = {k: [] for k in variants}
    latency: dict[str, list[float]] = {k: [] for k in variants}
    try:
        for r in range(rounds):
            order = list(variants) if r % 2 == 0 else list(reversed(variants))
            for name in order:
                rates[name].append(await _throughput(variants[name], executions, concurrency))
                latency[name].append(await _latency(variants[name], max(5, executions // 10)))
                print(f"round {r + 1}/{rounds} {name}: {rates[name][-1]:.1f} executions/s, "
                      f"{latency[name][-1] * 1000:.1f} ms each alone", file=sys.stderr, flush=True)
    finally:
        await session.close()
        await runner.cleanup()
    med = {k: statistics.median(v) for k, v in rates.items()}
    lat = {k: statistics.median(v) for k, v in latency.items()}
    return {"bench": "sandbox", "isolation": isolation.describe(), "executions": executions, "rounds": rounds,
            "concurrency": concurrency,
            "executions_per_s": {k: round(v, 2) for k, v in med.items()},
            "isolated_over_bare": round(med["isolated"] / med["bare"], 3),
            "service_over_bare": round(med["service"] / med["bare"], 3),
            "latency_ms": {k: round(v * 1000, 2) for k, v in lat.items()},
            "isolation_overhead_ms": round((lat["isolated"] - lat["bare"]) * 1000, 2),
            "service_overhead_ms": round((lat["service"] - lat["bare"]) * 1000, 2)}


def main(args: argparse.Namespace) -> int:
    import os

    executions = args.executions or (20 if args.quick else 100)
    rounds = args.rounds or (1 if args.quick else 3)
    concurrency = args.concurrency or max(1, len(os.sched_getaffinity(0)))
    print(json.dumps(asyncio.run(_bench(executions, rounds, concurrency))), flush=True)
    return 0
