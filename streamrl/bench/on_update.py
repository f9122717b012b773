"""``streamrl bench pipeline --on-update drain,abort,partial``: what a weight update costs a rollout
server, by what it does with the requests in flight, side by side in one run.

RL's length mix is what makes the choice matter: responses log-uniform from ``--min-tokens`` to
``--max-tokens`` (64 to 8,192: most short, a few 100x longer). The server is simulated in time
only (``_sim.serve_tokens``, a real aiohttp server in its own process speaking the OpenAI
completions API, streamed or whole): ``--slots`` requests decode at once (continuous batching),
each at ``--token-ms`` per token whatever the others do, and a weight load takes ``--load-s``
with nothing decoding. The client is the rollout worker's own ``OpenAIBackend`` over its
``ServerFleet``, so drain, abort and partial are the real code paths; the learner is simulated:
every ``--per-version`` finished responses it trains for ``--step-s`` and announces a version,
which the fleet loads at once (as ``RolloutWorker._follow_announcements`` does). ``--slots``
requests are kept in flight.

Figures per mode (steady state: versions after ``--warmup``): seconds per version, responses per
second, the server's busy fraction (slot-seconds decoding over slots x wall time), tokens
generated and thrown away (generated but never part of a finished response: an aborted
request's, or a partial one's few tokens decoded after its last streamed chunk), and the span of
the finished responses (versions from the oldest token to the newest: mean, max) and the worst
staleness (a response's version when it finished minus its oldest token's). The ratios are
partial's and abort's throughput over drain's. No broker, no reward stage, no learner process:
what differs between the modes is the server, and only it is measured.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

from streamrl.bench import harness

MODES = ("drain", "abort", "partial")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of the on-update comparison (``streamrl bench pipeline --on-update ...``)."""
    parser.add_argument("--on-update", default="",
                        help="compare what a rollout server does with requests in flight at a weight update: "
                             "a comma list of drain, abort, partial (RL-shaped lengths, simulated server; "
                             "the other pipeline flags are then not used)")
    parser.add_argument("--slots", type=int, default=32, help="--on-update: requests a server decodes at once")
    parser.add_argument("--token-ms", type=float, default=1.0, help="--on-update: milliseconds per token")
    parser.add_argument("--load-s", type=float, default=0.5, help="--on-update: seconds per weight load")
    parser.add_argument("--min-tokens", type=int, default=64, help="--on-update: shortest response")
    parser.add_argument("--max-tokens", type=int, default=8192, help="--on-update: longest response")
    parser.add_argument("--per-version", type=int, default=64, help="--on-update: responses per version")
    parser.add_argument("--update-step-s", type=float, default=0.5,
                        help="--on-update: the learner's time from its batch to the version's announcement")


@dataclass
class UpdateWorkload:
    versions: int
    warmup: int
    slots: int
    token_s: float
    load_s: float
    min_tokens: int
    max_tokens: int
    per_version: int
    step_s: float

    @property
    def mean_tokens(self) -> float:
        from streamrl.bench._sim import JudgeLatency

        return JudgeLatency(self.min_tokens, self.max_tokens).mean  # the log-uniform mean

    def bound_s_per_version(self) -> float:
        """Every slot decoding all the time, no load: the server's own limit."""
        return self.per_version * self.mean_tokens * self.token_s / self.slots


class OnUpdateBench(harness.Bench):
    """Variants: the ``--on-update`` modes; one run each."""

    name = "pipeline_on_update"

    def __init__(self, args: argparse.Namespace):
        super().__init__(args)
        modes = [m.strip() for m in str(args.on_update).split(",") if m.strip()]
        bad = [m for m in modes if m not in MODES]
        if bad or not modes:
            raise SystemExit(f"streamrl bench pipeline: --on-update {args.on_update!r}: a comma list of {MODES}")
        self.variants = modes
        versions = args.versions or (5 if args.quick else 10)
        warmup = min(args.warmup, versions - 1) if not args.quick else 1
        self.w = UpdateWorkload(versions=versions, warmup=warmup, slots=args.slots, token_s=args.token_ms / 1000,
                                load_s=args.load_s, min_tokens=args.min_tokens, max_tokens=args.max_tokens,
                                per_version=args.per_version, step_s=args.update_step_s)
        self.stamp = time.strftime("%Y%m%d-%H%M%S")

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        from streamrl.bench._sim import SimServer, serve_tokens

        w = self.w
        with SimServer(serve_tokens, w.token_s, w.load_s, w.slots, w.min_tokens, w.max_tokens) as server:
            self.url = server.url
            yield

    async def _stats(self, session: Any, reset: bool = False) -> dict[str, float]:
        async with session.post(f"{self.url}/stats", json={"reset": reset}) as resp:
            return await resp.json()

    async def measure(self, mode: str, seed: int) -> dict[str, Any]:
        import aiohttp

        from streamrl.rollout.backends import SamplingParams
        from streamrl.rollout.backends.openai_server import OpenAIBackend

        w = self.w
        backend = OpenAIBackend("", "sim", servers=[self.url], update_api="sglang", on_update=mode,
                                health_interval_s=0, timeout_s=600.0, token_ids=True)
        await backend.use_starting_weights(0)  # the simulated server's starting weights are version 0
        params = SamplingParams(max_new_tokens=w.max_tokens)
        ends: dict[int, float] = {}
        finished: list[tuple[int, Any]] = []  # (the learner's version when it finished, sample)
        state = {"version": 0, "done": 0}
        all_done = asyncio.Event()
        announcing: set[asyncio.Task] = set()
        counter = iter(range(1 << 62))

        async def announce(version: int) -> None:
            await asyncio.sleep(w.step_s)
            await backend.load_weights(f"/sim/{self.stamp}/v{version}", version)
            state["version"] = version
            ends[version] = time.monotonic()
            if version >= w.versions:
                all_done.set()

        async def client() -> None:
            while not all_done.is_set():
                k = next(counter)
                (group,) = await backend.generate([f"prompt {seed} {k}"], 1, params)
                finished.append((state["version"], group[0]))
                state["done"] += 1
                if state["done"] % w.per_version == 0:
                    task = asyncio.create_task(announce(state["done"] // w.per_version))
                    announcing.add(task)
                    task.add_done_callback(announcing.discard)

        async with aiohttp.ClientSession() as session:
            await self._stats(session, reset=True)
            ends[0] = time.monotonic()
            clients = [asyncio.create_task(client()) for _ in range(w.slots)]
            snapshot: dict[str, float] = {}
            try:
                while not all_done.is_set():
                    await asyncio.sleep(0.05)
                    if not snapshot and w.warmup in ends:
                        snapshot = await self._stats(session)
                last = await self._stats(session)
            finally:
                for t in clients + list(announcing):
                    t.cancel()
                await asyncio.gather(*clients, *announcing, return_exceptions=True)
                await backend.close()
        steady = [(v, s) for v, s in finished]
        spans = [s.version_runs().span for _, s in steady]
        worst = [max(0, v - s.version_runs().oldest) for v, s in steady]
        wall = ends[w.versions] - ends[w.warmup]
        return {
            "s_per_version": wall / (w.versions - w.warmup),
            "busy_fraction": (last["busy_slot_s"] - snapshot["busy_slot_s"]) / (w.slots * (last["at"] - snapshot["at"])),
            "tokens_generated": int(last["tokens"]),
            # decoded and never delivered (the server's count), and delivered, then thrown away
            # by an abort (the client's: requests to following servers are streamed)
            "tokens_thrown_away": int(last["lost"]) + backend.fleet.discarded,
            "tokens_kept": int(sum(len(s.response_logprobs) for _, s in finished)),
            "responses": len(finished),
            "span_mean": sum(spans) / max(1, len(spans)),
            "span_max": max(spans, default=1),
            "worst": max(worst, default=0),
            "continued": backend.fleet.continued,
            "aborted": backend.fleet.aborted,
            "ends": {v: round(t - ends[0], 3) for v, t in sorted(ends.items())},
        }

    def summary(self, runs: harness.Runs) -> dict[str, Any]:
        w, results = self.w, runs.single()
        out: dict[str, Any] = {"s_per_version": {m: round(r["s_per_version"], 3) for m, r in results.items()}}
        if "drain" in results:
            base = results["drain"]["s_per_version"]
            out["throughput_vs_drain"] = {m: round(base / r["s_per_version"], 3) for m, r in results.items()}
        for key in ("busy_fraction", "span_mean"):
            out[key] = {m: round(r[key], 3) for m, r in results.items()}
        for key in ("tokens_generated", "tokens_thrown_away", "span_max", "worst", "continued", "aborted"):
            out[key] = {m: r[key] for m, r in results.items()}
        out["bound_s_per_version"] = round(w.bound_s_per_version(), 3)
        out["workload"] = asdict(w)
        return out

    def report(self, runs: harness.Runs, summary: dict[str, Any]) -> None:
        w = self.w
        print(f"workload: {w.versions} versions x {w.per_version} responses, log-uniform {w.min_tokens}-"
              f"{w.max_tokens} tokens (mean {w.mean_tokens:.0f}); {w.slots} slots at {w.token_s * 1000:g} ms/token; "
              f"weight load {w.load_s:g} s; learner {w.step_s:g} s per version; bound "
              f"{w.bound_s_per_version():.2f} s/version")
        rows = []
        base = runs["drain"][0]["s_per_version"] if "drain" in runs else None
        for mode, (r,) in runs.items():
            rows.append([mode, f"{r['s_per_version']:.2f}", f"{base / r['s_per_version']:.2f}x" if base else "-",
                         f"{r['busy_fraction']:.2f}", r["tokens_generated"], r["tokens_thrown_away"],
                         f"{r['span_mean']:.2f}", r["span_max"], r["worst"]])
        print(harness.table(["on_update", "s/version", "vs drain", "busy", "tokens", "thrown away", "span mean",
                             "span max", "worst"], rows))

    def plot(self, runs: harness.Runs, summary: dict[str, Any], path: Path) -> None:
        from streamrl.plotting import pyplot, save

        plt = pyplot()
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
        names = list(runs)
        bars = ax1.bar(names, [runs[n][0]["s_per_version"] for n in names], color="#3a7dc9")
        ax1.bar_label(bars, fmt="%.2f")
        ax1.axhline(self.w.bound_s_per_version(), color="#c0392b", linestyle="--", label="server bound")
        ax1.set(ylabel="seconds per version", title="Time per version by on_update")
        ax1.legend(fontsize=8)
        for n in names:
            ends = runs[n][0]["ends"]
            vs = sorted(ends)
            ax2.plot([ends[v] for v in vs], vs, marker=".", label=n)
        ax2.set(xlabel="seconds", ylabel="policy version", title="Versions over time")
        ax2.grid(alpha=0.3)
        ax2.legend(fontsize=8)
        save(fig, path, dpi=80)
